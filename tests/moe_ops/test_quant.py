"""moe_ops.quant outside the fp4 encodings: fp8/int8/int4 quantizers and scale conventions
against float64 re-computations on fresh random inputs, the moe_ops::quantize op's fp8/int8 paths
(values, fake impl, no host syncs), quantize_weights (layouts, autograd, group divisibility, argument
and calibration checks) and the validation of the tensor-free dataclasses."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops import quant
from moe_ops.quant import (
    PER_CHANNEL,
    PER_TENSOR,
    PER_TOKEN,
    ActivationQuant,
    GroupShape,
    QuantScheme,
    WeightQuant,
    formats,
    quantize_weights,
)
from moe_ops.quant.quantize import _quantize as quantize_body
from moe_ops.quant.quantize import quantize

from ..decoders import decode_e4m3, decode_weight, expand
from ..host_reads import no_host_reads

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _x(m, k, dtype=torch.float32):
    """Random activations with per-row magnitudes spread over a few octaves; never all zero."""
    return (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).to(dtype)


def _group_amax64(x: torch.Tensor, group) -> torch.Tensor:
    """float64 [..., cdiv(R, gr), cdiv(C, gc)] by slicing, -1 = whole dimension (one group)."""
    *lead, rows, cols = x.shape
    gr = rows if group[0] == -1 else group[0]
    gc = cols if group[1] == -1 else group[1]
    nr = 1 if group[0] == -1 else -(-rows // gr)
    nc = 1 if group[1] == -1 else -(-cols // gc)
    out = torch.zeros(*lead, nr, nc, dtype=torch.float64)
    xd = x.double().abs()
    for i in range(nr):
        for j in range(nc):
            blk = xd[..., i * gr : (i + 1) * gr, j * gc : (j + 1) * gc]
            if blk.numel():
                out[..., i, j] = blk.amax(dim=(-2, -1))
    return out


# ---- moe_ops::quantize, fp8 and int8: values against float64 ------------------------------------

ACT_CASES = [
    ("fp8", [-1, -1], False),
    ("fp8", [-1, -1], True),
    ("fp8", [1, -1], False),
    ("fp8", [1, 128], False),
    ("fp8", [1, 64], False),
    ("int8", [1, -1], False),
    ("int8", [-1, -1], True),
    ("int8", [-1, -1], False),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fmt,group,static", ACT_CASES)
def test_activation_quantize_matches_float64(fmt, group, static, dtype):
    """Scales amax / 448 (fp8) or amax / 127 (int8) per group, [1, 1] / [M, 1] / [M, cdiv(K, g)] (a
    partial last group included); codes are x / scale rounded to nearest even, saturated."""
    m, k = int(torch.randint(1, 9, ())), 300
    x = _x(m, k, dtype)
    qmax = 448.0 if fmt == "fp8" else 127.0
    static_scale = (x.double().abs().amax() / qmax * (0.5 + torch.rand(()))).float().reshape(1) if static else None
    q, s = quantize(x, fmt, group, static_scale, None)
    assert q.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8) and q.shape == (m, k)
    want_shape = formats.scale_shape(tuple(group), m, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == want_shape and s.is_contiguous()
    if static:
        ref_scale = static_scale.double().reshape(1, 1)
        assert torch.equal(s.double(), ref_scale)
    else:
        ref_scale = _group_amax64(x, group) / qmax
        assert torch.allclose(s.double(), ref_scale, rtol=1e-6, atol=0)
    v = x.double() / expand(s.double(), group, m, k).expand(m, k)  # with the scale the op actually used
    if fmt == "fp8":
        ref = v.clamp(-448, 448).to(torch.float8_e4m3fn).double()  # float64 -> e4m3, round to nearest even
        got = decode_e4m3(q)
        assert torch.equal(got, ref)
    else:
        ref = torch.round(v).clamp(-127, 127)
        tie = ((v - v.floor()) - 0.5).abs() < 1e-5  # float32 division may land a near-tie on either side
        assert ((q.double() == ref) | tie).all()
        assert q.min() >= -127  # symmetric: -128 never used
    if not static:
        assert q.double().abs().max() == qmax  # the group max maps to the top code


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_non_finite_token_leaves_the_other_tokens_per_tensor_scale_alone(fmt, bad):
    """A dynamic per-tensor scale spans every token: a NaN or inf in one token (a garbage padding row, an
    fp16 overflow) is skipped in its amax, so the other tokens quantize as they would with that scale
    given, and the bad element becomes NaN (fp8) or code 0 / +-127 (int8, no NaN code). A per-token scale
    keeps it: that token's own scale says its values are undefined. Before, an inf made the per-tensor
    scale inf and every token's codes 0 or NaN."""
    m, k, row, col = 6, 256, 3, 17
    x = _x(m, k)
    x[row, col] = bad
    qmax = 448.0 if fmt == "fp8" else 127.0
    q, s = quantize(x, fmt, [-1, -1], None, None)
    finite = x.double().clone()
    finite[row, col] = 0.0
    want = finite.abs().amax() / qmax
    assert torch.isfinite(s).all() and torch.allclose(s.double(), want.reshape(1, 1), rtol=1e-6, atol=0)
    others = torch.arange(m) != row
    q_others, _ = quantize(x[others], fmt, [-1, -1], s.reshape(1), None)
    assert torch.equal(q[others].view(torch.uint8), q_others.view(torch.uint8))
    code = q[row, col].float()
    if fmt == "fp8":
        assert code.isnan()
    else:
        assert code == (0 if bad != bad else 127 * (1 if bad > 0 else -1))
    _, per_token = quantize(x, fmt, [1, -1], None, None)
    assert per_token[row].isfinite().all().logical_not() and torch.isfinite(per_token[others]).all()


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_activation_quantize_rounds_half_to_even_and_saturates(fmt):
    """With a static scale of 1: int8 ties go to the even integer; out-of-range values saturate to the
    largest code (not NaN, not wrap-around), and so does int8's +-inf; fp8's NaN and +-inf become NaN."""
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    big = torch.tensor([1e6, -1e6, float("inf"), -float("inf")])
    x = torch.cat((ties, big, torch.randn(5))).reshape(1, -1)
    q, _ = quantize(x, fmt, [-1, -1], torch.ones(1), None)
    if fmt == "int8":
        assert q[0, :7].tolist() == [0, 2, 2, 0, -2, -2, 126]
        assert q[0, 7:11].tolist() == [127, -127, 127, -127]
    else:
        assert decode_e4m3(q)[0, 7:9].tolist() == [448.0, -448.0] and decode_e4m3(q)[0, 9:11].isnan().all()
        xn = x.clone()
        xn[0, 0] = float("nan")
        qn, _ = quantize(xn, fmt, [-1, -1], torch.ones(1), None)
        finite = torch.ones(x.shape[1], dtype=torch.bool)
        finite[[0, 9, 10]] = False
        assert decode_e4m3(qn)[0, 0].isnan() and decode_e4m3(qn)[0, finite].isfinite().all()


