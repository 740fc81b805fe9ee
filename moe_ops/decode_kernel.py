"""Quantized expert weights decoded to bf16/fp16 in one Triton kernel: dequant_kernels.py's decoding on CUDA.

    out[r, n, c] = dtype( value(q[e(r), n, c]) * scale[e(r), n // gr, c // gc] [* global[e(r)]] )

with e(r) = idx[r] (an expert slot) or r (every expert), value the format's code (fp8 e4m3, int8,
int4 minus its zero point, e2m1) and the scale decoded from its storage (float32, bf16/fp16, e8m0 or
e4m3); entries whose offsets say they have no rows are skipped. Each element is read once and written
once, where the reference's torch decoding makes float32 temporaries of every step (unpacking, the
scale's expansion, the product): ~13x the bytes. Same values bit for bit as
formats.dequantize(...).to(dtype): the same float32 products in the same order, then one round to
nearest even. A block loads its codes as whole bytes (both nibbles of a packed byte from one load) and
one scale per group, not per element: v46 in bench/NOTES.md measured 1.6-3.4x over a per-element
version, 2.1-2.8 TB/s on an H100.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch_ints import cdiv
from .plan_kernel import compile_options, on_device


# Format -> (how the kernel reads a code, elements per stored byte).
CODES = {"fp8": ("e4m3", 1), "int8": ("int8", 1), "int4": ("int4", 2), "nvfp4": ("e2m1", 2), "mxfp4": ("e2m1", 2)}
# Scale storage dtypes read by their bits (formats.SCALE_DECODE's); others load as floats.
SCALE_CODES = {torch.uint8: "e8m0", torch.float8_e4m3fn: "e4m3"}
BLOCK_N, BLOCK_C = 16, 256
# Triton's interpreter (the CPU tests) has no fp8 conversion and truncates a bf16 cast; there e4m3 is
# decoded from its fields and bf16 rounded by its bits. Compiled, both are single conversions (cvt),
# which decide the kernel's speed: it is bound by instructions, not bytes, when each element costs a
# dozen integer operations (v46 in bench/NOTES.md). Read when triton.jit decorates, as Triton reads it.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _e4m3(byte, INTERPRETED: tl.constexpr):
    """uint8 e4m3fn codes -> float32: compiled, the hardware's conversion; interpreted, by the fields
    (sign, 4-bit exponent with bias 7, 3-bit mantissa; exponent 0 subnormal, 0x7F / 0xFF NaN)."""
    if not INTERPRETED:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = byte.to(tl.int32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = (((b & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    sub = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2**-9
    sub = tl.where((b & 0x80) != 0, -sub, sub)
    out = tl.where(exponent == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), out)


@triton.jit
def _e2m1(code):
    """e2m1 codes 0..15 (int32) -> float32, built as float32 bits: sign, then 2**(e - 1) * (1 + m / 2)
    for exponent e > 0 (biased 126 + e) or m / 2 for e = 0 (0.5: 0x3F000000), the values of
    formats.e2m1_decode (-0.0 for code 8, as its negation of 0.0 gives)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    magnitude = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
    return (((code & 8) << 28) | magnitude).to(tl.float32, bitcast=True)


@triton.jit
def _code_value(code, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One stored code (a nibble for int4 / e2m1) -> its float32 value before zero point and scale."""
    if CODE == "e2m1":
        return _e2m1(code)
    elif CODE == "e4m3":
        return _e4m3(code, INTERPRETED)
    else:
        return code.to(tl.float32)  # int8 (loaded as int8) or an int4 nibble


@triton.jit
def _scale(s, SCALE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Scales as stored -> float32: float32/bf16/fp16 as they are; e8m0 (mxfp4) 2**(b - 127), 0xFF NaN;
    e4m3 (nvfp4) as a code."""
    if SCALE == "e8m0":
        b = s.to(tl.int32)
        # 2**(b - 127) as float32 bits (b = 0: the subnormal 2**-127), as formats.e8m0_decode computes it
        out = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 255, float("nan"), out)
    elif SCALE == "e4m3":
        return _e4m3(s, INTERPRETED)
    else:
        return s.to(tl.float32)


