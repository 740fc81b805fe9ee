"""moe_ops/quant/formats.py: nibble packing, e2m1 and e8m0 codes (known values and round trips), the
quantizers' error bounds and the scale shapes of every group shape, on fresh random inputs."""
from __future__ import annotations

import math

import pytest
import torch

from moe_ops.quant import GroupShape, WeightQuant, formats
from moe_ops.quant.quantize import quantize

from ..decoders import E2M1, decode_e4m3, decode_weight, expand

MAGNITUDES = E2M1[:8]


def _e2m1_from_bits(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def test_e2m1_table_matches_bit_layout():
    assert [_e2m1_from_bits(c) for c in range(16)] == E2M1


# ---- nibbles -------------------------------------------------------------------------------------


def test_pack_nibbles_known_values():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0xA]], dtype=torch.uint8)
    assert formats.pack_nibbles(codes).tolist() == [[0x21, 0x0F, 0xA7]]
    assert formats.unpack_nibbles(torch.tensor([0xAB, 0x10, 0xFF], dtype=torch.uint8)).tolist() == [
        0xB, 0xA, 0x0, 0x1, 0xF, 0xF
    ]  # fmt: skip


@pytest.mark.parametrize("shape", [(0, 8), (1, 2), (3, 5, 64), (7, 130)])
def test_nibble_round_trip(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(formats.unpack_nibbles(packed), codes)
    # element 2j is the low nibble of byte j
    if codes.numel():
        lo = [int(b) & 0xF for b in packed.flatten().tolist()]
        assert lo == codes[..., 0::2].flatten().tolist()
    raw = torch.randint(0, 256, shape, dtype=torch.uint8)
    assert torch.equal(formats.pack_nibbles(formats.unpack_nibbles(raw)), raw)


# ---- e2m1 ----------------------------------------------------------------------------------------


def test_e2m1_decode_all_codes():
    got = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == E2M1
    assert [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in E2M1]


def test_e2m1_encode_all_values():
    values = torch.tensor(E2M1)
    codes = formats.e2m1_encode(values)
    assert codes.dtype == torch.uint8
    # every code round-trips, except -0.0 which may encode as +0.0 (same value)
    assert codes.tolist()[:8] == list(range(8)) and codes.tolist()[9:] == list(range(9, 16))
    assert formats.e2m1_decode(codes).tolist() == [abs(v) if v == 0 else v for v in E2M1]


def test_e2m1_encode_rounds_to_nearest_and_saturates():
    x = (torch.rand(20000) * 2 - 1) * 8  # [-8, 8): beyond +-6 saturates
    got = formats.e2m1_decode(formats.e2m1_encode(x)).double()
    for xv, gv in zip(x.double().tolist(), got.tolist()):
        best = min(abs(v - abs(xv)) for v in MAGNITUDES)
        # every magnitude at the least distance (two at an exact tie: test_e2m1_encode_ties_to_even)
        allowed = {math.copysign(v, xv) for v in MAGNITUDES if abs(v - abs(xv)) == best}
        assert gv in allowed or (gv == 0 and 0.0 in allowed), (xv, gv)


def _e2m1_round_half_even(v: float) -> int:
    """The e2m1 code of v by the definition (nearest magnitude, ties to the even code, saturating at 6),
    found by a Python scan over the bit-layout table."""
    mags = [_e2m1_from_bits(c) for c in range(8)]
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(mags[c] - a), c % 2))
    return best | (8 if v < 0 else 0)