@pytest.mark.parametrize("fmt,group", [("fp8", [-1, -1]), ("fp8", [1, -1]), ("fp8", [1, 128]), ("int8", [1, -1])])
def test_all_zero_group_gets_a_positive_floor_scale(fmt, group):
    """An all-zero group (a zero token, a zero 1x128 slice) gets a small positive scale, codes 0 and
    dequantizes to exact zeros, never NaN (0/0); other groups keep amax / max."""
    x = _x(4, 256)
    x[1] = 0.0
    if group == [-1, -1]:
        x.zero_()
    q, s = quantize(x, fmt, group, None, None)
    assert (s > 0).all() and s.isfinite().all()
    deq = formats.dequantize(q, fmt, tuple(group), s)
    assert deq.isfinite().all() and (deq[1] == 0).all()


@pytest.mark.parametrize("fmt,group,static", ACT_CASES)
@pytest.mark.parametrize("m,k", [(0, 300), (0, 0), (3, 0), (1, 1), (5, 100)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_quantize_fake_matches_real(fmt, group, static, m, k, layout):
    """Fake impl vs real: shape, dtype and strides of q and scale, also for empty inputs, K smaller
    than the group and a column-major x."""
    x = _x(k, m).t() if layout == "transposed" else _x(m, k)
    scale = (torch.rand(1) * 0.02 + 0.005) if static else None
    real = quantize(x, fmt, group, scale, None)
    with FakeTensorMode() as mode:
        fake = quantize(mode.from_tensor(x), fmt, group, None if scale is None else mode.from_tensor(scale), None)
    for r, f in zip(real, fake):
        assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride())


@pytest.mark.parametrize("fmt,group,static", [c for c in ACT_CASES if c[1] != [1, 64]])
def test_quantize_opcheck(fmt, group, static):
    x = _x(5, 256, torch.bfloat16)
    scale = (torch.rand(1) * 0.02 + 0.005) if static else None
    # opcheck's test_schema compares with allclose, which has no float8 kernel on the CPU
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(quantize, (x, fmt, group, scale, None), test_utils=utils)


@pytest.mark.parametrize("fmt,group,static", ACT_CASES + [("nvfp4", [1, 16], False)])
def test_quantize_real_impl_has_no_host_sync(fmt, group, static):
    """The real impl's body runs on meta tensors (which have no values): any .item()/.tolist()/nonzero/
    data-dependent branch would raise, and no_host_reads also forbids constants built on the device
    (torch.tensor(..., device=...), a host-to-device copy). The op itself would run its fake impl on
    meta, which is what this test called before."""
    x = torch.empty(5, 320, device="meta", dtype=torch.bfloat16)
    scale = torch.empty(1, device="meta") if static else None
    global_scale = torch.empty(1, device="meta") if fmt == "nvfp4" else None
    with no_host_reads():
        q, s = quantize_body(x, fmt, group, scale, global_scale)
    packing = 2 if fmt == "nvfp4" else 1
    assert q.shape == (5, 320 // packing) and tuple(s.shape) == formats.scale_shape(tuple(group), 5, 320)


# ---- weight quantizers ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(200, 300), (256, 128), (100, 64)])
def test_fp8_block_weight_scales_are_ceil_blocks(n, k):
    """128x128 blocks over [E, N, K]: scales [E, ceil(N/128), ceil(K/128)], partial edge blocks
    scaled by their own amax / 448."""
    w = torch.randn(2, n, k) * torch.exp(torch.randn(2, 1, 1))
    q, s = formats.quantize_fp8(w, (128, 128))
    assert s.shape == (2, -(-n // 128), -(-k // 128))
    assert torch.allclose(s.double(), _group_amax64(w, (128, 128)) / 448, rtol=1e-6, atol=0)
    v = w.double() / expand(s.double(), (128, 128), n, k)
    assert torch.equal(decode_e4m3(q), v.clamp(-448, 448).to(torch.float8_e4m3fn).double())


@pytest.mark.parametrize("zero_point", [False, True])
def test_int4_codes_match_float64(zero_point):
    """Symmetric: scale amax / 7, zero 8 (values -8..7, |q| <= 7 used). Asymmetric: range [min, max]
    widened to hold 0, scale (max - min) / 15, zero round(-min / scale) in 0..15, codes 0..15."""
    g = 32
    w = torch.randn(2, 5, 4 * g) + (0.6 if zero_point else 0.0)
    packed, scale, zero = formats.quantize_int4(w, g, zero_point)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).double().view(2, 5, 4, g)
    grp = w.double().view(2, 5, 4, g)
    if zero_point:
        lo, hi = grp.amin(-1).clamp(max=0), grp.amax(-1).clamp(min=0)
        s_ref = (hi - lo) / 15
        assert torch.allclose(scale.double(), s_ref, rtol=1e-6, atol=0)
        assert torch.equal(zero.double(), torch.round(-lo / scale.double()).clamp(0, 15))
        z = zero.double()
    else:
        assert zero is None
        assert torch.allclose(scale.double(), grp.abs().amax(-1) / 7, rtol=1e-6, atol=0)
        z = torch.full_like(scale.double(), 8.0)
    v = grp / scale.double()[..., None] + z[..., None]
    ref = torch.round(v).clamp(0, 15)
    tie = ((v - v.floor()) - 0.5).abs() < 1e-5
    assert ((codes == ref) | tie).all()
    deq = decode_weight(packed, WeightQuant("int4", GroupShape(1, g), zero_point), scale, None, zero)
    assert ((deq - w.double()).abs() <= expand(scale.double(), (1, g), 5, 4 * g) * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("shape", [(2, 4, 48), (2, 4, 33)])
@pytest.mark.parametrize("zero_point", [False, True])
def test_quantize_int4_rejects_k_off_the_group(shape, zero_point):
    """K not a multiple of the group size (or odd) is a ValueError naming the shape; it was a
    RuntimeError from reshape (zero points) or a broadcast error from nibble packing (odd K), or
    silently padded scales that fused_experts then rejected."""
    with pytest.raises(ValueError, match=r"x: int4 needs .* group_size=32, got shape"):
        formats.quantize_int4(torch.randn(shape), 32, zero_point)


# ---- quantize_weights ----------------------------------------------------------------------------

E, H, I = 3, 256, 128

WEIGHT_SCHEMES = {
    "fp8_per_tensor_static": QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR)),
    "fp8_per_token": QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL)),
    "fp8_block": QuantScheme(ActivationQuant("fp8", GroupShape(1, 128)), WeightQuant("fp8", GroupShape(128, 128))),
    "int8_w8a8_static": QuantScheme(ActivationQuant("int8", PER_TENSOR, static=True), WeightQuant("int8", PER_CHANNEL)),
    "int8_w8a16_g64": QuantScheme(None, WeightQuant("int8", GroupShape(1, 64))),
    "int4": QuantScheme(None, WeightQuant("int4", GroupShape(1, 32))),
    "int4_zero_point": QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True)),
}


