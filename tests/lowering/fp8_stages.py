"""Stage-wise float64 checks of a layer whose intermediate is quantized to fp8 per token (gate_up's
codes and scales, then down_reduce given them), for the fused kernels on the GPU.

Why not the whole layer against moe_float64: the kernels compute GEMM2's input in float32 and round it
to bf16 before quantizing it, so a value within a bf16 rounding of an fp8 code boundary may take either
code, and at M = 1 one such code weighs up to ~4x a tolerance narrow enough to catch a layer that skips
the quantization (bench/NOTES.md v55 item 5: ~1% of M = 1 cases failed). Checked apart, each code is
judged against its own value, so a code at a boundary passes either way and a wrong code anywhere else
fails; GEMM1 is computed from the layer's own codes of x (moe_ops::quantize's, checked against float64
by its own tests), and GEMM2 given the layer's own intermediate codes, where nothing is ambiguous.
"""
from __future__ import annotations

import torch

from moe_ops.reference import apply_activation

from ..decoders import decode_e4m3

E4M3_MAX = 448.0
# How far the layer's GEMM2 input may lie from the float64 one before quantization: a bf16 rounding of
# the activation's float32 output (at most 2**-8 relative, so 2**-7 leaves the float32 sums room) ...
REL_MARGIN = 2.0**-7
# ... plus this much of the row's max: the tensor cores' fp8 sums within a k-tile carry less than
# float32's precision, which no relative margin covers where a sum nearly cancels.
ABS_MARGIN = 1e-3


def e4m3_half_step(y: torch.Tensor) -> torch.Tensor:
    """float64 y (in code units) -> half the spacing of e4m3 codes at |y| (3 mantissa bits; subnormal
    spacing 2**-9 below 2**-6): the most a nearest-code rounding of y may err."""
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3) / 2


def pair_activations(xq, w13, b13, topk_ids, activation) -> torch.Tensor:
    """float64 [M*k, I]: for pair p = m*k + j, act(xq[m] @ w13[e].T + b13[e]) with e = topk_ids[m, j] and
    nothing rounded after. xq [M, H]: the values of GEMM1's input codes (the layer's own, for the GPU
    check: an independent quantization of x could take the other code at a tie, which moves a whole row
    of GEMM1's output)."""
    ids = topk_ids.long().cpu().reshape(-1)
    k = topk_ids.shape[1]
    w = w13.double().cpu()[ids]  # [P, 2I, H]
    h = torch.einsum("ph,pnh->pn", xq.double().cpu()[torch.arange(ids.numel()) // k], w)
    if b13 is not None:
        h = h + b13.double().cpu()[ids]
    return apply_activation(h, activation.kind, activation.alpha, activation.limit, activation.interleaved)


def x_codes_float64(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [M, H]: the values of x's per-token fp8 codes [M, H] with float32 scales [M, 1]."""
    return decode_e4m3(codes.cpu()) * scales.double().cpu().reshape(-1, 1)


def fp8_row_violations(codes: torch.Tensor, scales: torch.Tensor, a64: torch.Tensor):
    """codes fp8 [P, I] and scales float32 [P, 1] of a per-token quantization of a64 (float64 [P, I], the
    same rows) -> (scale_err, excess): the scales' relative error against max|a64| / 448 per row, and per
    element how far its code lies beyond what a nearest-code rounding within the margins allows, in code
    units (<= 0 everywhere for a right quantization)."""
    s = scales.double().cpu().reshape(-1, 1)
    amax = a64.abs().amax(dim=1, keepdim=True)
    scale_err = ((s - amax / E4M3_MAX).abs() / (amax / E4M3_MAX).clamp(min=1e-300)).reshape(-1)
    y = a64 / s
    got = decode_e4m3(codes.cpu())
    allowed = e4m3_half_step(y) + REL_MARGIN * y.abs() + ABS_MARGIN * E4M3_MAX
    return scale_err, (got - y).abs() - allowed


def check_fp8_rows(codes, scales, a64):
    """Assert that each row of codes/scales is a per-token fp8 quantization of a64's row: the scale within
    REL_MARGIN of max|a64| / 448, each code the nearest to its value or, within the margins of a boundary,
    its neighbour."""
    scale_err, excess = fp8_row_violations(codes, scales, a64)
    assert scale_err.max().item() <= REL_MARGIN, f"per-token scale off by {scale_err.max().item():.3g} relative (row {scale_err.argmax().item()})"
    worst = excess.max().item()
    if worst > 0:
        r, c = divmod(excess.argmax().item(), excess.shape[1])
        y = (a64[r, c] / scales.double().cpu().reshape(-1)[r]).item()
        raise AssertionError(f"fp8 code at row {r}, column {c}: {decode_e4m3(codes.cpu()[r, c]).item()} for the value {y:.6g} "
                             f"(code units), {worst:.3g} beyond the nearest code's margin")  # fmt: skip


def down_from_codes(codes, scales, w2, b2, topk_weights, topk_ids, rows) -> torch.Tensor:
    """float64 [M, H]: sum_j w[m, j] * (codes[r] * scales[r] @ w2[e].T + b2[e]) with r = rows[m*k + j] (the
    pair's grouped row) and e = topk_ids[m, j]: GEMM2 and the weighted sum given the layer's own codes."""
    m, k = topk_ids.shape
    r = rows.long().cpu()
    a = decode_e4m3(codes.cpu())[r] * scales.double().cpu().reshape(-1, 1)[r]  # [P, I]
    ids = topk_ids.long().cpu().reshape(-1)
    y = torch.einsum("pi,phi->ph", a, w2.double().cpu()[ids])
    if b2 is not None:
        y = y + b2.double().cpu()[ids]
    return (y * topk_weights.double().cpu().reshape(-1, 1)).reshape(m, k, -1).sum(dim=1)
