"""Quantized expert weights decoded to bf16/fp16 in one Triton kernel: dequant_kernels.py's decoding on CUDA.

    out[r, n, c] = dtype( value(q[e(r), n, c]) * scale[e(r), n // gr, c // gc] [* global[e(r)]] )

with e(r) = idx[r] (the per-row decoding) or r (every expert), value the format's code (fp8 e4m3, int8,
int4 minus its zero point, e2m1) and the scale decoded from its storage (float32, bf16/fp16, e8m0 or
e4m3). Each element is read once and written once, where the
reference's torch decoding makes float32 temporaries of every step (unpacking, the scale's expansion,
the product): ~13x the bytes. Same values bit for bit as formats.dequantize(...).to(dtype): the same
float32 products in the same order, then one round to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Format -> (how the kernel reads a code, elements per stored byte).
CODES = {"fp8": ("e4m3", 1), "int8": ("int8", 1), "int4": ("int4", 2), "nvfp4": ("e2m1", 2), "mxfp4": ("e2m1", 2)}
# Scale storage dtypes read by their bits (formats.SCALE_DECODE's); others load as floats.
SCALE_CODES = {torch.uint8: "e8m0", torch.float8_e4m3fn: "e4m3"}
BLOCK_N, BLOCK_C = 16, 256


@triton.jit
def _e4m3(byte):
    """uint8 e4m3fn codes -> float32, by their fields: sign, 4-bit exponent (bias 7), 3-bit mantissa;
    exponent 0 is subnormal, 0x7F / 0xFF NaN (e4m3fn has no infinity)."""
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
    """e2m1 codes 0..15 -> float32 (formats.e2m1_decode's arithmetic)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    twice = tl.where(exponent == 0, mantissa, (mantissa + 2) << tl.maximum(exponent - 1, 0))
    magnitude = twice.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _scale(s, SCALE: tl.constexpr):
    """Scales as stored -> float32: float32/bf16/fp16 as they are; e8m0 (mxfp4) 2**(b - 127), 0xFF NaN;
    e4m3 (nvfp4) by its fields."""
    if SCALE == "e8m0":
        b = s.to(tl.int32)
        # 2**(b - 127) as float32 bits (b = 0: the subnormal 2**-127), as formats.e8m0_decode computes it
        out = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 255, float("nan"), out)
    elif SCALE == "e4m3":
        return _e4m3(s)
    else:
        return s.to(tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, scale_ptr, zero_ptr, global_ptr, idx_ptr, out_ptr,
    n, cols, q_cols, scale_rows, scale_cols, group_rows, group_cols,
    CODE: tl.constexpr, SCALE: tl.constexpr, HAS_IDX: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GLOBAL: tl.constexpr, BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    e = tl.load(idx_ptr + r).to(tl.int64) if HAS_IDX else r.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rn[:, None] < n) & (rc[None, :] < cols)
    if CODE == "int4" or CODE == "e2m1":
        byte = tl.load(q_ptr + e * n * q_cols + rn[:, None] * q_cols + (rc[None, :] // 2), mask=mask, other=0).to(tl.int32)
        code = (byte >> ((rc[None, :] % 2) * 4)) & 15  # the low nibble holds the even column (pack_nibbles)
        if CODE == "int4":
            value = code.to(tl.float32)
        else:
            value = _e2m1(code)
    else:
        byte = tl.load(q_ptr + e * n * q_cols + rn[:, None] * q_cols + rc[None, :], mask=mask, other=0)
        if CODE == "e4m3":
            value = _e4m3(byte)
        else:
            value = byte.to(tl.float32)  # int8, loaded as int8
    groups = e * scale_rows * scale_cols + (rn[:, None] // group_rows) * scale_cols + rc[None, :] // group_cols
    if HAS_ZERO:
        value = value - tl.load(zero_ptr + groups, mask=mask, other=0).to(tl.float32)
    elif CODE == "int4":
        value = value - 8.0  # symmetric int4
    value = value * _scale(tl.load(scale_ptr + groups, mask=mask, other=0), SCALE)
    if HAS_GLOBAL:
        value = value * tl.load(global_ptr + e)
    dest = out_ptr + r.to(tl.int64) * n * cols + rn[:, None] * cols + rc[None, :]
    if BF16:
        # Round to nearest even by hand into the bits of a bf16 (out_ptr: its int16 view): the same as
        # cvt.rn on the GPU, and Triton's interpreter (the CPU tests) truncates a bf16 cast instead.
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        tl.store(dest, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dest, value.to(out_ptr.dtype.element_ty), mask=mask)


def decode_experts(
    q: torch.Tensor, fmt: str, group, scale: torch.Tensor, global_scale, zero, idx: torch.Tensor | None, count: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """[count, N, K] in dtype: expert idx[r] (or r, without idx) of the quantized q [E, N, K / packing]
    decoded, as formats.dequantize(q[idx], fmt, group, scale[idx], global_scale[idx], zero[idx]).to(dtype).
    scale / zero [E, N/gr, K/gc] (one group over a whole dimension: size 1 there); global_scale [E] or
    one value. One launch; no host sync."""
    code, packing = CODES[fmt]
    num_experts, n, q_cols = q.shape
    cols = q_cols * packing
    # Scales are read as stored (decoded in the kernel): a decoding step would read and write every
    # expert's scales, also in the per-row case, which reads k of them (mxfp4's are 1/32 of the weight).
    scale = scale.contiguous()
    scale_code = SCALE_CODES.get(scale.dtype, "float")
    sr, sc = scale.shape[-2:]
    gr, gc = (n if group[0] == -1 else group[0]), (cols if group[1] == -1 else group[1])
    if global_scale is not None:
        global_scale = global_scale.float().reshape(-1).expand(num_experts).contiguous()
    zero = zero.contiguous() if zero is not None else None
    out = torch.empty((count, n, cols), dtype=dtype, device=q.device)
    if count == 0 or n == 0 or cols == 0:
        return out
    q = q.view(torch.int8) if fmt == "int8" else q.view(torch.uint8)
    grid = (count, triton.cdiv(n, BLOCK_N), triton.cdiv(cols, BLOCK_C))
    _decode_kernel[grid](
        q, scale.view(torch.uint8) if scale_code != "float" else scale, zero if zero is not None else scale,
        global_scale if global_scale is not None else q, idx if idx is not None else q, out.view(torch.int16) if dtype == torch.bfloat16 else out, n, cols, q_cols, sr, sc, gr, gc,
        CODE=code, SCALE=scale_code, HAS_IDX=idx is not None, HAS_ZERO=zero is not None, HAS_GLOBAL=global_scale is not None,
        BF16=dtype == torch.bfloat16, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out