def _weights(gated=True):
    w13 = torch.randn(E, (2 if gated else 1) * I, H) / H**0.5
    w2 = torch.randn(E, H, I) / I**0.5
    return w13, w2


@pytest.mark.parametrize("name", list(WEIGHT_SCHEMES))
def test_quantize_weights_shapes_dtypes_and_orientation(name):
    """Every returned tensor: w13 [E, 2I, H/p], w2 [E, H, I/p]; scales [E, cdiv(N, gr), cdiv(K, gc)]
    with N the output rows and K the reduction dim of each GEMM (w2's groups run along I); static
    activation scales [1] float32, amax / max over each GEMM's calibration samples."""
    scheme = WEIGHT_SCHEMES[name]
    w13, w2 = _weights()
    cal, inter = _x(16, H), 3 * _x(24, I)
    q13, q2, cfg = quantize_weights(scheme, w13.to(torch.bfloat16), w2.to(torch.bfloat16), calibration=cal,
                                    intermediate_calibration=inter)  # fmt: skip
    wq = scheme.weight
    p = wq.packing
    assert q13.dtype == q2.dtype == wq.storage
    assert q13.shape == (E, 2 * I, H // p) and q2.shape == (E, H, I // p)
    group = wq.group.astuple()
    assert cfg.w13_scale.shape == (E, *formats.scale_shape(group, 2 * I, H))
    assert cfg.w2_scale.shape == (E, *formats.scale_shape(group, H, I))
    assert cfg.w13_scale.dtype == cfg.w2_scale.dtype == torch.float32
    if wq.zero_point:
        assert cfg.w13_zero.shape == cfg.w13_scale.shape and cfg.w13_zero.dtype == torch.uint8
        assert cfg.w2_zero.shape == cfg.w2_scale.shape and cfg.w2_zero.dtype == torch.uint8
    else:
        assert cfg.w13_zero is None and cfg.w2_zero is None
    if scheme.activation is not None and scheme.activation.static:
        qmax = 448.0 if scheme.activation.dtype == "fp8" else 127.0
        assert cfg.a13_scale.shape == cfg.a2_scale.shape == (1,) and cfg.a13_scale.dtype == cfg.a2_scale.dtype == torch.float32
        assert torch.allclose(cfg.a13_scale.double(), cal.double().abs().amax() / qmax, rtol=1e-6)
        assert torch.allclose(cfg.a2_scale.double(), inter.double().abs().amax() / qmax, rtol=1e-6)
    else:
        assert cfg.a13_scale is None and cfg.a2_scale is None
    cfg.check_weights(q13, q2, H, I, 2 * I)
    # the decoded weights are within half a step of the input, scale by scale
    for q, w, s, z in ((q13, w13, cfg.w13_scale, cfg.w13_zero), (q2, w2, cfg.w2_scale, cfg.w2_zero)):
        d = decode_weight(q, wq, s, None, z)
        w = w.to(torch.bfloat16).double()
        step = expand(s.double(), group, *w.shape[1:])
        bound = step * 0.5 if wq.dtype != "fp8" else torch.maximum(w.abs() * 2.0**-4, step * 2.0**-10)
        assert ((d - w).abs() <= bound * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("name", list(WEIGHT_SCHEMES))
def test_quantize_weights_of_column_major_weights_are_contiguous(name):
    """Transposed checkpoints are read as column-major views (README); quantizing them returned
    non-contiguous storage (strides (65536, 1, 256)) that fused_experts then rejected ("quantized
    weights must be contiguous"). Now contiguous, with the same values as from a contiguous copy."""
    scheme = WEIGHT_SCHEMES[name]
    w13, w2 = _weights()
    w13_cm, w2_cm = w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w13_cm.is_contiguous()
    cal = dict(calibration=_x(16, H), intermediate_calibration=_x(16, I))
    q13, q2, cfg = quantize_weights(scheme, w13_cm, w2_cm, **cal)
    r13, r2, ref = quantize_weights(scheme, w13, w2, **cal)
    for t in (q13, q2, *(v for v in cfg.tensors().values() if v is not None)):
        assert t.is_contiguous()
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    assert torch.equal(as_bytes(q13), as_bytes(r13)) and torch.equal(as_bytes(q2), as_bytes(r2))
    assert torch.equal(cfg.w13_scale, ref.w13_scale) and torch.equal(cfg.w2_scale, ref.w2_scale)
    x = _x(4, H)
    tw, ti = moe_ops.route(torch.randn(4, E), 2)
    out = moe_ops.fused_experts(x, q13, q2, tw, ti, quant_config=cfg)
    assert torch.equal(out, moe_ops.fused_experts(x, r13, r2, tw, ti, quant_config=ref))


@pytest.mark.parametrize("name", ["fp8_per_tensor_static", "int4_zero_point", "int8_w8a16_g64"])
def test_quantize_weights_of_parameters_carry_no_autograd_history(name):
    """Model weights are nn.Parameters (requires_grad=True): the quantized weights, scales and
    calibrated activation scales came back with grad_fn, holding the float weights alive through
    the graph and making the layer's output require grad. Now plain tensors."""
    w13, w2 = (torch.nn.Parameter(w) for w in _weights())
    cal = _x(8, H).requires_grad_()
    q13, q2, cfg = quantize_weights(WEIGHT_SCHEMES[name], w13, w2, calibration=cal, intermediate_calibration=_x(8, I))
    for t in (q13, q2, *(v for v in cfg.tensors().values() if v is not None)):
        assert not t.requires_grad and t.grad_fn is None
    tw, ti = moe_ops.route(torch.randn(3, E), 2)
    assert not moe_ops.fused_experts(_x(3, H), q13, q2, tw, ti, quant_config=cfg).requires_grad


@pytest.mark.parametrize(
    "wq,k13",
    [(WeightQuant("int4", GroupShape(1, 32), zero_point=True), 48), (WeightQuant("int4", GroupShape(1, 32)), 48),
     (WeightQuant("int4", GroupShape(1, 32)), 33), (WeightQuant("int8", GroupShape(1, 32)), 48)],
)  # fmt: skip
def test_quantize_weights_rejects_k_off_the_group(wq, k13):
    """A 1xG weight format needs K to be a multiple of G (and even when packed), as check_weights and
    fused_experts require: quantize_weights raised a RuntimeError from reshape, or returned padded
    scales [E, N, cdiv(K, G)] that fused_experts then rejected. Now a ValueError up front naming the
    weight, K and the group size."""
    scheme = QuantScheme(None, wq)
    w13, w2 = torch.randn(2, 64, k13), torch.randn(2, k13, 32)
    with pytest.raises(ValueError, match=rf"w13: (K={k13} must be a multiple of the {wq.dtype} group size 32|.*K={k13} must be even)"):
        quantize_weights(scheme, w13, w2)
    w13, w2 = torch.randn(2, 2 * k13, 64), torch.randn(2, 64, k13)  # now the second GEMM's K (= I) is off
    with pytest.raises(ValueError, match=rf"w2: (K={k13} must be a multiple|.*K={k13} must be even)"):
        quantize_weights(scheme, w13, w2)


@pytest.mark.parametrize("which", ["w13", "w2"])
def test_nvfp4_weights_get_one_global_scale_per_expert(which):
    # nvfp4's global scales are per expert ([E]): an expert whose weights are 1e-6 of the others' keeps
    # nvfp4's precision (~0.095 relative error on Gaussian weights). One global scale for all experts
    # would put its e4m3 block scales below the smallest subnormal: the expert would decode to zeros.
    scheme = QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16)))
    w13, w2 = _weights()
    w = {"w13": w13, "w2": w2}[which]
    w[1] *= 1e-6
    q13, q2, cfg = quantize_weights(scheme, w13, w2)
    q, s, g = (q13, cfg.w13_scale, cfg.w13_global_scale) if which == "w13" else (q2, cfg.w2_scale, cfg.w2_global_scale)
    assert g.shape == (E,)
    d = decode_weight(q, scheme.weight, s, g)
    for e in range(E):
        err = (d[e] - w[e].double()).norm() / w[e].double().norm()
        assert err < 0.15, f"expert {e}: relative error {err:.3g}"


