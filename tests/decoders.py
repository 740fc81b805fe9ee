"""Independent float64 decoders of the stored quantized formats (bit operations and Python tables; no
moe_ops.quant.formats), for references that must not share the implementation's decoding."""
from __future__ import annotations

import math

import torch

from moe_ops.quant import GroupShape, WeightQuant

# e2m1 code -> value, written out: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _e4m3fn_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8.0 * 2.0**-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


E4M3FN = torch.tensor([_e4m3fn_value(b) for b in range(256)], dtype=torch.float64)


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    return E4M3FN[t.view(torch.uint8).long()]


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1, dtype=torch.float64)
    return table[unpack_nibbles_bits(packed)]


def unpack_nibbles_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C/2] -> int64 [..., C]: element 2j from the low nibble of byte j, 2j+1 from the high."""
    b = packed.long()
    out = torch.empty(*b.shape[:-1], 2 * b.shape[-1], dtype=torch.long)
    out[..., 0::2] = b & 0xF
    out[..., 1::2] = (b >> 4) & 0xF
    return out


def decode_e8m0(t: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float64 2**(b - 127); 255 is NaN (OCP MX: e8m0 has no infinity)."""
    values = [float("nan") if b == 255 else 2.0 ** (b - 127) for b in t.flatten().tolist()]
    return torch.tensor(values, dtype=torch.float64).reshape(t.shape)


def expand(scale: torch.Tensor, group, rows: int, cols: int) -> torch.Tensor:
    """[..., R/gr, C/gc] -> [..., R, C] with each group's scale repeated; group: a GroupShape or
    (rows, cols), -1 for the whole dimension."""
    group_rows, group_cols = (group.rows, group.cols) if isinstance(group, GroupShape) else group
    gr = rows if group_rows == -1 else group_rows
    gc = cols if group_cols == -1 else group_cols
    return scale.repeat_interleave(gr, dim=-2)[..., :rows, :].repeat_interleave(gc, dim=-1)[..., :cols]


def decode_weight(q: torch.Tensor, wq: WeightQuant | None, scale=None, global_scale=None, zero=None) -> torch.Tensor:
    """Stored weight [E, N, K/packing] -> float64 [E, N, K]."""
    if wq is None:
        return q.double()
    if wq.dtype == "fp8":
        values, s = decode_e4m3(q), scale.double()
    elif wq.dtype == "int8":
        values, s = q.double(), scale.double()
    elif wq.dtype == "int4":
        codes = unpack_nibbles_bits(q).double()
        z = expand(zero.double(), wq.group, *codes.shape[1:]) if zero is not None else 8.0
        values, s = codes - z, scale.double()
    elif wq.dtype == "nvfp4":
        values, s = decode_e2m1_packed(q), decode_e4m3(scale) * global_scale.double().view(-1, 1, 1)
    elif wq.dtype == "mxfp4":
        values, s = decode_e2m1_packed(q), decode_e8m0(scale)
    else:
        raise AssertionError(wq.dtype)
    return values * expand(s, wq.group, *values.shape[1:])
