"""moe_ops::grouped_gemm: one GEMM per expert over the grouped rows of the routing plan.

out[r] = dequant(a)[row r] @ dequant(w)[expert of r].T (+ bias[expert of r]),   r in [0, offsets[E])
where row r reads a[gather_idx[r]] when gather_idx is given (GEMM1 reads tokens) and a[r] otherwise
(GEMM2 reads the grouped intermediate). Rows from offsets[E] on (dropped pairs) are zero.

The reference dequantizes to float32 and multiplies in float32 on any device, without host syncs:
with torch._grouped_mm where the device has kernels of its own for the dtype (on CUDA: sm_90, sm_100)
and the output is stored in that dtype
(the offsets stay on the device; on CUDA, bf16: the float32 sums come back rounded to bf16, and a bias
is added to them in float32 before the output's own rounding), otherwise with a per-row batched
product over row chunks. Quantized weights are dequantized on every call: only the experts of each
chunk's rows when there are fewer rows than experts (decoding: k experts read, not E) or when the
whole float32 weight would exceed _WHOLE_DEQUANT_BYTES where the product is the batched one (on
CUDA); otherwise whole, a chunk of experts at a time, for torch._grouped_mm (the CPU) or for the
batched product to gather. It is the correctness baseline, not the fast path.
"""
from __future__ import annotations

import torch

from . import _checks, devices, forward_only
from .quant import formats
from .quant import tiled
from .quant.quantize import ACTIVATION_STORAGE, dequantize_activation

# (device type, dtype) pairs where torch._grouped_mm multiplies exactly in float32 accumulation.
_NATIVE_GROUPED_MM = {("cpu", torch.float32), ("cuda", torch.bfloat16)}
# CUDA GPUs (compute capability majors) where torch._grouped_mm has its own kernels. On others (A100,
# L40, ...) ATen's fallback copies the offsets to the host (offs.cpu()): a sync per call, which a CUDA
# graph capture refuses; the batched product needs none.
_GROUPED_MM_CUDA_MAJORS = (9, 10)


def native_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm serves `dtype` on `device` exactly and without a host sync."""
    if not hasattr(torch, "_grouped_mm") or (device.type, dtype) not in _NATIVE_GROUPED_MM:
        return False
    return device.type != "cuda" or devices.capability(device)[0] in _GROUPED_MM_CUDA_MAJORS


_CHUNK_BYTES = 1 << 28
# Quantized weights up to this size in float32 are dequantized whole for calls with at least as many rows
# as experts, where the batched product then gathers float32 rows: one dequantization instead of one per
# row (3.8x-6.7x faster on an H200, bench/NOTES.md v43). Larger ones are dequantized per chunk of rows.
# gpt-oss-120b's w13 is 7.9 GiB in float32, DeepSeek-V3's 28 GiB (256 experts, unsharded).
_WHOLE_DEQUANT_BYTES = 8 << 30
# a_dtype / w_dtype -> elements per stored element along K ("none": unquantized).
_A_PACKING = {"none": 1, **{k: formats.PACKING[k] for k in ACTIVATION_STORAGE}}
_W_PACKING = {"none": 1, **formats.PACKING}
_W_FORMATS = (*_W_PACKING, *tiled.TILED_FORMATS)


def row_experts(expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert of each grouped row, E for rows at or past offsets[E]."""
    ends = expert_offsets[1:].long().contiguous()
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)


def _aligned(t: torch.Tensor, unit_dim: int) -> bool:
    """Whether t.stride(unit_dim) is 1 and t's start and every other stride are multiples of 16 bytes."""
    size = t.element_size()
    others = [s for d, s in enumerate(t.stride()) if d != unit_dim % t.dim()]
    return t.stride(unit_dim) == 1 and t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in others)