FP8_STATIC = WEIGHT_SCHEMES["fp8_per_tensor_static"]
FP8_TOKEN = WEIGHT_SCHEMES["fp8_per_token"]

BAD_QUANTIZE_WEIGHTS = {
    "w13_2d": (FP8_TOKEN, lambda w13, w2: (w13[0], w2), {}, ValueError, r"w13: expected 3-D \[E, N, K\]"),
    "w2_not_tensor": (FP8_TOKEN, lambda w13, w2: (w13, w2.tolist()), {}, TypeError, r"w2: expected a torch.Tensor, got list"),
    "w13_int8_codes": (FP8_TOKEN, lambda w13, w2: (w13.to(torch.int8), w2), {}, TypeError,
                       r"w13: dtype torch.int8 is not allowed"),
    "w13_already_fp8": (FP8_TOKEN, lambda w13, w2: (w13.to(torch.float8_e4m3fn), w2), {}, TypeError,
                        r"w13: dtype torch.float8_e4m3fn is not allowed"),
    "experts_mismatch": (FP8_TOKEN, lambda w13, w2: (w13, w2[:2]), {}, ValueError, r"w2: expected \[E, H, I\] = \[3, 256, I\]"),
    "hidden_mismatch": (FP8_TOKEN, lambda w13, w2: (w13, w2[:, :200]), {}, ValueError, r"w2: expected \[E, H, I\]"),
    "intermediate_mismatch": (FP8_TOKEN, lambda w13, w2: (w13, w2[..., :100]), {}, ValueError, r"w2: expected \[E, H, I\]"),
    "bias_shape": (FP8_TOKEN, lambda w13, w2: (w13, w2), dict(w2_bias=torch.zeros(E, H + 1)), ValueError,
                   r"w2_bias: expected shape \(3, 256\)"),
    "calibration_empty": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=torch.randn(0, H)), ValueError,
                          r"calibration: expected sample hidden states \[T, H\] with H=256 \(w13's last dim\) with T >= 1, got shape \(0, 256\)"),
    "calibration_width": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=torch.randn(8, H // 2)), ValueError,
                          r"calibration: .* got shape \(8, 128\)"),
    "calibration_list": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=[[1.0] * H]), TypeError,
                         r"calibration: expected a torch.Tensor, got list"),
    "calibration_int": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=torch.ones(4, H, dtype=torch.int64)),
                        TypeError, r"calibration: dtype torch.int64 is not allowed"),
    "calibration_nan": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=torch.full((4, H), float("nan"))),
                        ValueError, r"calibration: holds NaN or inf"),
    "calibration_inf": (WEIGHT_SCHEMES["int8_w8a8_static"], lambda w13, w2: (w13, w2),
                        dict(calibration=torch.randn(4, H).index_fill_(1, torch.tensor([7]), float("inf"))),
                        ValueError, r"calibration: holds NaN or inf"),
    "intermediate_missing": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(calibration=torch.randn(4, H), intermediate_calibration=None),
                             ValueError, r"intermediate_calibration: scheme fp8_w8a8_per_tensor .* needs GEMM2's sample inputs \[T, I\] with I=128"),
    "intermediate_width": (WEIGHT_SCHEMES["int8_w8a8_static"], lambda w13, w2: (w13, w2), dict(intermediate_calibration=torch.randn(4, H)),
                           ValueError, r"intermediate_calibration: expected GEMM2's sample inputs \[T, I\] with I=128 .* got shape \(4, 256\)"),
    "intermediate_nan": (FP8_STATIC, lambda w13, w2: (w13, w2), dict(intermediate_calibration=torch.full((4, I), float("nan"))),
                         ValueError, r"intermediate_calibration: holds NaN or inf"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_QUANTIZE_WEIGHTS))
