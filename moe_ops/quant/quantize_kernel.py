"""moe_ops::quantize on CUDA in Triton, for fp8 and int8: per-token and per-token-group (dynamic: amax /
448 or / 127 per group) and static per-tensor scales in one launch; per-tensor dynamic scales in three
(a zeroed float32, the amax over every row by atomic max, then the quantizing), or for one row (a decode
step's x) in one, as a per-row scale (formats.group_amax reads a group within one row as the row's own).
Same codes and scales bit for bit as formats.quantize_fp8 / quantize_int8, whose torch ops take about a
dozen launches (the amax, the scale's expansion, float32 temporaries of each step), each a pass over the
tensor: at M = 1 the launches are the time, at mixtral's M = 1024 the passes (about 1 ms of a 1.9 ms fp8
layer on an H200, bench/NOTES.md v47). nvfp4 stays with torch.

Per-tensor over several rows: amax = max |x| over the finite values (formats.group_amax: one bad token
must not turn every other token's scale into NaN), then as below. Per group within a row: amax = max |x| (NaN if any x is
NaN, inf if any is inf, as torch's amax), scale = max(amax *
fl32(1 / MAX), 1e-12) (NaN stays NaN; torch on CUDA divides by a number as a product with its float32
reciprocal, one ulp from a true division at times), then
- fp8: q = e4m3(clamp(x / scale, -448, 448)), an inf x giving NaN (e4m3fn has no inf);
- int8: q = clamp(round_half_even(x / scale), -127, 127), NaN giving 0.
x / scale is an IEEE division (div.rn), as torch's tensor division; the e4m3 conversion rounds to nearest even, as torch's cast.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..launch_ints import cdiv, next_power_of_2
from ..plan_kernel import compile_options, on_device
from .formats import _TINY, FP8_MAX, INT8_MAX
from .quantize import ACTIVATION_STORAGE


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, cols, x_stride, BLOCK: tl.constexpr):
    """amax_ptr[0] = max(amax_ptr[0], max |x[r]| over the row's finite values), row r = program 0. A max
    is exact and order-free: the atomic gives the same value on every run."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * x_stride + c, mask=c < cols, other=0.0).to(tl.float32)
    magnitude = tl.abs(x)
    magnitude = tl.where(magnitude < float("inf"), magnitude, 0.0)  # NaN and inf: skipped (0)
    tl.atomic_max(amax_ptr, tl.max(magnitude, 0), sem="relaxed")


@triton.jit
def _quantize_kernel(
    x_ptr, static_ptr, q_ptr, scale_ptr, cols, x_stride, scale_cols,
    GC: tl.constexpr, STATIC: tl.constexpr, TENSOR: tl.constexpr, FP8: tl.constexpr, LIMIT: tl.constexpr,
    INV_LIMIT: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Group (row r, group g) of x: GC columns from g * GC (GC = 0: the whole row, BLOCK >= cols).
    STATIC: the scale is static_ptr[0]; TENSOR: it is computed from the tensor's amax, static_ptr[0]
    (_amax_kernel), and row 0 stores it."""
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    c = g * GC + lane
    inside = c < cols
    if GC > 0:
        inside = inside & (lane < GC)
    x = tl.load(x_ptr + r * x_stride + c, mask=inside, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    elif TENSOR:
        scale = tl.load(static_ptr) * INV_LIMIT
        scale = tl.where(scale < TINY, TINY, scale)
        if r == 0:
            tl.store(scale_ptr, scale)
    else:
        amax = tl.max(tl.abs(x), 0)
        amax = tl.where(tl.max((x != x).to(tl.int32), 0) > 0, float("nan"), amax)  # max.f32 drops NaN
        scale = amax * INV_LIMIT  # torch divides by a Python number as a product with its float32 reciprocal
        scale = tl.where(scale < TINY, TINY, scale)  # a NaN scale stays NaN, as torch's clamp keeps it
        tl.store(scale_ptr + r * scale_cols + g, scale)
    y = libdevice.div_rn(x, scale)
    if FP8:
        y = tl.where(y > LIMIT, LIMIT, tl.where(y < -LIMIT, -LIMIT, y))
        y = tl.where(tl.abs(x) == float("inf"), float("nan"), y)
        tl.store(q_ptr + r * cols + c, y.to(tl.float8e4nv), mask=inside)
    else:
        y = libdevice.rint(y)
        y = tl.where(y != y, 0.0, y)
        y = tl.where(y > LIMIT, LIMIT, tl.where(y < -LIMIT, -LIMIT, y))
        tl.store(q_ptr + r * cols + c, y.to(tl.int8), mask=inside)


def _float32_reciprocal(value: float) -> float:
    """1 / value rounded to float32, as torch's CUDA division by a scalar computes it before multiplying
    (rounding the double quotient to float32 gives the same: 53 >= 2 * 24 + 2 bits)."""
    return struct.unpack("f", struct.pack("f", 1.0 / value))[0]


_LIMITS = {"fp8": FP8_MAX, "int8": INT8_MAX}
_RECIPROCALS = {name: _float32_reciprocal(limit) for name, limit in _LIMITS.items()}


def quantize_rows(
    x: torch.Tensor, dtype: str, group: tuple[int, int], scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] in the format's storage, scale float32 [M, cdiv(K, gc)], [M, 1], [1, 1] (per-tensor
    dynamic) or the static [1, 1]) of x [M, K] on CUDA, as formats.quantize_fp8 / quantize_int8 give
    them; see the module docstring."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    gc = 0 if group[1] == -1 else group[1]
    groups = 1 if gc == 0 else cdiv(cols, gc)
    q = torch.empty((rows, cols), dtype=ACTIVATION_STORAGE[dtype], device=x.device)
    static = scale is not None
    # One row: the per-tensor group lies within it, so its NaN or inf is not skipped but makes the scale
    # NaN or inf, as a per-row scale's (formats.group_amax): the per-row kernel, one launch, gives it.
    tensor = not static and group[0] == -1 and rows != 1
    limit = _LIMITS[dtype]
    block = next_power_of_2(gc or cols)
    if static:
        out_scale = scale.reshape(1, 1).float().clone()
    else:
        out_scale = torch.empty((1 if tensor else rows, groups), dtype=torch.float32, device=x.device)
    # The per-tensor amax, zeroed first (an empty tensor's scale is then TINY, as torch's zero amax gives).
    amax = torch.zeros((1,), dtype=torch.float32, device=x.device) if tensor else None
    if tensor and not (rows and cols):
        out_scale.fill_(_TINY)
    if rows and cols:
        with on_device(x.device):
            if tensor:
                _amax_kernel[(rows,)](x, amax, cols, x.stride(0), BLOCK=block, **compile_options(False))
            _quantize_kernel[(rows, groups)](
                x, scale if static else (amax if tensor else out_scale), q, out_scale, cols, x.stride(0), groups,
                GC=gc, STATIC=static, TENSOR=tensor, FP8=dtype == "fp8", LIMIT=limit, INV_LIMIT=_RECIPROCALS[dtype],
                TINY=_TINY, BLOCK=block, **compile_options(False),
            )  # fmt: skip
    return q, out_scale
