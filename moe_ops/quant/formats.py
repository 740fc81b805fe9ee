"""Reference encodings of the quantized formats, in plain PyTorch (any device, no host syncs).

Every quantized tensor q of logical shape [..., R, C] comes with a scale tensor of shape
[..., cdiv(R, gr), cdiv(C, gc)] for its group shape (gr, gc) (-1 = the whole dimension), holding
dequantization multipliers: x ~= decode(q) * scale (* global_scale for nvfp4).

| format | storage of q                        | scale storage               | extra                          |
|--------|-------------------------------------|-----------------------------|--------------------------------|
| fp8    | float8_e4m3fn                       | float32                     |                                |
| int8   | int8, symmetric                     | float32                     |                                |
| int4   | uint8, 2 per byte, values 0..15     | float32/bf16/fp16           | zero points uint8 (else 8)     |
| nvfp4  | uint8, 2 e2m1 per byte, groups 1x16 | float8_e4m3fn (NaN: NaN/inf)| float32 global scale           |
| mxfp4  | uint8, 2 e2m1 per byte, groups 1x32 | uint8 e8m0 (2**(b - 127))   | 0xFF = NaN (NaN/inf block)     |

Packed formats hold element 2j in the low nibble and 2j+1 in the high nibble of byte j. e2m1 values are
rounded to nearest, ties to even, and saturate at +-6.
"""
from __future__ import annotations

import torch

from ..launch_ints import cdiv

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
E2M1_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TINY = 1e-12
# Formats whose values carry a float32 global scale besides their group scales.
GLOBAL_SCALE_FORMATS = frozenset({"nvfp4"})