def test_quantize_weights_rejects(case):
    """Each of these used to be accepted (a 2-D weight, int8 codes or fp8 storage re-quantized as if
    they were floats, mismatched E/H/I, a calibration of the wrong width or with NaN/inf giving NaN
    scales) or to fail with another error (an empty calibration: amax's RuntimeError; a list:
    AttributeError)."""
    scheme, edit, kw, exc, match = BAD_QUANTIZE_WEIGHTS[case]
    w13, w2 = edit(*_weights())
    # valid samples for whatever the case does not replace
    if "calibration" in kw or "intermediate_calibration" in kw:
        kw = {"calibration": _x(4, H), "intermediate_calibration": _x(4, I), **kw}
    with pytest.raises(exc, match=match):
        quantize_weights(scheme, w13, w2, **kw)


def test_quantize_weights_accepts_meta_calibration_and_ungated_w13():
    """Positive controls: the meta-device init path (no values to check) and w13 [E, I, H]."""
    w13, w2 = _weights(gated=False)
    q13, q2, cfg = quantize_weights(FP8_STATIC, w13.to("meta"), w2.to("meta"), calibration=torch.randn(4, H, device="meta"),
                                    intermediate_calibration=torch.randn(4, I, device="meta"))  # fmt: skip
    assert q13.shape == (E, I, H) and cfg.a13_scale.device.type == "meta"
    q13, q2, cfg = quantize_weights(FP8_STATIC, w13, w2, calibration=_x(4, H), intermediate_calibration=_x(4, I))
    cfg.check_weights(q13, q2, H, I, I)


# ---- the tensor-free dataclasses ------------------------------------------------------------------

