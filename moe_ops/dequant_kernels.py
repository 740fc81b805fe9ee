"""Quantized schemes on a Hopper GPU: the weights (and quantized activations) dequantized on each call to
the activations' dtype, then the bf16/fp16 CuTe DSL kernels (cute_kernels.interface).

The fp8 schemes (per-tensor, per-token, 128x128 blocks; bf16 layers) skip all this: the kernels multiply
their codes (fp8_kernels.py, dispatched from gate_up and down_reduce here); so does mxfp4_w4a16 in bf16 layers
with a gated activation, whose kernels decode the codes in registers (w4_kernels.py). For the others: the reference, which
every quantized scheme ran on before, multiplies float32 values on CUDA one gathered weight per grouped row (its grouped_mm has no
float32 path without a host sync): 105 ms for a qwen3-shaped fp8 layer at M = 1024, 361 ms for gpt-oss
in mxfp4 (bench/NOTES.md v43). Here each call decodes the weights it reads once, into the activations'
dtype, and the kernels do the rest:
- the experts with grouped rows are packed into S = min(rows, E) slots (expert_slots.py), and the kernels
  run a plain grouped GEMM over the slots' decoded weights and offsets;
- on CUDA only the slots with rows are decoded, in one Triton launch (decode_kernel.py): a token's k
  experts at M = 1, the experts in use at M = 16 (about 60% of qwen3's 128, 40% of gpt-oss's), each
  once; on the CPU (tests) torch decodes every slot, a chunk at a time.
The decoded tensor takes at most E x N x K elements of the activations' dtype; `why_not` declines a layer
whose tensor would exceed MAX_BYTES (the reference then runs it, with its warning).

The activations a scheme quantizes are quantized by moe_ops::quantize exactly as in the op chain, then
dequantized for the kernels; GEMM1's output is quantized the same way for GEMM2. So the result is the
chain's up to the roundings of the decoded values to bf16/fp16 (the reference keeps them in float32):
about 2**-9 relative per bf16 element, below the output's own rounding.

No host sync: the slots are found on the device, and every size is a shape.
"""
from __future__ import annotations

import torch

from . import fp8_kernels, w4_kernels
from .expert_slots import expert_slots
from .gemm import _CHUNK_BYTES, _dequantizer
from .quant.formats import PACKING
from .quant.quantize import dequantize_activation, quantize

# The largest decoded weight of one GEMM (E x N x K in the activations' dtype) this path allocates:
# gpt-oss-120b's w13 takes 4.0 GiB in bf16, an unsharded DeepSeek-V3's 14 GiB (declined: shard its
# experts with expert_map).
MAX_BYTES = 8 << 30

REASON = "weights dequantized to {dtype} on each call (the kernels multiply fp8 codes of bf16 layers only), then "


def decoded_bytes(num_experts: int, n: int, k: int, dtype: torch.dtype) -> int:
    """The most bytes the decoded weight of an [E, N, K] GEMM takes in `dtype` (the whole-weight case)."""
    return num_experts * n * k * dtype.itemsize