def _native_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    if not native_grouped_mm(a.device, a.dtype) or w.dtype != a.dtype:
        return False
    size = a.element_size()
    # torch._grouped_mm raises unless every stride is 16-byte aligned: a K-slice of a wider weight (row-
    # or column-major, both of which fused_experts accepts) takes the batched path instead.
    return (
        _aligned(a, 1) and (_aligned(w, 2) or _aligned(w, 1))
        and (a.shape[1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0
    )


def segment_matmul(a: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, expert_weights=None) -> torch.Tensor:
    """a [R, K], w [E, N, K] (same dtype) -> float32 [R, N]: row r times the weight of its expert;
    rows past offsets[E] are zero. expert_weights(idx) -> float32 [len(idx), N, K], the weights of
    experts idx, stands in for w[idx] on the batched path (quantized w: packed, dequantized per chunk)."""
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
    chunk = max(1, _CHUNK_BYTES // max(1, n * a.shape[1] * 4))
    if expert_weights is None:
        wf = w.float()
        expert_weights = wf.__getitem__
    for start in range(0, rows, chunk):
        idx = expert[start : start + chunk].clamp(max=num_experts - 1)
        out[start : start + chunk] = torch.bmm(expert_weights(idx), a[start : start + chunk].float().unsqueeze(2)).squeeze(2)
    return torch.where(valid, out, 0.0)


def _dequantizer(w, w_dtype, w_group, w_scale, w_global_scale, w_zero, k: int | None = None):
    """idx [c] -> float32 [c, N, K]: experts idx of the quantized w, dequantized. Scales, global scales and
    zero points with one entry per expert are gathered with them; one shared by all is used as it is. Tiled
    mxfp4 (quant/tiled.py; k: the GEMM's K) is read back to codes and scales per call, for those experts only."""
    num_experts = w.shape[0]
    if tiled.is_tiled(w_dtype):
        return lambda idx: tiled.dequantize(w[idx], w_dtype, k)

    def pick(t, idx):
        return t[idx] if t is not None and t.dim() and t.shape[0] == num_experts else t

    def experts(idx):
        return formats.dequantize(
            w[idx], w_dtype, (w_group[0], w_group[1]), pick(w_scale, idx), pick(w_global_scale, idx), pick(w_zero, idx)
        )

    return experts


def _dequantize_whole(experts, w: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [E, N, K]: every expert of w dequantized, a chunk of experts at a time, so that the
    decoding's temporaries (a few times its output) stay a chunk's worth."""
    num_experts, n = w.shape[0], w.shape[1]
    out = torch.empty((num_experts, n, k), dtype=torch.float32, device=w.device)
    step = max(1, _CHUNK_BYTES // max(1, n * k * 4))
    for start in range(0, num_experts, step):
        out[start : start + step] = experts(slice(start, start + step))
    return out


def check_gemm_args(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, out_dtype, a_name="a",
) -> None:  # fmt: skip
    """The op's arguments (shapes, dtypes and devices only, no values: safe under compile). Quantized
    storage dtypes and scale shapes are not checked: the format strings say how to read them (a chain
    written by hand may read int8 codes as fp8, see tests/lowering). a_name: the caller's name for a."""
    _checks.expect_choice("a_dtype", a_dtype, _A_PACKING)
    _checks.expect_choice("w_dtype", w_dtype, _W_FORMATS)
    _checks.expect_ndim(a_name, a, 2, "[R, K] (or packed [R, K/2])")
    _checks.expect_ndim("w", w, 3, "[E, N, K] (or packed [E, N, K/2], or tiled [E, N, B])")
    for name, t, fmt in ((a_name, a, a_dtype), ("w", w, w_dtype)):
        if fmt == "none":
            _checks.expect_dtype(name, t, _checks.FLOAT_DTYPES)
    w_tiled = tiled.is_tiled(w_dtype)
    for name, scale, fmt in (("a_scale", a_scale, a_dtype), ("w_scale", w_scale, "none" if w_tiled else w_dtype)):
        if fmt != "none" and scale is None:
            raise ValueError(f"{name}: {fmt!r} values need their scales, got None")
    if w_tiled:
        if w_scale is not None:
            raise ValueError(f"w_scale: {w_dtype!r} weights hold their scales, got one {tuple(w_scale.shape)}; pass None")
        if tuple(w_group) != tiled.GROUP:
            raise ValueError(f"w_group: {w_dtype!r} has mxfp4's groups {list(tiled.GROUP)}, got {list(w_group)}")
        tiled.check_tiled("w", w, w_dtype, a.shape[1] * _A_PACKING[a_dtype])
    # nvfp4's values are off by exactly their global scale without it, and no other format has one:
    # either mistake would pass silently through the dequantization.
    for name, scale, fmt in (("a_global_scale", a_global_scale, a_dtype), ("w_global_scale", w_global_scale, w_dtype)):
        if (scale is not None) != (fmt in formats.GLOBAL_SCALE_FORMATS):
            wants = "needs its float32 global scale" if scale is None else "has no global scale (nvfp4 only)"
            raise ValueError(f"{name}: {fmt!r} {wants}, got {'None' if scale is None else tuple(scale.shape)}")
    if w_global_scale is not None and w_global_scale.numel() not in (1, w.shape[0]):
        raise ValueError(f"w_global_scale: expected one value or one per expert [{w.shape[0]}], got shape {tuple(w_global_scale.shape)}")
    if a_global_scale is not None and a_global_scale.numel() != 1:
        raise ValueError(f"a_global_scale: expected one value [1], got shape {tuple(a_global_scale.shape)}")
    if w_zero is not None and w_dtype != "int4":
        raise ValueError(f"w_zero: zero points are for int4 weights only, got one for w_dtype={w_dtype!r}")
    k_a = a.shape[1] * _A_PACKING[a_dtype]
    k_w = k_a if w_tiled else w.shape[2] * _W_PACKING[w_dtype]  # a tiled w's K is the one check_tiled checked
    if k_a != k_w:
        raise ValueError(
            f"{a_name} and w: K differs, {a_name} {tuple(a.shape)} ({a_dtype}) holds K={k_a}, w {tuple(w.shape)} ({w_dtype}) K={k_w}"
        )
    num_experts, n = w.shape[0], w.shape[1]
    _checks.expect_shape("expert_offsets", expert_offsets, (num_experts + 1,), "[E+1]")
    _checks.expect_dtype("expert_offsets", expert_offsets, _checks.INDEX_DTYPES)
    if gather_idx is not None:
        _checks.expect_ndim("gather_idx", gather_idx, 1, "[R]")
        _checks.expect_dtype("gather_idx", gather_idx, _checks.INDEX_DTYPES)
    if bias is not None:
        _checks.expect_shape("bias", bias, (num_experts, n), "[E, N]")
        _checks.expect_dtype("bias", bias, _checks.FLOAT_DTYPES)
    if out_dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"out_dtype: got {out_dtype}; allowed: {', '.join(map(str, _checks.FLOAT_DTYPES))}")
    _checks.expect_same_device(
        {a_name: a, "w": w, "expert_offsets": expert_offsets, "gather_idx": gather_idx, "bias": bias, "a_scale": a_scale,
         "a_global_scale": a_global_scale, "w_scale": w_scale, "w_global_scale": w_global_scale, "w_zero": w_zero}
    )  # fmt: skip


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
    check_gemm_args(
        a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, gather_idx, out_dtype,
    )  # fmt: skip
    x = dequantize_activation(a, a_dtype, a_group, a_scale, a_global_scale)
    num_experts = w.shape[0]
    if gather_idx is not None:
        # Out-of-range indices read nothing (compiled callers are not value-checked).
        g = gather_idx.long()
        ok = ((g >= 0) & (g < x.shape[0])).unsqueeze(1)
        # No token at all (x [0, K]): every index is out of range and there is no row to clamp to.
        rows = x[g.clamp(0, x.shape[0] - 1)] if x.shape[0] else x.new_zeros((g.shape[0], x.shape[1]))
        x = torch.where(ok, rows, 0.0)
    if w_dtype == "none":
        wf = w
        # torch._grouped_mm returns its float32 sums rounded to w's dtype (on CUDA a float32 output takes
        # its fallback, which reads the offsets on the host): native only for an output of that dtype.
        native = native_grouped_mm(x.device, w.dtype) and out_dtype == w.dtype
        if native and a_dtype == "none" and a.dtype == w.dtype:
            x = x.to(w.dtype)  # exact: x came from w's dtype (another dtype's x would be rounded)
        else:
            wf = w.float()
        out = segment_matmul(x if x.dtype == wf.dtype else x.float(), wf, expert_offsets)
    else:
        experts = _dequantizer(w, w_dtype, w_group, w_scale, w_global_scale, w_zero, x.shape[1])
        native = native_grouped_mm(x.device, torch.float32)
        if x.shape[0] >= num_experts and (native or num_experts * w.shape[1] * x.shape[1] * 4 <= _WHOLE_DEQUANT_BYTES):
            out = segment_matmul(x.float(), _dequantize_whole(experts, w, x.shape[1]), expert_offsets)
        else:
            out = segment_matmul(x.float(), w, expert_offsets, experts)
    if bias is not None and num_experts:  # no expert (E = 0): every row is dropped, bias [0, N] has no row
        expert = row_experts(expert_offsets, out.shape[0])
        row_bias = bias.float()[expert.clamp(max=num_experts - 1)]
        out = out + torch.where((expert < num_experts).unsqueeze(1), row_bias, 0.0)
    return out.to(out_dtype)


@grouped_gemm.register_fake
def _grouped_gemm_fake(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, out_dtype,
):  # fmt: skip
    check_gemm_args(
        a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, gather_idx, out_dtype,
    )  # fmt: skip
    rows = gather_idx.shape[0] if gather_idx is not None else a.shape[0]
    return a.new_empty((rows, w.shape[1]), dtype=out_dtype)


forward_only.register(grouped_gemm)