BAD_DATACLASSES = {
    "static_str": (lambda: ActivationQuant("fp8", PER_TENSOR, static="False"), TypeError,
                   r"ActivationQuant.static: expected a bool, got 'False'"),
    "static_int": (lambda: ActivationQuant("int8", PER_TENSOR, static=1), TypeError, r"ActivationQuant.static: expected a bool, got 1"),
    "zero_point_str": (lambda: WeightQuant("int4", GroupShape(1, 32), zero_point="yes"), TypeError,
                       r"WeightQuant.zero_point: expected a bool, got 'yes'"),
    "dtype_list": (lambda: WeightQuant(["fp8"], PER_CHANNEL), TypeError, r"WeightQuant.dtype: expected a str, got \['fp8'\]"),
    "dtype_torch": (lambda: ActivationQuant(torch.float8_e4m3fn, PER_TOKEN), TypeError,
                    r"ActivationQuant.dtype: expected a str, got torch.float8_e4m3fn .*allowed: 'fp8'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DATACLASSES))
def test_quant_dataclasses_validate_field_types(case):
    """static="False" made a static scheme and zero_point="yes" an asymmetric one (truthy strings);
    an unhashable dtype raised "unhashable type: 'list'" without naming the field."""
    build, exc, match = BAD_DATACLASSES[case]
    with pytest.raises(exc, match=match):
        build()


def test_quant_dataclasses_accept_bools():
    assert ActivationQuant("fp8", PER_TENSOR, static=True).static is True
    assert WeightQuant("int4", GroupShape(1, 32), zero_point=False).zero_point is False
    assert quant.int4_w4a16(torch.ones(E, 2 * I, H // 32), torch.ones(E, H, I // 32)).scheme.weight.zero_point is False


# ---- the public helpers' arguments ------------------------------------------------------------------

_NVFP4 = WeightQuant("nvfp4", GroupShape(1, 16))
_INT4 = WeightQuant("int4", GroupShape(1, 32))
_INT4_ZP = WeightQuant("int4", GroupShape(1, 32), zero_point=True)
_MXFP4 = WeightQuant("mxfp4", GroupShape(1, 32))


def _stored(wq):
    q = quant.quantize_weight(torch.randn(2, 16, 64), wq)
    return q["q"], q["scale"], q["global_scale"], q["zero"]


BAD_DEQUANTIZE = {
    # nvfp4 without its global scale came back off by that scale, silently
    "nvfp4_no_global": (_NVFP4, lambda q, s, g, z: (q, s, None, None), TypeError, r"global_scale: expected a torch.Tensor, got NoneType"),
    "no_scale": (_INT4, lambda q, s, g, z: (q, None, None, None), TypeError, r"scale: expected a torch.Tensor, got NoneType"),
    "scale_shape": (_INT4, lambda q, s, g, z: (q, s[:, :, :1], None, None), ValueError, r"scale: expected shape \(2, 16, 2\)"),
    "zero_missing": (_INT4_ZP, lambda q, s, g, z: (q, s, None, None), TypeError, r"zero: expected a torch.Tensor, got NoneType"),
    "zero_unexpected": (_INT4, lambda q, s, g, z: (q, s, None, torch.zeros_like(s, dtype=torch.uint8)), ValueError,
                        r"zero: int4 1x32 without zero points takes none"),
    "storage_dtype": (_INT4, lambda q, s, g, z: (q.float(), s, None, None), TypeError, r"w: dtype torch.float32 is not allowed; allowed: torch.uint8"),
    # float32 powers of two read as e8m0 exponents decoded to ~1e-38 (max |value| 5e-38 for ~4)
    "mxfp4_float_scale": (_MXFP4, lambda q, s, g, z: (q, formats.e8m0_decode(s), None, None), TypeError,
                          r"scale: dtype torch.float32 is not allowed; allowed: torch.uint8"),
    "nvfp4_global_shape": (_NVFP4, lambda q, s, g, z: (q, s, torch.ones(3), None), ValueError,
                           r"global_scale: expected shape \(2,\) \(\[E\]\), got \(3,\)"),
    "nvfp4_global_dtype": (_NVFP4, lambda q, s, g, z: (q, s, g.double(), None), TypeError, r"global_scale: dtype torch.float64 is not allowed"),
    "global_for_int4": (_INT4, lambda q, s, g, z: (q, s, torch.ones(2), None), ValueError, r"global_scale: only nvfp4 weights have one, got one for int4"),
    "zero_dtype": (_INT4_ZP, lambda q, s, g, z: (q, s, None, z.float()), TypeError, r"zero: dtype torch.float32 is not allowed; allowed: torch.uint8"),
    # a zero point per channel instead of per group: a RuntimeError from deep in the decoder's expand, not naming zero
    "zero_shape": (_INT4_ZP, lambda q, s, g, z: (q, s, None, z[:, :, :1].contiguous()), ValueError, r"zero: expected shape \(2, 16, 2\)"),
}  # fmt: skip


def test_quantize_weights_keeps_biases_of_an_unquantized_scheme():
    """An unquantized scheme's config still carries the expert biases it was given (they were dropped
    with the suite green: the layer would then run without them)."""
    w13, w2 = torch.randn(2, 32, 16), torch.randn(2, 16, 16)
    b13, b2 = torch.randn(2, 32), torch.randn(2, 16)
    q13, q2, config = quantize_weights(QuantScheme(), w13, w2, w13_bias=b13, w2_bias=b2)
    assert q13 is w13 and q2 is w2
    assert torch.equal(config.w13_bias, b13) and torch.equal(config.w2_bias, b2)


@pytest.mark.parametrize("case", list(BAD_DEQUANTIZE))
def test_dequantize_weight_rejects(case):
    wq, edit, exc, match = BAD_DEQUANTIZE[case]
    q, s, g, z = edit(*_stored(wq))
    with pytest.raises(exc, match=match):
        quant.dequantize_weight(q, wq, s, g, z)


@pytest.mark.parametrize("wq", [_NVFP4, _INT4, _INT4_ZP, _MXFP4], ids=["nvfp4", "int4", "int4_zp", "mxfp4"])
def test_dequantize_weight_accepts_what_quantize_weight_stores(wq):
    # Positive control for test_dequantize_weight_rejects: within the format's step of the float input.
    w = torch.randn(2, 16, 64)
    q = quant.quantize_weight(w, wq)
    out = quant.dequantize_weight(q["q"], wq, q["scale"], q["global_scale"], q["zero"])
    assert out.shape == w.shape and (out - w).norm() / w.norm() < 0.2


def test_dequantize_weight_of_unquantized_weights_is_float32():
    # The documented float32 result holds without a WeightQuant too: bf16 weights come back widened, values exact.
    w = torch.randn(2, 16, 64).to(torch.bfloat16)
    out = quant.dequantize_weight(w, None)
    assert out.dtype == torch.float32 and torch.equal(out, w.double().float())


def test_static_scale_helpers_reject_other_schemes():
    with pytest.raises(TypeError, match=r"scheme: expected a QuantScheme, got NoneType"):
        quant.needs_calibration(None)
    dynamic = QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL))
    with pytest.raises(ValueError, match=r"scheme: fp8_w8a8_per_token .* has no static activation scales"):
        quant.static_activation_scales(dynamic, torch.randn(4, H), torch.randn(4, I))


@pytest.mark.parametrize("empty", ["calibration", "intermediate_calibration"])
def test_static_activation_scales_reject_empty_samples(empty):
    """static_activation_scales is public: called directly with no samples for one GEMM it names the
    argument (an amax over nothing has no value; torch raises its own reduction error there)."""
    static = QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR))
    samples = {"calibration": torch.randn(4, H), "intermediate_calibration": torch.randn(4, I)}
    samples[empty] = samples[empty][:0]
    with pytest.raises(ValueError, match=rf"{empty}: no samples, got shape \(0, \d+\)"):
        quant.static_activation_scales(static, **samples)
    scales = quant.static_activation_scales(static, torch.full((2, H), 448.0), torch.full((2, I), -896.0))
    assert scales["a13_scale"].tolist() == [1.0] and scales["a2_scale"].tolist() == [2.0]  # amax / 448