def why_not(which: str, num_experts: int, n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why this path cannot serve GEMM `which` ("w13" or "w2", [E, N, K] once decoded) in `dtype`, or None."""
    size = decoded_bytes(num_experts, n, k, dtype)
    if size > MAX_BYTES:
        return (
            f"{which} decoded to {dtype} would take {size / 2**30:.1f} GiB (E={num_experts}, N={n}, K={k}); the "
            f"dequantizing path allocates at most {MAX_BYTES / 2**30:.0f} GiB per GEMM (fewer local experts, "
            "through expert_map, make it smaller)"
        )
    return None


def dequantized_experts(
    w, w_dtype, w_group, w_scale, w_global_scale, w_zero, bias, expert_offsets, rows: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(weights [S, N, K] in dtype, bias [S, N] or None, offsets [S+1] int32) that the kernels read as a
    plain grouped GEMM over the same `rows` grouped rows: S = min(rows, E) slots, the experts with rows
    packed into the first ones (expert_slots.py), the rest empty. w: the quantized [E, N, K / packing];
    bias [E, N]. On CUDA only the slots with rows are decoded (the others stay uninitialised: the kernels
    read no weight of a slot without rows)."""
    if w_dtype == "none":  # a hand-written chain may quantize the activations only
        return w.to(dtype).contiguous(), bias, expert_offsets
    num_experts, n, k = w.shape[0], w.shape[1], w.shape[2] * PACKING[w_dtype]
    slots = min(rows, num_experts)
    idx, offsets = expert_slots(expert_offsets, num_experts, slots)
    if w.device.type == "cuda":
        from .decode_kernel import decode_experts  # Triton: imported where it runs

        out = decode_experts(w, w_dtype, w_group, w_scale, w_global_scale, w_zero, idx, slots, dtype, offsets=offsets)
    else:
        experts = _dequantizer(w, w_dtype, w_group, w_scale, w_global_scale, w_zero)
        out = torch.empty((slots, n, k), dtype=dtype, device=w.device)
        step = max(1, _CHUNK_BYTES // max(1, n * k * 4))  # float32 temporaries of a chunk
        for start in range(0, slots, step):
            out[start : start + step] = experts(idx[start : start + step])
    return out, (None if bias is None else bias[idx]), offsets


def _activations(a, a_dtype, a_group, a_scale, a_global_scale, dtype):
    """a as the kernels read it: dequantized to dtype when a_dtype says it is quantized. On CUDA the decode
    kernel does it in one launch ([M, K] as one expert's weight, the same values bit for bit), where torch
    takes five (the codes, the groups' expansion, two products, the cast): at M = 1 the launches are the
    time."""
    if a_dtype == "none":
        return a
    if a.device.type == "cuda":
        from .decode_kernel import decode_experts  # Triton: imported where it runs

        return decode_experts(
            a.unsqueeze(0), a_dtype, a_group, a_scale.unsqueeze(0), a_global_scale, None, None, 1, dtype
        )[0]  # fmt: skip
    return dequantize_activation(a, a_dtype, a_group, a_scale, a_global_scale).to(dtype)


def gate_up(
    interface, *, x, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, activation, alpha, limit, interleaved, gate_layout,
    out_quant_dtype, out_quant_group, out_scale, out_global_scale, out_dtype, expert_ids=None,
):  # fmt: skip
    """moe_ops::gate_up through the kernels (the op's arguments, plus the kernels' gate_layout): x [M, H]
    quantized and dequantized as a_dtype says, w decoded (dequantized_experts), GEMM1 + activation in the
    kernel, the intermediate [P, I] quantized as out_quant_dtype says. Returns (intermediate, scale) as the
    op does. The schemes fp8_kernels serves run there, on the codes, with expert_ids as the kernels'
    hint; here expert_ids is not read (the kernel's hint indexes E experts, not slots)."""
    if fp8_kernels.serves(a_dtype, a_group, w_dtype, w_group, x.dtype):
        return fp8_kernels.gate_up(
            interface, x=x, a_scale=a_scale, a_dtype=a_dtype, a_group=a_group, w=w, w_scale=w_scale, w_group=w_group, bias=bias,
            expert_offsets=expert_offsets, gather_idx=gather_idx, activation=activation, alpha=alpha, limit=limit,
            gate_layout=gate_layout, out_quant_dtype=out_quant_dtype, out_quant_group=out_quant_group, out_scale=out_scale,
            out_global_scale=out_global_scale, expert_ids=expert_ids,
        )  # fmt: skip
    if w4_kernels.serves(a_dtype, w_dtype, w_group, x.dtype, activation, out_quant_dtype):
        return w4_kernels.gate_up(
            interface, x=x, w=w, w_scale=w_scale, w_dtype=w_dtype, bias=bias, expert_offsets=expert_offsets, gather_idx=gather_idx,
            activation=activation, alpha=alpha, limit=limit, gate_layout=gate_layout,
        ), x.new_empty((0,), dtype=torch.float32)  # fmt: skip
    dtype = x.dtype
    if a_dtype != "none":
        q, s = quantize(x, a_dtype, list(a_group), a_scale, a_global_scale)
        x = _activations(q, a_dtype, a_group, s, a_global_scale, dtype)
    rows = gather_idx.shape[0]
    wd, bd, offsets = dequantized_experts(
        w, w_dtype, w_group, w_scale, w_global_scale, w_zero, bias, expert_offsets, rows, dtype
    )  # fmt: skip
    inter = wd.shape[1] // 2 if gate_layout != "none" else wd.shape[1]
    # The kernel leaves dropped pairs' rows unwritten; a quantizer reads every row (a per-tensor scale
    # would take a stale row's values), so they start as zeros, as the reference's rows are.
    out = torch.zeros(rows, inter, dtype=dtype, device=x.device) if out_quant_dtype != "none" else None
    h = interface.gate_up(
        x, wd, bd, offsets, gather_idx, activation=activation,
        alpha=alpha, limit=limit, gate_layout=gate_layout, out=out,
    )  # fmt: skip
    if out_quant_dtype == "none":
        return h, h.new_empty((0,), dtype=torch.float32)
    return quantize(h, out_quant_dtype, list(out_quant_group), out_scale, out_global_scale)


def down_reduce(
    interface, *, a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, topk_weights, inverse, out_dtype, weights_early=False, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    """moe_ops::down_reduce through the kernels: a [P, I'] dequantized to out_dtype, w decoded
    (dequantized_experts), GEMM2 + [norm] + router weight + token sum in the kernels. [M, H] in out_dtype.
    weights_early (w and expert_offsets written before the kernel launched just before this one) serves only
    tiled mxfp4 weights on the w4a16 kernels (w4_kernels.down_reduce); elsewhere the kernel before GEMM2 is the
    decoding that writes its weights (or, for the schemes fp8_kernels serves, the intermediate's quantizer)."""
    if fp8_kernels.serves(a_dtype, a_group, w_dtype, w_group, out_dtype):
        return fp8_kernels.down_reduce(
            interface, a=a, a_scale=a_scale, w=w, w_scale=w_scale, w_group=w_group, bias=bias, expert_offsets=expert_offsets,
            topk_weights=topk_weights, inverse=inverse, out_dtype=out_dtype, norm_weight=norm_weight, norm_eps=norm_eps,
        )  # fmt: skip
    if w4_kernels.serves(a_dtype, w_dtype, w_group, out_dtype):
        return w4_kernels.down_reduce(
            interface, a=a, w=w, w_scale=w_scale, w_dtype=w_dtype, bias=bias, expert_offsets=expert_offsets, topk_weights=topk_weights,
            inverse=inverse, norm_weight=norm_weight, norm_eps=norm_eps, weights_early=weights_early,
        )  # fmt: skip
    rows = a.shape[0]
    x = _activations(a, a_dtype, a_group, a_scale, a_global_scale, out_dtype)
    wd, bd, offsets = dequantized_experts(
        w, w_dtype, w_group, w_scale, w_global_scale, w_zero, bias, expert_offsets, rows, out_dtype
    )  # fmt: skip
    norm = {} if norm_weight is None else dict(norm_weight=norm_weight, norm_eps=norm_eps)
    return interface.down_reduce(
        x.contiguous(), wd, bd, offsets, topk_weights, inverse,
        weights_early=False, **norm,
    )  # fmt: skip