def group_dims(group: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """The (rows, cols) of one group of a [rows, cols] matrix; -1 spans the whole dimension."""
    gr, gc = group
    return (rows if gr == -1 else gr), (cols if gc == -1 else gc)


def scale_shape(group: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    """Shape of the scales of a [rows, cols] matrix; a whole-dimension group has one scale even when
    the dimension is empty (no branching on rows, which may be symbolic)."""
    gr, gc = group
    return (1 if gr == -1 else cdiv(rows, gr)), (1 if gc == -1 else cdiv(cols, gc))


def group_amax(x: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """float32 [..., R, C] -> [..., cdiv(R, gr), cdiv(C, gc)]: the largest |x| of each group. A NaN or
    inf makes its group's amax NaN or inf when the group lies within one row (a token's own scale says
    its values are undefined), and is skipped in groups over several rows (per-tensor, 2-D blocks): one
    token's NaN or inf (a garbage padding row of a captured batch, an fp16 overflow) must not turn every
    other token's scale, hence output, into NaN or zero. vLLM's fmaxf amax skips NaN only, so there one
    inf token zeroes the batch. The bad values stay NaN in their own fp8 codes (quantize_fp8)."""
    *lead, rows, cols = x.shape
    gr, gc = group_dims(group, rows, cols)
    sr, sc = scale_shape(group, rows, cols)
    if x.numel() == 0:
        return x.new_zeros((*lead, sr, sc), dtype=torch.float32)
    magnitude = x.float().abs()
    if gr != 1:
        magnitude = torch.where(magnitude.isfinite(), magnitude, 0.0)
    padded = torch.nn.functional.pad(magnitude, (0, sc * gc - cols, 0, sr * gr - rows))
    return padded.view(*lead, sr, gr, sc, gc).amax(dim=(-3, -1))


def expand_groups(scale: torch.Tensor, group: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """[..., cdiv(R, gr), cdiv(C, gc)] -> [..., R, C], each group's value repeated over the group
    (a broadcast view along whole-dimension groups)."""
    out = scale
    if group[0] not in (-1, 1):
        out = out.repeat_interleave(group[0], dim=-2)[..., :rows, :]
    if group[1] not in (-1, 1):
        out = out.repeat_interleave(group[1], dim=-1)[..., :cols]
    return out.expand(*scale.shape[:-2], rows, cols)


def broadcast_global(global_scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A global scale of one element, or one per leading index of x ([E] for [E, R, C] weights),
    shaped to broadcast against x [..., R, C]."""
    g = global_scale.float()
    if g.numel() == 1:
        return g.reshape(())
    return g.reshape(*x.shape[:-2], 1, 1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C] with values 0..15 (C even) -> uint8 [..., C // 2]."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C // 2] -> uint8 [..., C] with values 0..15."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e2m1 codes (0..15), round to nearest with ties to even (the even code: 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, as NVIDIA's cvt.rn.satfinite.e2m1x2 and
    OCP MX conversion round), saturating at +-6."""
    a = x.float().abs().nan_to_num(nan=E2M1_MAX)  # e2m1 has no NaN: the largest code, as satfinite gives
    # Comparisons with Python floats, not a table tensor: building one on x's device is a host-to-device
    # copy on every call, which syncs and cannot be captured in a CUDA graph.
    up = sum((a >= mid).to(torch.uint8) for mid in _E2M1_MIDPOINTS)  # a tie goes to the larger magnitude
    down = sum((a > mid).to(torch.uint8) for mid in _E2M1_MIDPOINTS)  # a tie goes to the smaller
    magnitude = torch.where(down % 2 == 0, down, up)  # at a tie, whichever code is even
    sign = (x < 0).to(torch.uint8) << 3
    return magnitude | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) -> float32 values (E2M1_VALUES), by arithmetic on the code's fields
    (sign, 2-bit exponent, 1-bit mantissa) rather than a table built on the device (see e2m1_encode)."""
    c = codes.to(torch.uint8)
    exponent, mantissa = (c >> 1) & 3, c & 1
    # Twice the magnitude is a small integer (0..12): integer shifts, then one exact conversion, take half
    # the time of float exp2 on the CPU (the reference decodes whole mxfp4/nvfp4 weights per call).
    twice = torch.where(exponent == 0, mantissa, (mantissa + 2) << (exponent.clamp(min=1) - 1))
    magnitude = twice.float() * 0.5
    return torch.where((c & 8) != 0, -magnitude, magnitude)


E8M0_NAN = 255  # e8m0 has no infinity; 0xFF is its NaN


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 -> uint8 biased exponents b with 2**(b - 127) >= scale (rounded up, so that
    x / 2**(b - 127) never exceeds the element format's range). A NaN or infinite scale (a block
    holding NaN or inf) encodes as the e8m0 NaN 0xFF: the whole block then decodes to NaN, as the
    OCP MX spec has it, instead of a finite block that hides the bad input."""
    s = scale.float()
    exponent = torch.ceil(torch.log2(s.clamp(min=2.0**-127)))
    biased = torch.where(torch.isfinite(s), (exponent + 127).clamp(0, 254), float(E8M0_NAN))
    return biased.to(torch.uint8)


def e8m0_decode(biased: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2**(b - 127); 0xFF is NaN (OCP MX: e8m0 has no infinity)."""
    b = biased.float()
    return torch.where(b == E8M0_NAN, float("nan"), torch.exp2(b - 127.0))


# ---- quantizers: float [..., R, C] -> (q, scale[, ...]) ------------------------------------------


def quantize_fp8(x: torch.Tensor, group, scale: torch.Tensor | None = None):
    """fp8 e4m3: dynamic scale amax / 448 per group, or the given (static) scale. Finite values beyond
    the scale's range saturate at +-448; NaN and inf become the fp8 NaN (e4m3fn has no inf), so a
    non-finite input shows in its own token's output instead of passing as a saturated number."""
    if scale is None:
        scale = (group_amax(x, group) / FP8_MAX).clamp(min=_TINY)
    full = expand_groups(scale.float(), group, x.shape[-2], x.shape[-1])
    xf = x.float()
    q = torch.where(xf.isinf(), float("nan"), (xf / full).clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    return q, scale.float()


def quantize_int8(x: torch.Tensor, group, scale: torch.Tensor | None = None):
    """Symmetric int8: dynamic scale amax / 127 per group, or the given (static) scale. int8 has no NaN:
    NaN becomes 0 and inf saturates at +-127, as vLLM's kernels give (a non-finite token's output is
    then finite, unlike fp8's)."""
    if scale is None:
        scale = (group_amax(x, group) / INT8_MAX).clamp(min=_TINY)
    full = expand_groups(scale.float(), group, x.shape[-2], x.shape[-1])
    # NaN has no int8 code: 0, as vLLM's kernels give (casting NaN to an integer is undefined).
    q = torch.round(x.float() / full).nan_to_num(nan=0.0).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.float()


def quantize_int4(x: torch.Tensor, group_size: int, zero_point: bool):
    """int4 along the last dim in groups of group_size: symmetric (codes q - 8) or asymmetric with a
    zero point per group. Returns (packed uint8 [..., R, C/2], scale float32, zero uint8 or None)."""
    group = (1, group_size)
    rows, cols = x.shape[-2:]
    if cols % group_size or cols % 2:
        raise ValueError(
            f"x: int4 needs the last dim to be even (two values per byte) and a multiple of group_size={group_size}, "
            f"got shape {tuple(x.shape)}"
        )
    xf = x.float()
    if zero_point:
        padded = xf.reshape(*x.shape[:-1], cols // group_size, group_size)
        lo = padded.amin(-1).clamp(max=0.0)
        hi = padded.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=_TINY)
        zero = torch.round(-lo / scale).clamp(0, 15)
    else:
        scale = (group_amax(xf, group) / 7.0).clamp(min=_TINY)
        zero = torch.full_like(scale, 8.0)
    full_scale = expand_groups(scale, group, rows, cols)
    full_zero = expand_groups(zero, group, rows, cols)
    codes = torch.round(xf / full_scale + full_zero).clamp(0, 15)
    return pack_nibbles(codes.to(torch.uint8)), scale, (zero.to(torch.uint8) if zero_point else None)


def nvfp4_global_scale(x: torch.Tensor, dims=None) -> torch.Tensor:
    """The float32 global dequantization scale amax / (448 * 6) over dims (all by default): x's shape
    without those dims. Over an empty extent amax is taken as 0, so the scale is the smallest one."""
    reduced = range(x.dim()) if dims is None else {d % x.dim() for d in ((dims,) if isinstance(dims, int) else dims)}
    if x.numel():
        amax = x.float().abs().amax(dim=tuple(reduced))
    else:  # amax has no identity to reduce an empty extent with
        amax = x.new_zeros([s for d, s in enumerate(x.shape) if d not in reduced], dtype=torch.float32)
    return (amax / (FP8_MAX * E2M1_MAX)).clamp(min=_TINY)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor):
    """nvfp4: e2m1 values in groups of 16 along the last dim with e4m3 group scales, times a float32
    global scale (broadcast against [..., 1, 1]). Returns (packed uint8, scale float8_e4m3fn). A group
    scale past e4m3's range saturates at 448 (the global scale clips); a group holding NaN or inf gets
    the e4m3 NaN, so the whole group decodes to NaN, as fp8's and mxfp4's do. Saturating inf as well
    would decode it as 6 * 448 * global and the rest of its group as ~0: a finite, wrong token."""
    group = (1, 16)
    rows, cols = x.shape[-2:]
    g = broadcast_global(global_scale, x)
    amax = group_amax(x, group)
    block = torch.where(amax.isinf(), float("nan"), (amax / E2M1_MAX / g).clamp(max=FP8_MAX)).to(torch.float8_e4m3fn)
    full = expand_groups(block.float(), group, rows, cols) * g
    safe = torch.where(full > 0, full, torch.ones_like(full))
    return pack_nibbles(e2m1_encode(x.float() / safe)), block


def quantize_mxfp4(x: torch.Tensor):
    """mxfp4 (OCP MX): e2m1 values in groups of 32 along the last dim with e8m0 power-of-two scales.
    Returns (packed uint8, scale uint8 e8m0). The scale is amax / 6 rounded up to a power of two, so no
    element saturates; OCP MX v1.0's rule, 2**(floor(log2(amax)) - 2), is half of that for 40% of random
    blocks and clips their largest elements to 6 (e.g. [7, 0.75, 1] decodes as [6, 1, 1] there, [8, 1, 1]
    here), for a larger error overall. Both decode alike; only the codes differ from a spec quantizer's."""
    group = (1, 32)
    rows, cols = x.shape[-2:]
    biased = e8m0_encode(group_amax(x, group) / E2M1_MAX)
    full = expand_groups(e8m0_decode(biased), group, rows, cols)
    return pack_nibbles(e2m1_encode(x.float() / full)), biased


# ---- decoders: q -> float32 values before scaling -------------------------------------------------

DECODE = {
    "fp8": lambda q: q.float(),
    "int8": lambda q: q.float(),
    "int4": lambda q: unpack_nibbles(q).float(),
    "nvfp4": lambda q: e2m1_decode(unpack_nibbles(q)),
    "mxfp4": lambda q: e2m1_decode(unpack_nibbles(q)),
}

SCALE_DECODE = {
    "fp8": lambda s: s.float(),
    "int8": lambda s: s.float(),
    "int4": lambda s: s.float(),
    "nvfp4": lambda s: s.float(),
    "mxfp4": e8m0_decode,
}

# Elements per storage element of q along the last dimension.
PACKING = {"fp8": 1, "int8": 1, "int4": 2, "nvfp4": 2, "mxfp4": 2}


def dequantize(
    q: torch.Tensor,
    fmt: str,
    group,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantized [..., R, C / packing] -> float32 [..., R, C]. global_scale broadcasts per leading index
    ([E] for weights, [1] for activations); zero (int4 only) defaults to 8 (symmetric)."""
    values = DECODE[fmt](q)
    rows, cols = values.shape[-2:]
    if fmt == "int4":
        z = expand_groups(zero.float(), group, rows, cols) if zero is not None else 8.0
        values = values - z
    out = values * expand_groups(SCALE_DECODE[fmt](scale), group, rows, cols)
    if global_scale is not None:
        out = out * broadcast_global(global_scale, out)
    return out