# ---- mutation round: behaviours the suite did not pin ----------------------------------------------


@pytest.mark.parametrize("k,group_size", [(33, 11), (21, 3)])
@pytest.mark.parametrize("zero_point", [False, True])
def test_quantize_int4_rejects_odd_k_that_its_group_divides(k, group_size, zero_point):
    """An odd K that an odd group size divides (33 in groups of 11) cannot be packed two per byte: the
    same ValueError naming the shape, not a broadcast RuntimeError from nibble packing."""
    with pytest.raises(ValueError, match=rf"x: int4 needs the last dim to be even .* group_size={group_size}, got shape \(2, 4, {k}\)"):
        formats.quantize_int4(torch.randn(2, 4, k), group_size, zero_point)


@pytest.mark.parametrize("group", [[1], [-1], []], ids=["one", "minus_one", "empty"])
def test_quantize_rejects_a_group_that_is_not_rows_cols(group):
    """A group of another length than 2 is a ValueError naming `group` (a one-element group was an
    IndexError from deep in the recipe check)."""
    with pytest.raises(ValueError, match=r"group: got \[.*\]; allowed: \[rows, cols\]"):
        quantize(_x(3, 64), "fp8", group, None, None)


@pytest.mark.parametrize(
    "wq,k",
    [(WeightQuant("int8", GroupShape(1, 32)), 48), (_NVFP4, 40), (_MXFP4, 48), (WeightQuant("int4", GroupShape(1, 11)), 33)],
    ids=["int8_1x32", "nvfp4", "mxfp4", "int4_odd"],
)  # fmt: skip
def test_quantize_weight_rejects_k_off_the_group(wq, k):
    """quantize_weight (public) asks what quantize_weights asks of K: a ValueError with the caller's name for
    the weight; without it, int8/nvfp4/mxfp4 came back with padded scales [E, N, cdiv(K, G)] that
    check_weights and fused_experts then reject."""
    what = "must be even" if k % 2 else f"must be a multiple of the {wq.dtype} group size {wq.group.cols}"
    with pytest.raises(ValueError, match=rf"w13: .*K={k} {what}, got shape \(2, 16, {k}\)"):
        quant.quantize_weight(torch.randn(2, 16, k), wq, name="w13")


def test_quantize_weight_and_dequantize_weight_name_a_wrong_wq():
    """A dtype string in place of the WeightQuant is a TypeError naming `wq`, not an AttributeError."""
    with pytest.raises(TypeError, match=r"wq: expected a WeightQuant, got str"):
        quant.quantize_weight(torch.randn(2, 16, 64), "int4")
    q, s, _, _ = _stored(_INT4)
    with pytest.raises(TypeError, match=r"wq: expected a WeightQuant or None, got str"):
        quant.dequantize_weight(q, "int4", s)


def test_dequantize_weight_rejects_a_2d_weight():
    """One expert's [N, K/2] storage (no E) is a ValueError naming w and the layout, not an IndexError."""
    q, s, _, _ = _stored(_INT4)
    with pytest.raises(ValueError, match=r"w: expected 3-D \[E, N, K/2\] int4 storage, got shape \(16, 32\)"):
        quant.dequantize_weight(q[0], _INT4, s[0])


STATIC_SCHEMES = {
    "fp8": (WEIGHT_SCHEMES["fp8_per_tensor_static"], "scale", 448.0),
    "int8": (WEIGHT_SCHEMES["int8_w8a8_static"], "scale", 127.0),
    "nvfp4": (QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), _NVFP4), "global_scale", 448.0 * 6.0),
}


@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 1e3])
@pytest.mark.parametrize("fmt", list(STATIC_SCHEMES))
def test_static_activation_scales_match_float64(fmt, magnitude):
    """Each GEMM's static scale is its samples' amax over the format's range (fp8 448, int8 127, nvfp4's
    global scale 448 * 6), float32 [1], for samples of any magnitude (small ones included: the floor
    only keeps an all-zero calibration's scale positive), with the scheme's field names."""
    scheme, key, qmax = STATIC_SCHEMES[fmt]
    cal, inter = _x(int(torch.randint(1, 9, ())), H) * magnitude, _x(5, I) * magnitude * 3
    scales = quant.static_activation_scales(scheme, cal, inter)
    assert sorted(scales) == sorted([f"a13_{key}", f"a2_{key}"])
    for name, samples in ((f"a13_{key}", cal), (f"a2_{key}", inter)):
        got = scales[name]
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert torch.allclose(got.double(), samples.double().abs().amax() / qmax, rtol=1e-6, atol=0), name


def test_static_activation_scale_of_all_zero_samples_stays_positive():
    """GEMM2's samples all zero (no routed pair activates): a small positive scale, not 0, so the static
    quantizer maps zeros to zero codes instead of 0/0 = NaN; GEMM1's scale is unaffected."""
    static = WEIGHT_SCHEMES["fp8_per_tensor_static"]
    cal = _x(4, H)
    scales = quant.static_activation_scales(static, cal, torch.zeros(3, I))
    a2 = scales["a2_scale"]
    assert (a2 > 0).all() and a2.isfinite().all() and a2.item() <= 1e-6 / 448 * (1 + 1e-6)
    assert torch.allclose(scales["a13_scale"].double(), cal.double().abs().amax() / 448, rtol=1e-6, atol=0)
    q, _ = quantize(torch.zeros(2, I), "fp8", [-1, -1], a2, None)
    assert torch.equal(decode_e4m3(q), torch.zeros(2, I, dtype=torch.float64))