def test_e2m1_encode_ties_to_even():
    """Midpoints between neighbouring magnitudes round to the even code (round half to even, as NVIDIA's
    cvt.rn.satfinite.e2m1x2 and OCP MX conversion round): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = mids[torch.randint(0, 7, (2000,))] * torch.where(torch.rand(2000) < 0.5, -1.0, 1.0)
    codes = formats.e2m1_encode(x)
    assert codes.tolist() == [_e2m1_round_half_even(v) for v in x.tolist()]
    assert (codes & 1).eq(0).all(), "a tie rounded to an odd code"



def test_e2m1_encode_nan_is_the_largest_magnitude():
    """e2m1 has no NaN: a NaN encodes as magnitude 6 (code 7 or 15), as cvt.rn.satfinite.e2m1x2 gives
    MAX_NORM for NaN, never as zero (which would pass a NaN off as a valid 0)."""
    x = torch.full((5,), float("nan"))
    x[1::2] = -float("nan")
    codes = formats.e2m1_encode(x)
    assert ((codes & 7) == 7).all(), codes.tolist()

# ---- e8m0 ----------------------------------------------------------------------------------------


def test_e8m0_decode_all_codes():
    got = formats.e8m0_decode(torch.arange(256, dtype=torch.uint8)).double()
    assert got[:255].tolist() == [2.0 ** (b - 127) for b in range(255)]
    # OCP MX: e8m0 has no infinity; 0xFF is NaN (torch's float8_e8m0fnu agrees)
    assert math.isnan(got[255].item())
    assert math.isnan(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu).float().item())


def test_e8m0_encode_nonfinite_is_nan():
    scale = torch.exp2(torch.rand(64) * 60 - 30)
    bad = torch.randperm(64)[:12]
    scale[bad[:4]] = float("nan")
    scale[bad[4:8]] = float("inf")
    scale[bad[8:]] = -float("nan")
    codes = formats.e8m0_encode(scale)
    is_bad = torch.zeros(64, dtype=torch.bool)
    is_bad[bad] = True
    assert codes[is_bad].eq(255).all(), codes[is_bad].tolist()
    assert codes[~is_bad].lt(255).all()


def test_e8m0_encode_powers_of_two():
    exps = torch.arange(-126, 128)
    codes = formats.e8m0_encode(torch.pow(2.0, exps.double()).float())
    assert codes.dtype == torch.uint8
    assert codes.tolist() == (exps + 127).tolist()


def test_e8m0_encode_rounds_up():
    scale = torch.exp2(torch.rand(5000) * 120 - 60)
    decoded = formats.e8m0_decode(formats.e8m0_encode(scale)).double()
    s = scale.double()
    assert (decoded >= s).all(), "e8m0 scale smaller than requested (x / scale would exceed the range)"
    assert (decoded < 2 * s).all(), "e8m0 scale not the smallest power of two >= the requested scale"



def test_e8m0_encode_saturates_finite_scales_above_the_largest_power():
    """e8m0's largest finite value is 2**127 (code 254); a finite scale above it (up to float32's max)
    saturates there and never becomes the NaN code 255, which would turn a finite block into NaN."""
    top = float(torch.finfo(torch.float32).max)
    scale = torch.tensor([2.0**127, 2.0**127 * 1.0001, 2.0**127 * 1.5, top])
    assert formats.e8m0_encode(scale).tolist() == [254] * 4

# ---- quantizers ----------------------------------------------------------------------------------

# group, logical [E, R, C] shape
FP8_INT8_GROUPS = [((-1, -1), (3, 40, 70)), ((1, -1), (3, 40, 70)), ((32, 32), (2, 70, 100)), ((1, 16), (2, 5, 48))]


def _expand(scale, group, rows, cols):
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    return scale.repeat_interleave(gr, dim=-2)[..., :rows, :].repeat_interleave(gc, dim=-1)[..., :cols]


def _group_amax_loop(x, group):
    """[E, R, C] -> float64 [E, cdiv(R, gr), cdiv(C, gc)], by slicing."""
    e, rows, cols = x.shape
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    out = torch.empty(e, -(-rows // gr), -(-cols // gc), dtype=torch.float64)
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            out[:, i, j] = x[:, i * gr : (i + 1) * gr, j * gc : (j + 1) * gc].double().abs().amax(dim=(1, 2))
    return out


@pytest.mark.parametrize("group,shape", FP8_INT8_GROUPS)
def test_fp8_quantize_error_bound(group, shape):
    x = torch.randn(shape) * torch.exp(torch.randn(shape[0], 1, 1))
    q, scale = formats.quantize_fp8(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0], *formats.scale_shape(group, *shape[1:]))
    assert torch.allclose(scale.double(), _group_amax_loop(x, group) / 448, rtol=1e-6, atol=0)
    s = _expand(scale.double(), group, *shape[1:])
    deq = formats.dequantize(q, "fp8", group, scale).double()
    assert torch.allclose(deq, q.double() * s, rtol=1e-6, atol=0)
    # e4m3: 3 mantissa bits, so round to nearest is within 2**-4 relative (2**-10 absolute in subnormals)
    v = x.double() / s
    bound = torch.maximum(v.abs() * 2.0**-4, torch.full_like(v, 2.0**-10)) * s * (1 + 1e-6)
    assert ((deq - x.double()).abs() <= bound).all()
    assert ((q.double()).abs() <= 448).all()


@pytest.mark.parametrize("group,shape", [g for g in FP8_INT8_GROUPS if g[0] != (32, 32)])
def test_int8_quantize_error_bound(group, shape):
    x = torch.randn(shape) * torch.exp(torch.randn(shape[0], 1, 1))
    q, scale = formats.quantize_int8(x, group)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.shape == (shape[0], *formats.scale_shape(group, *shape[1:]))
    assert torch.allclose(scale.double(), _group_amax_loop(x, group) / 127, rtol=1e-6, atol=0)
    assert (q.abs() <= 127).all() and (q.abs() == 127).any()
    s = _expand(scale.double(), group, *shape[1:])
    deq = formats.dequantize(q, "int8", group, scale).double()
    assert ((deq - x.double()).abs() <= s * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [16, 32, 128])
def test_int4_quantize_error_bound(group_size, zero_point):
    shape = (3, 9, 2 * 128)
    x = torch.randn(shape) + (0.7 if zero_point else 0.0)  # asymmetric data for zero points
    packed, scale, zero = formats.quantize_int4(x, group_size, zero_point)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 9, 128)
    assert scale.shape == (3, 9, 256 // group_size)
    codes = torch.stack(((packed & 0xF), (packed >> 4)), dim=-1).flatten(-2).double()
    if zero_point:
        assert zero.dtype == torch.uint8 and zero.shape == scale.shape and (zero <= 15).all()
        z = _expand(zero.double(), (1, group_size), 9, 256)
    else:
        assert zero is None
        z = 8.0
        assert torch.allclose(scale.double(), _group_amax_loop(x, (1, group_size)) / 7, rtol=1e-6, atol=0)
    s = _expand(scale.double(), (1, group_size), 9, 256)
    deq = formats.dequantize(packed, "int4", (1, group_size), scale, zero=zero).double()
    assert torch.allclose(deq, (codes - z) * s, rtol=1e-6, atol=1e-7)
    assert ((deq - x.double()).abs() <= s * (0.5 + 1e-5)).all()



@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["all_positive", "all_negative"])
def test_int4_zero_point_range_holds_zero_for_one_signed_groups(sign):
    """Groups whose values all share one sign: the zero-point range is [min(x, 0), max(x, 0)] (widened to
    hold 0, so 0 has an exact code), hence scale max|x| / 15 and zero 0 (all positive) or 15 (all
    negative), and every value within half a step; a range of [min, max] without 0 clipped whole groups."""
    g = 32
    x = sign * (torch.rand(2, 3, 4 * g) + 0.25)  # |x| in [0.25, 1.25): no group holds 0
    packed, scale, zero = formats.quantize_int4(x, g, True)
    amax = x.double().abs().view(2, 3, 4, g).amax(-1)
    assert torch.allclose(scale.double(), amax / 15, rtol=1e-6, atol=0)
    assert (zero == (0 if sign > 0 else 15)).all(), zero.tolist()
    deq = decode_weight(packed, WeightQuant("int4", GroupShape(1, g), True), scale, None, zero)
    assert ((deq - x.double()).abs() <= expand(scale.double(), (1, g), 3, 4 * g) * (0.5 + 1e-5)).all()

def _e2m1_half_step(v):
    """Half the distance to the neighbouring e2m1 magnitude at |v| (scaled units)."""
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("shape, dims, want", [((3, 0, 16), (1, 2), (3,)), ((0, 4, 16), (1, 2), (0,)),
                                                ((3, 4, 0), -1, (3, 4)), ((0, 5), None, ())])  # fmt: skip
def test_nvfp4_global_scale_of_an_empty_extent_keeps_the_kept_dims(shape, dims, want):
    """One scale per kept index, as for non-empty inputs (it came back 0-d for any empty x), each the
    smallest scale since an empty group's amax is taken as 0: the floor 1e-12, never 0 (a zero global
    scale divides the block scales by zero)."""
    g = formats.nvfp4_global_scale(torch.randn(shape), dims)
    assert g.shape == want and g.dtype == torch.float32
    assert (g == torch.tensor(1e-12, dtype=torch.float32)).all()
    # and a zero block quantized with that scale decodes to exact zeros
    floor = torch.tensor([1e-12])
    packed, block = formats.quantize_nvfp4(torch.zeros(2, 16), floor)
    assert torch.equal(formats.dequantize(packed, "nvfp4", (1, 16), block, floor), torch.zeros(2, 16))


def test_nvfp4_quantize_error_bound():
    x = torch.randn(3, 11, 64) * torch.exp(torch.randn(3, 11, 4).repeat_interleave(16, dim=-1))
    g = formats.nvfp4_global_scale(x, dims=(1, 2))
    assert g.shape == (3,)
    assert torch.allclose(g.double(), x.double().abs().amax(dim=(1, 2)) / (448 * 6), rtol=1e-6, atol=0)
    packed, block = formats.quantize_nvfp4(x, g)
    assert packed.shape == (3, 11, 32) and packed.dtype == torch.uint8
    assert block.shape == (3, 11, 4) and block.dtype == torch.float8_e4m3fn
    full = _expand(block.double(), (1, 16), 11, 64) * g.double().view(3, 1, 1)
    deq = formats.dequantize(packed, "nvfp4", (1, 16), block, g).double()
    codes = torch.stack(((packed & 0xF), (packed >> 4)), dim=-1).flatten(-2)
    values = torch.tensor(E2M1, dtype=torch.float64)[codes.long()]
    assert torch.allclose(deq, values * full, rtol=1e-6, atol=0)
    v = x.double() / full
    # block scales are rounded to e4m3, so |v| may exceed 6 by 2**-4 relative and saturate (< 1 half step)
    assert (v.abs() <= 6 * (1 + 2.0**-4) + 1e-6).all()
    assert ((deq - x.double()).abs() <= _e2m1_half_step(v) * full * (1 + 1e-6)).all()



@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_nvfp4_group_holding_a_non_finite_value_decodes_to_nan(bad):
    """A 1x16 group holding NaN or inf gets the e4m3 NaN as its scale, so all of it decodes to NaN (as
    fp8's codes and mxfp4's e8m0 NaN do); the other groups, of that row too, decode as they would
    without it. A finite group past the global scale's range still saturates its scale at 448, and its
    largest element decodes as 6 * 448 * global: clipping, not NaN. Saturating inf too gave the bad
    group 6 * 448 * global and ~0 beside it, a finite token out of an undefined one."""
    x = torch.randn(3, 48)
    g = formats.nvfp4_global_scale(x).reshape(1)
    x[2, 40] = 1e3 * x.abs().max()  # finite, past 448 * 6 * g
    x[1, 20] = bad
    packed, block = formats.quantize_nvfp4(x, g)
    deq = formats.dequantize(packed, "nvfp4", (1, 16), block, g)
    assert decode_e4m3(block)[1, 1].isnan() and deq[1, 16:32].isnan().all()
    nan_free = x.clone()
    nan_free[1, 16:32] = 0.0
    p_ok, b_ok = formats.quantize_nvfp4(nan_free, g)
    others = torch.ones(3, 48, dtype=torch.bool)
    others[1, 16:32] = False
    assert torch.equal(deq[others], formats.dequantize(p_ok, "nvfp4", (1, 16), b_ok, g)[others])
    assert decode_e4m3(block)[2, 2] == 448 and deq[2, 40] == 6 * 448 * g[0]


def test_nvfp4_one_global_scale_for_every_expert():
    """A single global scale [1] for [E, R, C] weights (grouped_gemm takes one or one per expert) scales
    every expert alike: decoded here from the codes, block scales and that one value."""
    x = torch.randn(3, 5, 64) * torch.exp(torch.randn(3, 1, 1))
    g = formats.nvfp4_global_scale(x)
    assert g.numel() == 1
    g = g.reshape(1)
    packed, block = formats.quantize_nvfp4(x, g)
    want = decode_weight(packed, WeightQuant("nvfp4", GroupShape(1, 16)), block, g)
    assert torch.allclose(formats.dequantize(packed, "nvfp4", (1, 16), block, g).double(), want, rtol=1e-6, atol=0)
    full = _expand(decode_e4m3(block), (1, 16), 5, 64) * g.double()
    assert ((want - x.double()).abs() <= _e2m1_half_step(x.double() / full) * full * (1 + 1e-6)).all()

def test_mxfp4_quantize_error_bound():
    x = torch.randn(2, 7, 96) * torch.exp(torch.randn(2, 7, 3) * 3).repeat_interleave(32, dim=-1)
    packed, scale = formats.quantize_mxfp4(x)
    assert packed.shape == (2, 7, 48) and scale.shape == (2, 7, 3) and scale.dtype == torch.uint8
    s = torch.tensor([2.0 ** (b - 127) for b in scale.flatten().tolist()], dtype=torch.float64).view(2, 7, 3)
    amax = _group_amax_loop(x, (1, 32))
    assert (s * 6 >= amax).all() and (s * 3 < amax).all(), "e8m0 scale is not the smallest power of two covering amax/6"
    full = _expand(s, (1, 32), 7, 96)
    deq = formats.dequantize(packed, "mxfp4", (1, 32), scale).double()
    v = x.double() / full
    assert ((deq - x.double()).abs() <= _e2m1_half_step(v) * full * (1 + 1e-6)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_mxfp4_nonfinite_block_is_nan(bad):
    """A block holding NaN or +-inf gets the e8m0 NaN scale 0xFF and decodes to NaN throughout (OCP MX:
    e8m0 has no infinity); it used to get a finite scale and decode to finite garbage. Other blocks
    are untouched."""
    e, rows, blocks = 2, 5, 4
    x = torch.randn(e, rows, blocks * 32) * 3
    hit = torch.rand(e, rows, blocks) < 0.3
    hit.view(-1)[torch.randint(0, hit.numel(), (1,))] = True
    where = torch.randint(0, 32, (e, rows, blocks))
    cols = torch.arange(blocks) * 32 + where
    x.scatter_(2, cols, torch.where(hit, bad, x.gather(2, cols)))
    packed, scale = formats.quantize_mxfp4(x)
    assert scale[hit].eq(255).all() and scale[~hit].lt(255).all()
    deq = formats.dequantize(packed, "mxfp4", (1, 32), scale).view(e, rows, blocks, 32)
    assert deq[hit].isnan().all()
    assert deq[~hit].isfinite().all()
    clean, clean_scale = formats.quantize_mxfp4(torch.where(hit.repeat_interleave(32, dim=-1), 0.0, x))
    assert torch.equal(scale[~hit], clean_scale[~hit])
    assert torch.equal(packed.view(e, rows, blocks, 16)[~hit], clean.view(e, rows, blocks, 16)[~hit])


def test_mxfp4_known_values():
    row = torch.zeros(1, 1, 32)
    row[0, 0, :4] = torch.tensor([12.0, -1.0, 0.6, 5.0])  # amax 12 -> scale 2 (e8m0 code 128)
    packed, scale = formats.quantize_mxfp4(row)
    assert scale.tolist() == [[[128]]]
    # 12/2 = 6 -> code 7; -1/2 = -0.5 -> code 9; 0.6/2 = 0.3 -> 0.5, code 1; 5/2 = 2.5 -> 2, code 4 (a
    # tie between 2 (code 4) and 3 (code 5), to the even code)
    assert packed[0, 0, 0].item() == 7 | (9 << 4)
    assert packed[0, 0, 1].item() == 1 | (4 << 4)
    assert packed[0, 0, 2:].eq(0).all()


# ---- scale shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group,rows,cols,want",
    [((-1, -1), 0, 5, (1, 1)), ((-1, -1), 7, 5, (1, 1)), ((1, -1), 7, 5, (7, 1)), ((1, -1), 0, 5, (0, 1)),
     ((1, 128), 3, 300, (3, 3)), ((128, 128), 200, 300, (2, 3)), ((1, 16), 4, 64, (4, 4)), ((1, 32), 4, 64, (4, 2))],
)  # fmt: skip
def test_scale_shape(group, rows, cols, want):
    assert formats.scale_shape(group, rows, cols) == want
    x = torch.randn(rows, cols)
    assert formats.group_amax(x, group).shape == want


@pytest.mark.parametrize(
    "fmt,group,k,q_dtype,q_cols,s_dtype,s_shape",
    [("fp8", [-1, -1], 64, torch.float8_e4m3fn, 64, torch.float32, (1, 1)),
     ("fp8", [1, -1], 64, torch.float8_e4m3fn, 64, torch.float32, (6, 1)),
     ("fp8", [1, 128], 320, torch.float8_e4m3fn, 320, torch.float32, (6, 3)),
     ("int8", [1, -1], 64, torch.int8, 64, torch.float32, (6, 1)),
     ("int8", [-1, -1], 64, torch.int8, 64, torch.float32, (1, 1)),
     ("nvfp4", [1, 16], 64, torch.uint8, 32, torch.float8_e4m3fn, (6, 4))],
)  # fmt: skip
def test_activation_quantize_shapes_and_values(fmt, group, k, q_dtype, q_cols, s_dtype, s_shape):
    x = torch.randn(6, k) * 3
    static = (x.abs().amax() / 127).reshape(1) if group == [-1, -1] and fmt == "int8" else None
    global_scale = (x.abs().amax() / (448 * 6)).reshape(1) if fmt == "nvfp4" else None
    q, s = quantize(x, fmt, group, static, global_scale)
    assert q.dtype == q_dtype and q.shape == (6, q_cols)
    assert s.dtype == s_dtype and tuple(s.shape) == s_shape
    if static is not None:
        assert torch.equal(s.flatten(), static) and s.data_ptr() != static.data_ptr()
    deq = formats.dequantize(q, fmt, tuple(group), s, global_scale).double()
    full = _expand(s.double(), tuple(group), 6, k)
    if fmt == "nvfp4":
        full = full * global_scale.double()
    v, err = x.double() / full, (deq - x.double()).abs()
    if fmt == "fp8":
        assert (err <= torch.maximum(v.abs() * 2.0**-4, torch.full_like(v, 2.0**-10)) * full * (1 + 1e-6)).all()
    elif fmt == "int8":
        assert (err <= full * (0.5 + 1e-5)).all()
    else:
        assert (err <= _e2m1_half_step(v) * full * (1 + 1e-6)).all()


def test_e8m0_encode_scales_at_or_below_the_smallest_power_are_code_0():
    """Code 0 is 2**-127, e8m0's smallest scale: 2**-127 itself and any smaller positive scale (float32
    subnormals: the scale of a block of tiny values) or zero (an all-zero block) encode as 0, the
    smallest power of two >= the scale (they came back as code 1 = 2**-126, halving such blocks'
    precision, with the powers-of-two test starting at 2**-126)."""
    tiny = torch.exp2(-127 - torch.rand(32) * 20)  # (2**-147, 2**-127]: float32 subnormals
    scale = torch.cat((torch.tensor([2.0**-127, 0.0]), tiny))
    assert formats.e8m0_encode(scale).tolist() == [0] * scale.numel()
    assert formats.e8m0_encode(torch.tensor([2.0**-126, 2.0**-127 * 1.5])).tolist() == [1, 1]
    # a block of such values gets code 0 and decodes within half an e2m1 step of 2**-127 units
    x = torch.randn(2, 3, 32) * 2.0**-131
    assert x.abs().max() / 6 < 2.0**-127
    packed, code = formats.quantize_mxfp4(x)
    assert code.eq(0).all(), code.tolist()
    deq = formats.dequantize(packed, "mxfp4", (1, 32), code).double()
    v = x.double() / 2.0**-127
    assert ((deq - x.double()).abs() <= _e2m1_half_step(v) * 2.0**-127 * (1 + 1e-6)).all()
