"""moe_ops::grouped_gemm: one GEMM per expert over the grouped rows of the routing plan.

out[r] = dequant(a)[row r] @ dequant(w)[expert of r].T (+ bias[expert of r]),   r in [0, offsets[E])
where row r reads a[gather_idx[r]] when gather_idx is given (GEMM1 reads tokens) and a[r] otherwise
(GEMM2 reads the grouped intermediate). Rows from offsets[E] on (dropped pairs) are zero.

The reference dequantizes to float32 and multiplies in float32 on any device, without host syncs:
with torch._grouped_mm where the device has it for the dtype (the offsets stay on the device),
otherwise with a per-row batched product over row chunks. It dequantizes the whole weight on every
call, which costs time and memory: it is the correctness baseline, not the fast path.
"""
from __future__ import annotations

import torch

from . import forward_only
from .quant import formats
from .quant.quantize import dequantize_activation

# (device type, dtype) pairs where torch._grouped_mm multiplies exactly in float32 accumulation.
_NATIVE_GROUPED_MM = {("cpu", torch.float32), ("cuda", torch.bfloat16)}
_CHUNK_BYTES = 1 << 28


def row_experts(expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert of each grouped row, E for rows at or past offsets[E]."""
    ends = expert_offsets[1:].long().contiguous()
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)


def _native_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or (a.device.type, a.dtype) not in _NATIVE_GROUPED_MM or w.dtype != a.dtype:
        return False
    size = a.element_size()
    aligned = all(t.data_ptr() % 16 == 0 for t in (a, w)) and (a.shape[1] * size) % 16 == 0
    return aligned and (w.shape[1] * size) % 16 == 0 and a.stride(1) == 1


def segment_matmul(a: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """a [R, K], w [E, N, K] (same dtype) -> float32 [R, N]: row r times the weight of its expert;
    rows past offsets[E] are zero."""
    rows, num_experts, n = a.shape[0], w.shape[0], w.shape[1]
    expert = row_experts(expert_offsets, rows)
    valid = (expert < num_experts).unsqueeze(1)
    if rows == 0 or num_experts == 0:
        return a.new_zeros((rows, n), dtype=torch.float32)
    if _native_ok(a, w):
        # Rows past the last offset are left unwritten by _grouped_mm; `where` clears them (NaN too).
        out = torch._grouped_mm(a, w.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32)).float()
        return torch.where(valid, out, 0.0)
    out = a.new_empty((rows, n), dtype=torch.float32)
    chunk = max(1, _CHUNK_BYTES // max(1, n * w.shape[2] * 4))
    wf = w.float()
    for start in range(0, rows, chunk):
        idx = expert[start : start + chunk].clamp(max=num_experts - 1)
        out[start : start + chunk] = torch.bmm(wf[idx], a[start : start + chunk].float().unsqueeze(2)).squeeze(2)
    return torch.where(valid, out, 0.0)


@torch.library.custom_op("moe_ops::grouped_gemm", mutates_args=())
def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    a_global_scale: torch.Tensor | None,
    a_dtype: str,
    a_group: list[int],
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_global_scale: torch.Tensor | None,
    w_zero: torch.Tensor | None,
    w_dtype: str,
    w_group: list[int],
    bias: torch.Tensor | None,
    expert_offsets: torch.Tensor,
    gather_idx: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference grouped GEMM; a_dtype / w_dtype "none" mean unquantized. See the module docstring."""
    x = dequantize_activation(a, a_dtype, a_group, a_scale, a_global_scale)
    if gather_idx is not None:
        # Out-of-range indices read nothing (compiled callers are not value-checked).
        g = gather_idx.long()
        ok = ((g >= 0) & (g < x.shape[0])).unsqueeze(1)
        x = torch.where(ok, x[g.clamp(0, max(x.shape[0] - 1, 0))], 0.0)
    if w_dtype == "none":
        wf = w
        if (x.device.type, w.dtype) in _NATIVE_GROUPED_MM and a_dtype == "none":
            x = x.to(w.dtype)  # exact: x came from w's dtype
        else:
            wf = w.float()
    else:
        wf = formats.dequantize(w, w_dtype, (w_group[0], w_group[1]), w_scale, w_global_scale, w_zero)
    out = segment_matmul(x if x.dtype == wf.dtype else x.float(), wf, expert_offsets)
    if bias is not None:
        expert = row_experts(expert_offsets, out.shape[0])
        num_experts = w.shape[0]
        row_bias = bias.float()[expert.clamp(max=max(num_experts - 1, 0))]
        out = out + torch.where((expert < num_experts).unsqueeze(1), row_bias, 0.0)
    return out.to(out_dtype)


@grouped_gemm.register_fake
def _grouped_gemm_fake(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, out_dtype,
):  # fmt: skip
    rows = gather_idx.shape[0] if gather_idx is not None else a.shape[0]
    torch._check(expert_offsets.shape[0] == w.shape[0] + 1, lambda: "expert_offsets must have E + 1 entries")
    return a.new_empty((rows, w.shape[1]), dtype=out_dtype)


forward_only.register(grouped_gemm)
