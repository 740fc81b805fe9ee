"""fp8 schemes on the kernels' fp8 WGMMA: no decoding.

    GEMM1: h = act((q1 @ w13_q[e].T) * a13_scale(token) * w13_scale[e](n) + bias)     q1 = quantize(x)
    GEMM2: y = (q2 @ w2_q[e].T) * a2_scale(row) * w2_scale[e](n) + bias               q2 = quantize(h)

(fp8_w8a8_per_tensor: one weight scale per expert, one activation scale per tensor; fp8_w8a8_per_token:
one per weight row n and one per token / grouped row.) fp8_w8a8_block (DeepSeek-V3, Qwen3-FP8: 128x128
weight blocks, 1x128 activation groups) has scales that change along K: the kernels scale each
128-element k-tile's products in their main loop instead (cute_kernels/moe_gemm.py, "fp8_block").

The kernels (cute_kernels.interface with float8_e4m3fn operands) multiply the e4m3 codes on the tensor
cores and scale each accumulator before the bias and the activation, so every call reads the weights'
bytes once, as they are stored: half of bf16's, where decoding (dequant_kernels.py) read them, wrote
them in bf16 and read them again. Activation scales: per tensor (static or dynamic) or per token
(dynamic), quantized by moe_ops::quantize exactly as in the op chain, the intermediate likewise.

Numerics: the products of e4m3 codes are exact, but the tensor cores sum fp8 products with less than
fp32's precision (DeepSeek-V3's report, section 3.3.2). Summing all of K there ("fast accumulation")
measured 2.3% relative error at K = 4096 and 9.8% at K = 14336 on same-sign data (bench/fp8_accuracy.py,
H200, bench/NOTES.md v48), so every scheme adds each 128-element k-tile's sum into fp32 registers (the
report's remedy): the error stays at the bf16 output's rounding at any K. The GPU tests check it against
float64 (tests/cute_kernels/test_fp8_gpu.py, K up to 14336).
"""
from __future__ import annotations

import torch

from .quant.quantize import quantize

# The schemes served: fp8 weights with one scale per expert or per row (GroupShape kinds "per-tensor",
# "per-row") with fp8 activations of a per-tensor or per-row scale (their group as the op chain gives
# it), applied in the epilogue; or 128x128 weight blocks with 1x128 activation groups (the kernels' k-tile
# is 128 fp8 elements: one block along K), applied per k-tile.
WEIGHT_GROUPS = ((-1, -1), (1, -1))
ACTIVATION_GROUPS = ((-1, -1), (1, -1))
BLOCK = ((1, 128), (128, 128))

REASON = "fp8 codes multiplied by the kernels' fp8 WGMMA, scaled per {w} and per {a} {where}; "


# The outputs' (the layer's activations') dtype: the fp8 kernel variants that CI compiles and checks
# (cute_kernels.interface.variants(..., scales="fp8")) write bf16.
DTYPES = (torch.bfloat16,)


def serves(a_dtype: str, a_group, w_dtype: str, w_group, dtype: torch.dtype) -> bool:
    """Whether a quantized GEMM with these formats, its outputs in dtype, runs here (else dequant_kernels
    decodes it)."""
    groups = (tuple(a_group), tuple(w_group))
    return (
        a_dtype == "fp8" and w_dtype == "fp8" and dtype in DTYPES
        and (groups == BLOCK or (groups[0] in ACTIVATION_GROUPS and groups[1] in WEIGHT_GROUPS))
    )  # fmt: skip


def _block(w_group) -> bool:
    return tuple(w_group) == BLOCK[1]


def reason(a_group, w_group) -> str:
    """What explain() says the fp8 kernels do for these activation and weight scale groups."""
    if _block(w_group):
        return REASON.format(a="1x128 group", w="128x128 block", where="in the main loop, per k-tile")
    a = "token" if tuple(a_group) == (1, -1) else "tensor"
    return REASON.format(a=a, w="channel" if tuple(w_group) == (1, -1) else "expert", where="in the epilogue")


def gate_up(
    interface, *, x, a_scale, a_dtype, a_group, w, w_scale, w_group, bias, expert_offsets, gather_idx, activation, alpha,
    limit, gate_layout, out_quant_dtype, out_quant_group, out_scale, out_global_scale, expert_ids,
):  # fmt: skip
    """moe_ops::gate_up for a scheme `serves` accepts: x [M, H] quantized as the chain does, GEMM1 on the
    codes, the intermediate [P, I] quantized for GEMM2. Returns (intermediate, scale) as the op does.
    expert_ids: the routing plan's topk_ids as the kernels' M = 1 weight hint (local ids), or None."""
    q, s = quantize(x, a_dtype, list(a_group), a_scale, None)
    rows = gather_idx.shape[0]
    inter = w.shape[1] // 2 if gate_layout != "none" else w.shape[1]
    # The kernel leaves dropped pairs' rows unwritten; the quantizer reads every row (a per-tensor scale
    # would take a stale row's values), so they start as zeros, as the reference's rows are.
    out = torch.zeros(rows, inter, dtype=x.dtype, device=x.device)
    h = interface.gate_up(
        q, w, bias, expert_offsets, gather_idx, activation=activation, alpha=alpha, limit=limit, gate_layout=gate_layout,
        out=out, expert_ids=expert_ids, a_scale=s, w_scale=w_scale, out_dtype=x.dtype, block_scales=_block(w_group),
    )  # fmt: skip
    if out_quant_dtype == "none":  # a chain whose GEMM2 reads the intermediate unquantized
        return h, h.new_empty((0,), dtype=torch.float32)
    return quantize(h, out_quant_dtype, list(out_quant_group), out_scale, out_global_scale)


def down_reduce(
    interface, *, a, a_scale, w, w_scale, w_group, bias, expert_offsets, topk_weights, inverse, out_dtype, norm_weight, norm_eps,
):  # fmt: skip
    """moe_ops::down_reduce for a scheme `serves` accepts: GEMM2 on the intermediate's codes a [P, I]
    with their scale, then [norm +] router weight + token sum. [M, H] in out_dtype."""
    norm = {} if norm_weight is None else dict(norm_weight=norm_weight, norm_eps=norm_eps)
    return interface.down_reduce(
        a, w, bias, expert_offsets, topk_weights, inverse, a_scale=a_scale, w_scale=w_scale, out_dtype=out_dtype,
        block_scales=_block(w_group), **norm,
    )  # fmt: skip