@triton.jit
def _codes(q_base, rn, pid_c, n, q_cols, CODE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_C]: the values of the block's codes (masked ones 0). Packed codes load as
    bytes once and split into nibbles (the low one is the even column, as pack_nibbles stores them)."""
    if CODE == "int4" or CODE == "e2m1":
        half = pid_c * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        mask = (rn[:, None] < n) & (half[None, :] < q_cols)
        byte = tl.load(q_base + rn[:, None] * q_cols + half[None, :], mask=mask, other=0).to(tl.int32)
        low = _code_value(byte & 15, CODE, INTERPRETED)
        high = _code_value((byte >> 4) & 15, CODE, INTERPRETED)
        return tl.join(low, high).reshape(BLOCK_N, BLOCK_C)
    else:
        rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rn[:, None] < n) & (rc[None, :] < q_cols)
        return _code_value(tl.load(q_base + rn[:, None] * q_cols + rc[None, :], mask=mask, other=0), CODE, INTERPRETED)


@triton.jit
def _decode_kernel(
    q_ptr, scale_ptr, zero_ptr, global_ptr, idx_ptr, offsets_ptr, out_ptr,
    n, cols, q_cols, scale_rows, scale_cols,
    GR: tl.constexpr, GC: tl.constexpr, GROUPS: tl.constexpr,
    CODE: tl.constexpr, SCALE: tl.constexpr, HAS_IDX: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_ZERO: tl.constexpr,
    HAS_GLOBAL: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_N, BLOCK_C] block of output entry r. GR / GC: the group's rows / columns (0: the whole
    dimension). GROUPS: the scale groups across BLOCK_C (BLOCK_C // GC; 1 when a group spans the block),
    or 0 when groups do not tile the block (each element then loads its own scale)."""
    r = tl.program_id(0)
    if HAS_OFFSETS:
        # An entry without grouped rows is never read by the kernels: its programs return at once.
        if tl.load(offsets_ptr + r + 1) <= tl.load(offsets_ptr + r):
            return
    e = tl.load(idx_ptr + r).to(tl.int64) if HAS_IDX else r.to(tl.int64)
    pid_c = tl.program_id(2)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rn[:, None] < n) & (rc[None, :] < cols)
    value = _codes(q_ptr + e * n * q_cols, rn, pid_c, n, q_cols, CODE, INTERPRETED, BLOCK_N, BLOCK_C)
    group_row = rn // GR if GR > 0 else rn * 0
    scale_base = scale_ptr + e * scale_rows * scale_cols
    zero_base = zero_ptr + e * scale_rows * scale_cols
    if GROUPS > 0:
        # One scale (and zero point) per group: [BLOCK_N, GROUPS] loads, applied over the group's columns.
        if GC > 0:
            group_col = (pid_c * BLOCK_C) // GC + tl.arange(0, GROUPS)
        else:
            group_col = tl.arange(0, GROUPS) * 0
        at = group_row[:, None] * scale_cols + group_col[None, :]
        group_mask = (rn[:, None] < n) & (group_col[None, :] < scale_cols)
        value = value.reshape(BLOCK_N, GROUPS, BLOCK_C // GROUPS)
        if HAS_ZERO:
            value = value - tl.load(zero_base + at, mask=group_mask, other=0).to(tl.float32)[:, :, None]
        elif CODE == "int4":
            value = value - 8.0  # symmetric int4
        value = value * _scale(tl.load(scale_base + at, mask=group_mask, other=0), SCALE, INTERPRETED)[:, :, None]
        value = value.reshape(BLOCK_N, BLOCK_C)
    else:
        at = group_row[:, None] * scale_cols + rc[None, :] // GC
        if HAS_ZERO:
            value = value - tl.load(zero_base + at, mask=mask, other=0).to(tl.float32)
        elif CODE == "int4":
            value = value - 8.0
        value = value * _scale(tl.load(scale_base + at, mask=mask, other=0), SCALE, INTERPRETED)
    if HAS_GLOBAL:
        value = value * tl.load(global_ptr + e)
    dest = out_ptr + r.to(tl.int64) * n * cols + rn[:, None] * cols + rc[None, :]
    if BF16 and INTERPRETED:
        # Round to nearest even by the bits of a bf16 (out_ptr: its int16 view), as cvt.rn does compiled.
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        tl.store(dest, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dest, value.to(out_ptr.dtype.element_ty), mask=mask)


def _groups_across_block(gc: int, cols: int) -> int:
    """_decode_kernel's GROUPS for a column group of gc (0: whole rows) over cols columns."""
    if gc == 0 or gc >= cols or gc % BLOCK_C == 0:
        return 1
    return BLOCK_C // gc if BLOCK_C % gc == 0 else 0


def decode_experts(
    q: torch.Tensor, fmt: str, group, scale: torch.Tensor, global_scale, zero, idx: torch.Tensor | None, count: int,
    dtype: torch.dtype, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """[count, N, K] in dtype: expert idx[r] (or r, without idx) of the quantized q [E, N, K / packing]
    decoded, as formats.dequantize(q[idx], fmt, group, scale[idx], global_scale[idx], zero[idx]).to(dtype).
    scale / zero [E, N/gr, K/gc] (one group over a whole dimension: size 1 there); global_scale [E] or
    one value. offsets [count + 1] (int32, the grouped rows' expert offsets): entry r is decoded only when
    offsets[r + 1] > offsets[r], the others are left as they are (the kernels read no expert without
    rows). out: where to write (a fresh tensor without it). One launch; no host sync."""
    code, packing = CODES[fmt]
    q = q.contiguous()
    num_experts, n, q_cols = q.shape
    cols = q_cols * packing
    # Scales are read as stored (decoded in the kernel): a decoding step would read and write every
    # expert's scales, also when the slots read k of them (mxfp4's are 1/32 of the weight).
    scale = scale.contiguous()
    scale_code = SCALE_CODES.get(scale.dtype, "float")
    sr, sc = scale.shape[-2:]
    gr, gc = (0 if group[0] == -1 else group[0]), (0 if group[1] == -1 else group[1])
    if global_scale is not None:
        global_scale = global_scale.float().reshape(-1).expand(num_experts).contiguous()
    zero = zero.contiguous() if zero is not None else None
    if out is None:
        out = torch.empty((count, n, cols), dtype=dtype, device=q.device)
    elif out.shape != (count, n, cols) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {dtype} [{count}, {n}, {cols}], got {out.dtype} {list(out.shape)}")
    if offsets is not None and offsets.shape != (count + 1,):
        raise ValueError(f"offsets: expected [{count + 1}] (one more than count), got {list(offsets.shape)}")
    if count == 0 or n == 0 or cols == 0:
        return out
    q = q.view(torch.int8) if fmt == "int8" else q.view(torch.uint8)
    grid = (count, cdiv(n, BLOCK_N), cdiv(cols, BLOCK_C))
    with on_device(q.device):
        _decode_kernel[grid](
            q, scale.view(torch.uint8) if scale_code != "float" else scale, zero if zero is not None else scale,
            global_scale if global_scale is not None else q, idx if idx is not None else q,
            offsets if offsets is not None else q, out.view(torch.int16) if dtype == torch.bfloat16 and INTERPRETED else out,
            n, cols, q_cols, sr, sc, GR=gr, GC=gc, GROUPS=_groups_across_block(gc, cols), CODE=code, SCALE=scale_code,
            HAS_IDX=idx is not None, HAS_OFFSETS=offsets is not None, HAS_ZERO=zero is not None, HAS_GLOBAL=global_scale is not None,
            BF16=dtype == torch.bfloat16, INTERPRETED=INTERPRETED, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, **compile_options(False),
        )  # fmt: skip
    return out