@pytest.mark.parametrize(
    "which,bad,exc,match",
    [("calibration", lambda t: t.index_fill(1, torch.tensor([3]), float("nan")), ValueError, r"calibration: holds NaN or inf"),
     ("intermediate_calibration", lambda t: t.index_fill(1, torch.tensor([5]), -float("inf")), ValueError,
      r"intermediate_calibration: holds NaN or inf"),
     ("intermediate_calibration", lambda t: t.round().to(torch.int64), TypeError, r"intermediate_calibration: dtype torch.int64 is not allowed"),
     ("calibration", lambda t: t.round().to(torch.int32), TypeError, r"calibration: dtype torch.int32 is not allowed")],
    ids=["cal_nan", "inter_inf", "inter_int64", "cal_int32"],
)  # fmt: skip
def test_static_activation_scales_check_samples_when_called_directly(which, bad, exc, match):
    """static_activation_scales is public: called directly (not through quantize_weights, which checks
    first) it rejects NaN/inf samples (they gave a NaN or inf scale) and integer samples by name."""
    static = WEIGHT_SCHEMES["fp8_per_tensor_static"]
    samples = {"calibration": _x(4, H) * 10, "intermediate_calibration": _x(4, I) * 10}
    samples[which] = bad(samples[which])
    with pytest.raises(exc, match=match):
        quant.static_activation_scales(static, **samples)


def test_quantize_weights_puts_calibrated_scales_on_the_weights_device():
    """Calibration samples on another device than the weights (CPU samples, meta here standing in for
    GPU weights): the static scales follow the weights, as every other config tensor does; left on
    the samples' device, fused_experts rejects the config."""
    w13, w2 = _weights()
    _, _, cfg = quantize_weights(FP8_STATIC, w13.to("meta"), w2.to("meta"), calibration=_x(4, H), intermediate_calibration=_x(4, I))
    assert cfg.a13_scale.shape == cfg.a2_scale.shape == (1,) and cfg.a13_scale.dtype == cfg.a2_scale.dtype == torch.float32
    for t in (cfg.a13_scale, cfg.a2_scale, cfg.w13_scale, cfg.w2_scale):
        assert t.device.type == "meta"


@pytest.mark.parametrize(
    "x,exc,match",
    [(lambda: _x(6, 64).reshape(2, 3, 64), ValueError, r"x: expected 2-D \[M, K\], got shape \(2, 3, 64\)"),
     (lambda: _x(1, 64).reshape(64), ValueError, r"x: expected 2-D \[M, K\], got shape \(64,\)"),
     (lambda: (_x(3, 64) * 20).round().to(torch.int64), TypeError, r"x: dtype torch.int64 is not allowed"),
     (lambda: _x(3, 64).double(), TypeError, r"x: dtype torch.float64 is not allowed")],
    ids=["3d", "1d", "int64", "float64"],
)  # fmt: skip
def test_quantize_rejects_x_of_another_rank_or_dtype(x, exc, match):
    """moe_ops::quantize takes float [M, K] activations: a 3-D x came back as 3-D codes and integer or
    float64 x was quantized silently (the real and fake impls both accepted them)."""
    with pytest.raises(exc, match=match):
        quantize(x(), "fp8", [1, -1], None, None)


def _config_edit(**fields):
    return lambda q13, q2, cfg: (q13, q2, dataclasses.replace(cfg, **fields))


BAD_CHECK_WEIGHTS = {
    "w2_bias_shape": (FP8_TOKEN, _config_edit(w2_bias=torch.randn(E, H + 1)), ValueError, r"w2_bias: expected shape \(3, 256\) \(\[E, N\]\), got \(3, 257\)"),
    "w13_bias_per_k": (FP8_TOKEN, _config_edit(w13_bias=torch.randn(E, H + 2)), ValueError, r"w13_bias: expected shape \(3, 256\) \(\[E, N\]\), got \(3, 258\)"),
    "w13_bias_int": (FP8_TOKEN, _config_edit(w13_bias=torch.ones(E, 2 * I, dtype=torch.int32)), TypeError,
                     r"w13_bias: dtype torch.int32 is not allowed"),
    "unquantized_int8_weight": (QuantScheme(), lambda q13, q2, cfg: (q13.to(torch.int8), q2, cfg), TypeError,
                                r"w13: dtype torch.int8 is not allowed"),
    "unquantized_float64_w2": (QuantScheme(), lambda q13, q2, cfg: (q13, q2.double(), cfg), TypeError,
                               r"w2: dtype torch.float64 is not allowed"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CHECK_WEIGHTS))
def test_check_weights_rejects(case):
    """QuantConfig.check_weights (public) checks the biases' [E, N] shape and float dtype, and unquantized
    weights' float dtype, with the tensor's name; the config quantize_weights made passes (positive control)."""
    scheme, edit, exc, match = BAD_CHECK_WEIGHTS[case]
    q13, q2, cfg = quantize_weights(scheme, *_weights())
    cfg.check_weights(q13, q2, H, I, 2 * I)
    q13, q2, cfg = edit(q13, q2, cfg)
    with pytest.raises(exc, match=match):
        cfg.check_weights(q13, q2, H, I, 2 * I)


def test_mxfp4_w4a8_per_token_gives_dynamic_per_token_activations():
    """mxfp4_w4a8(per_token=True) builds fp8 per-token (dynamic) activations; per_token=False per-tensor."""
    _, _, cfg = quantize_weights(QuantScheme(None, _MXFP4), *_weights())
    per_token = quant.mxfp4_w4a8(cfg.w13_scale, cfg.w2_scale, per_token=True).scheme.activation
    assert per_token == ActivationQuant("fp8", PER_TOKEN, static=False)
    assert quant.mxfp4_w4a8(cfg.w13_scale, cfg.w2_scale).scheme.activation == ActivationQuant("fp8", PER_TENSOR, static=False)
