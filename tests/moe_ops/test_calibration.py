"""Static activation scales (fp8/int8 per-tensor static, nvfp4's global scales): expert_intermediates
against a float64 re-computation, and FusedMoE calibrating them from sample hidden states through its
router (load_weights(..., calibration=x), calibrate(x)).

Before, FusedMoE calibrated once, at construction, on torch.randn(64, H), kept those scales for any
weights load_weights brought, and guessed GEMM2's input range as 4x GEMM1's: hidden states of
magnitude 20 came out 94-99% wrong (fp8 static, nvfp4 w4a4), silently."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import moe_ops
from moe_ops.quant import PER_CHANNEL, PER_TENSOR, ActivationQuant, GroupShape, QuantScheme, WeightQuant
from moe_ops.reference import relative_error, tolerance

from ..decoders import decode_weight
from ..seeds import generator

E, TOP_K, H, I = 8, 2, 128, 64
STATIC = {
    "fp8_per_tensor_static": QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR)),
    "int8_w8a8_static": QuantScheme(ActivationQuant("int8", PER_TENSOR, static=True), WeightQuant("int8", PER_CHANNEL)),
    "nvfp4_w4a4": QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16))),
}
# activation format -> the value a static scale maps amax to (nvfp4: largest e4m3 block scale x largest e2m1)
RANGE = {"fp8": 448.0, "int8": 127.0, "nvfp4": 448.0 * 6.0}
# The allowed relative error against the float64 layer without activation quantization. int8 gets 1%
# over tolerance()'s 3%: one static step, amax / 127 of GEMM2's heavy-tailed SwiGLU outputs, gives 2.4%
# on average here (2.9% at most over 30 seeds). The uncalibrated scales gave 94-99%.
BOUND = {"fp8": tolerance(torch.float32, "fp8"), "int8": tolerance(torch.float32, "int8") + 0.01, "nvfp4": tolerance(torch.float32, "nvfp4")}
DYNAMIC = QuantScheme(ActivationQuant("fp8", GroupShape(1, -1)), WeightQuant("fp8", PER_CHANNEL))


def _layer(scheme) -> moe_ops.FusedMoE:
    return moe_ops.FusedMoE(E, TOP_K, H, I, quant_config=scheme, dtype=torch.float32)


def _float_experts(seed: int, gain: float = 3.0):
    """w13 [E, 2I, H] (scaled by gain, so GEMM2's inputs are far from GEMM1's range), w2 [E, H, I]."""
    g = generator(seed)
    return gain * torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H), torch.randn(E, H, I, generator=g) / math.sqrt(I)


def _act64(pre: torch.Tensor, activation) -> torch.Tensor:
    """One pair's GEMM1 output [n13] (float64) -> GEMM2's input [I], each activation written out here
    (not moe_ops/activation.py's table)."""
    act = moe_ops.Activation(activation) if isinstance(activation, str) else activation
    if act.kind == "relu2":  # no gate: [I] -> [I]
        return pre.clamp(min=0).square()
    # gated: [gate | up] halves, or interleaved rows gate_0, up_0, gate_1, up_1, ... (gpt-oss)
    gate, up = (pre[0::2], pre[1::2]) if act.interleaved else pre.chunk(2)
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "swigluoai":  # gpt-oss: alpha 1.702, limit 7; gate clamped from above, up both sides, plus 1
        assert (act.alpha, act.limit) == (1.702, 7.0)
        gate, up = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    raise AssertionError(act.kind)


def _intermediates64(x, w13, ids, bias=None, activation="silu") -> torch.Tensor:
    """float64 [M*k, I]: act(x[m] @ w13[e].T + bias[e]) of each (token, expert) pair, in pair order
    (act SwiGLU unless given)."""
    rows = []
    for m in range(x.shape[0]):
        for e in ids[m].tolist():
            pre = x[m].double() @ w13[e].double().T + (bias[e].double() if bias is not None else 0.0)
            rows.append(_act64(pre, activation))
    return torch.stack(rows)


def _reference(layer, x) -> torch.Tensor:
    """The layer's stored weights decoded in float64 (tests/decoders.py) and its routing, without
    activation quantization."""
    c, wq = layer.quant_config(), layer.scheme.weight
    w13 = decode_weight(layer.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero)
    w2 = decode_weight(layer.w2, wq, c.w2_scale, c.w2_global_scale, c.w2_zero)
    with torch.no_grad():
        tw, ti = layer.routing_for(x)
    return moe_ops.reference.moe_float64(x, w13, w2, tw, ti, activation=layer.activation)


def _act_scales(layer) -> tuple[torch.Tensor, torch.Tensor]:
    c = layer.quant_config()
    if layer.scheme.activation.dtype == "nvfp4":
        return c.a13_global_scale, c.a2_global_scale
    return c.a13_scale, c.a2_scale


# ---- expert_intermediates ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_expert_intermediates_against_float64(dtype, with_bias):
    g = generator(11)
    x = torch.randn(9, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)).to(dtype)
    bias = torch.randn(E, 2 * I, generator=g).to(dtype) if with_bias else None
    _, ids = moe_ops.route(torch.randn(9, E, generator=g), TOP_K)
    out = moe_ops.expert_intermediates(x, w13, ids, w13_bias=bias)
    assert out.shape == (9 * TOP_K, I) and out.dtype == torch.float32
    want = _intermediates64(x, w13, ids, bias)
    # grouped by expert: compare as multisets of rows, sorted by their first value
    order = lambda t: t[t[:, 0].argsort()]  # noqa: E731
    assert relative_error(order(out.double()), order(want)) <= 1e-6


_X, _W13, _IDS = torch.randn(3, H), torch.randn(E, 2 * I, H), torch.zeros(3, TOP_K, dtype=torch.int32)
# name -> (arguments changed from (_X, _W13, _IDS), exception, message). Before, an expert_map entry past
# E gave zero rows silently, list arguments raised AttributeError, an int hidden_states was accepted, and
# a bad bias or odd w13 was named "bias" or "x".
BAD_INTERMEDIATES = {
    "w13_width": (dict(w13=_W13[:, :, : H // 2]), ValueError,
                  r"w13: expected \[E, N, H=128\] for hidden_states \(3, 128\), got \(8, 128, 64\)"),
    "w13_odd_gated": (dict(w13=_W13[:, :-1]), ValueError, r"w13: activation 'silu' splits each expert's 127 rows into gate and up halves"),
    "ids_rows": (dict(topk_ids=torch.zeros(4, TOP_K, dtype=torch.int32)), ValueError, r"topk_ids: expected \[M=3, k\], got \(4, 2\)"),
    "w13_int8": (dict(w13=_W13.to(torch.int8)), TypeError, r"w13: dtype torch.int8 is not allowed"),
    "hidden_int": (dict(hidden_states=torch.ones(3, H, dtype=torch.long)), TypeError, r"hidden_states: dtype torch.int64 is not allowed"),
    "id_out_of_range": (dict(topk_ids=torch.full((3, TOP_K), E, dtype=torch.int32)), ValueError, r"topk_ids: value 8 is outside \[0, 8\)"),
    "map_entry_past_E": (dict(expert_map=torch.tensor([0, 1, 2, 9])), ValueError, r"expert_map: value 9 is outside \[-1, 8\)"),
    "map_list": (dict(expert_map=[0, 1]), TypeError, r"expert_map: expected a torch.Tensor, got list"),
    "bias_list": (dict(w13_bias=[0.0] * 64), TypeError, r"w13_bias: expected a torch.Tensor, got list"),
    "bias_shape": (dict(w13_bias=torch.zeros(E, 3)), ValueError, r"w13_bias: expected shape \(8, 128\) \(\[E, N\]\), got \(8, 3\)"),
}


@pytest.mark.parametrize("case", list(BAD_INTERMEDIATES))
def test_expert_intermediates_rejects_bad_args(case):
    changes, exc, match = BAD_INTERMEDIATES[case]
    args = {"hidden_states": _X, "w13": _W13, "topk_ids": _IDS, **changes}
    with pytest.raises(exc, match=match):
        moe_ops.expert_intermediates(args.pop("hidden_states"), args.pop("w13"), args.pop("topk_ids"), **args)


def test_expert_intermediates_with_an_expert_map():
    """Pairs whose expert lives on another rank (expert_map -1) give zero rows; the others as without."""
    emap = torch.tensor([1, -1, 0] + list(range(2, E)))  # 9 global ids onto 8 local experts, id 1 elsewhere
    ids = torch.tensor([[0, 1], [2, 3], [1, 4]], dtype=torch.int32)
    x, w13 = torch.randn(3, H), torch.randn(E, 2 * I, H)  # fresh per run (_X and _W13 are drawn once, at import)
    out = moe_ops.expert_intermediates(x, w13, ids, expert_map=emap)
    local = torch.where(ids == 1, -1, emap[ids.long()])
    want = [_intermediates64(x[m : m + 1], w13, local[m : m + 1, j : j + 1])[0] for m in range(3) for j in range(2) if local[m, j] >= 0]
    assert out.shape == (6, I)
    kept = out[out.abs().sum(dim=1) > 0]
    assert kept.shape[0] == len(want) == 4
    order = lambda t: t[t[:, 0].argsort()]  # noqa: E731
    assert relative_error(order(kept.double()), order(torch.stack(want))) <= 1e-6


# ---- FusedMoE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(STATIC))
def test_load_weights_calibrates_static_scales(name):
    """The scales come from the given hidden states (GEMM1) and from GEMM2's inputs of the pairs the
    layer's router picks for them, with the loaded weights as stored (dequantized, as forward and
    calibrate() read them; the float ones gave GEMM2's scale up to 12% off for mxfp4); the layer is then accurate on hidden states
    of that magnitude (20x the construction's samples)."""
    scheme = STATIC[name]
    layer = _layer(scheme)
    w13, w2 = _float_experts(seed=5)
    x = 20 * torch.randn(128, H, generator=generator(6))
    layer.load_weights({"w13": w13, "w2": w2}, calibration=x)
    top = RANGE[scheme.activation.dtype]
    _, ids = layer.routing_for(x)
    a13, a2 = _act_scales(layer)
    assert a13.shape == a2.shape == (1,) and a13.dtype == a2.dtype == torch.float32
    assert torch.allclose(a13.double(), x.double().abs().max() / top, rtol=1e-6)
    c, wq = layer.quant_config(), layer.scheme.weight
    d13 = decode_weight(layer.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero)  # as forward reads them
    assert torch.allclose(a2.double(), _intermediates64(x, d13, ids).abs().max() / top, rtol=1e-5)
    # Checked on the calibration tokens: fresh ones may pass their amax and clip, as static scales do.
    with torch.no_grad():
        out = layer(x)
    assert relative_error(out, _reference(layer, x)) <= BOUND[scheme.activation.dtype]


# case -> (activation, expert biases): GEMM2's inputs that are not SwiGLU of the pair's GEMM1 without biases.
ACTS = {
    "swigluoai_interleaved_bias": (moe_ops.Activation("swigluoai", interleaved=True), True),
    "relu2": (moe_ops.Activation("relu2"), False),
}


@pytest.mark.parametrize("name", list(STATIC))
@pytest.mark.parametrize("case", list(ACTS))
def test_calibration_follows_the_activation_and_biases(name, case):
    """GEMM2's static scale is the amax of GEMM2's true inputs over the format's range: the layer's
    activation (swigluoai on interleaved gate/up rows, or relu2 without a gate) of the routed pairs'
    x @ w13[e].T + w13_bias[e], recomputed here in float64 from the stored weights and biases, through
    load_weights(..., calibration=x) and calibrate(x); GEMM1's is x's amax over the range; the layer is
    then accurate on those tokens against float64 with the biases. Calibration that ignored the layer's
    activation (SwiGLU instead), its w13_bias, or the interleaving (gate and up read as halves) passed
    the suite: GEMM2's int8 scale came out up to 8x too large for swigluoai, 2.3x too small for relu2."""
    scheme = STATIC[name]
    act, with_bias = ACTS[case]
    layer = moe_ops.FusedMoE(E, TOP_K, H, I, activation=act, expert_bias=with_bias, quant_config=scheme, dtype=torch.float32)
    g = generator(20)
    n13 = layer.n13
    weights = {"w13": torch.randn(E, n13, H, generator=g) / math.sqrt(H), "w2": torch.randn(E, H, I, generator=g) / math.sqrt(I)}
    if with_bias:  # large enough that GEMM2's range depends on them
        weights |= {"w13_bias": 2 * torch.randn(E, n13, generator=g), "w2_bias": torch.randn(E, H, generator=g)}
    top = RANGE[scheme.activation.dtype]
    # swigluoai: on the first tokens some pair has gate and up past the clamp (7), so the amax is its
    # ceiling 8 * 7 * sigmoid(1.702 * 7), whichever rows are read as gate and up; on the second the clamp
    # bites on ~0.2% of gates only and the amax is one pair's, which reading gate and up as halves moves
    # by 20% (and SwiGLU by 12%, dropping the biases by 4x).
    samples = [4 * torch.randn(128, H, generator=g), torch.randn(96, H, generator=g)]
    for i, x in enumerate(samples):
        if i == 0:
            layer.load_weights(weights, calibration=x)
        else:
            layer.calibrate(x)
        a13, a2 = _act_scales(layer)
        assert torch.allclose(a13.double(), x.double().abs().max() / top, rtol=1e-6)
        c, wq = layer.quant_config(), layer.scheme.weight
        d13 = decode_weight(layer.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero)
        d2 = decode_weight(layer.w2, wq, c.w2_scale, c.w2_global_scale, c.w2_zero)
        with torch.no_grad():
            tw, ids = layer.routing_for(x)
            inter = _intermediates64(x, d13, ids, layer.w13_bias, activation=act)
        assert inter.shape == (x.shape[0] * TOP_K, I)
        assert torch.allclose(a2.double(), inter.abs().max() / top, rtol=1e-4), (a2.item(), inter.abs().max().item() / top)
        with torch.no_grad():
            out = layer(x)
            ref = moe_ops.reference.moe_float64(x, d13, d2, tw, ids, activation=act, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
        assert relative_error(out, ref) <= BOUND[scheme.activation.dtype]


def _state(layer) -> dict:
    return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).clone() for k, v in layer.state_dict().items()}


def _assert_unchanged(layer, before: dict):
    after = _state(layer)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} changed"


@pytest.mark.parametrize("name", list(STATIC))
def test_load_weights_without_calibration_is_rejected(name):
    """Any load into a static scheme (expert weights, or only the router: GEMM2's scale depends on the
    routing) needs samples; a missing, misshapen or non-finite calibration, or a non-finite weight,
    raises with nothing written, router included. All of these are refused by the up-front checks,
    before load_weights writes anything; a failure after it wrote the router and biases (its restore
    path) is test_failed_calibration_restores_the_router_and_biases's."""
    layer = _layer(STATIC[name])
    before = _state(layer)
    w13, w2 = _float_experts(seed=8)
    weights = {"w13": w13, "w2": w2, "gate.weight": torch.randn(E, H)}
    nan_x = torch.randn(4, H).index_fill_(1, torch.tensor([3]), float("nan"))
    inf_w13 = w13.clone().index_fill_(2, torch.tensor([0]), float("inf"))
    bad = [
        (weights, None, r"calibration: scheme .* has static activation scales, which must be calibrated"),
        ({"gate.weight": torch.randn(E, H)}, None, r"calibration: scheme .* has static activation scales"),
        (weights, torch.randn(5, H // 2), r"calibration: expected sample hidden states \[\.\.\., H=128\] .* got shape \(5, 64\)"),
        (weights, nan_x, r"calibration: holds NaN or inf"),
        # no token: an amax over nothing (without the check, a scale from an empty reduction)
        (weights, torch.randn(0, H), r"calibration: expected sample hidden states \[\.\.\., H=128\] with at least one token, got shape \(0, 128\)"),
        ({**weights, "w13": inf_w13}, torch.randn(4, H), r"weights\['w13'\]: holds NaN or inf"),
    ]
    for w, cal, match in bad:
        with pytest.raises(ValueError, match=match):
            layer.load_weights(w, calibration=cal)
        _assert_unchanged(layer, before)


@pytest.mark.parametrize("name", list(STATIC))
def test_failed_calibration_restores_the_router_and_biases(name):
    """load_weights writes the router and expert biases first (the scales are calibrated through them),
    then quantizes the expert weights and calibrates; a failure there must put them back. A finite
    calibration of 3e38 passes the up-front checks but overflows GEMM1 to inf, so calibrating fails
    after the router and biases were written: they come back bit-identical, the expert weights and
    scales untouched, and the layer computes as before. Nothing reached that restore before (the inf
    weight of test_load_weights_without_calibration_is_rejected is refused up front): replacing it
    with `pass` left the new router and biases in a layer whose scales were calibrated without them."""
    layer = moe_ops.FusedMoE(E, TOP_K, H, I, expert_bias=True, quant_config=STATIC[name], dtype=torch.float32)
    g = generator(21)
    x = torch.randn(16, H, generator=g)
    layer.load_weights({"w13_bias": torch.randn(E, 2 * I, generator=g), "w2_bias": torch.randn(E, H, generator=g)}, calibration=x)
    before = _state(layer)
    with torch.no_grad():
        out_before = layer(x)
    w13, w2 = _float_experts(seed=22)
    weights = {
        "gate.weight": torch.randn(E, H, generator=g), "w13": w13, "w2": w2,
        "w13_bias": torch.randn(E, 2 * I, generator=g), "w2_bias": torch.randn(E, H, generator=g),
    }  # fmt: skip
    for k in ("gate.weight", "w13_bias", "w2_bias"):  # each differs from what the layer holds
        assert not torch.equal(weights[k], before[k.replace("gate.", "router.")])
    with pytest.raises(ValueError, match=r"calibration: holds NaN or inf in GEMM2's inputs computed from it \(GEMM1 of these samples overflows\)"):
        layer.load_weights(weights, calibration=torch.full((4, H), 3e38))
    _assert_unchanged(layer, before)
    with torch.no_grad():
        assert torch.equal(layer(x), out_before)


@pytest.mark.parametrize("name", list(STATIC))
def test_router_only_load_recalibrates(name):
    """A new router changes which experts' outputs GEMM2 reads: loading it recalibrates GEMM2's scale
    (calibration was ignored before, leaving the old routing's scales)."""
    layer = _layer(STATIC[name])
    x = torch.randn(64, H, generator=generator(15))
    router = torch.randn(E, H, generator=generator(16))
    layer.load_weights({"gate.weight": router}, calibration=x)
    assert torch.equal(layer.router.weight, router)
    expected = _layer(STATIC[name])
    expected.load_state_dict(layer.state_dict())
    expected.calibrate(x)
    for got, want in zip(_act_scales(layer), _act_scales(expected)):
        assert torch.equal(got, want)


def test_calibration_is_refused_for_a_scheme_without_static_scales():
    layer = _layer(DYNAMIC)
    with pytest.raises(ValueError, match=r"calibration: scheme fp8_w8a8_per_token .* has no static activation scales to calibrate"):
        layer.load_weights({"gate.weight": torch.randn(E, H)}, calibration=torch.randn(4, H))


def test_calibrate_rejects_non_finite_samples():
    layer = _layer(STATIC["fp8_per_tensor_static"])
    before = _state(layer)
    # Named for the samples themselves, before the router sees them: the later check on GEMM2's inputs
    # would also fire, blaming an overflow in GEMM1 that never happened.
    with pytest.raises(ValueError, match=r"^calibration: holds NaN or inf; static activation scales calibrated on it would be NaN/inf$"):
        layer.calibrate(torch.full((2, H), float("inf")))
    _assert_unchanged(layer, before)


def test_calibration_on_meta_is_refused():
    """Meta samples hold no values to calibrate on: named, rather than torch's copy-out-of-meta error."""
    layer = _layer(STATIC["fp8_per_tensor_static"])
    before = _state(layer)
    with pytest.raises(ValueError, match=r"^calibration: on meta, which holds no values; the layer is on cpu$"):
        layer.calibrate(torch.randn(4, H, device="meta"))
    _assert_unchanged(layer, before)


@pytest.mark.parametrize("name", list(STATIC))
def test_calibration_samples_in_another_dtype_are_converted(name):
    """Samples in float32 for a bf16 layer are taken in the layer's dtype, as forward would see them:
    the scales equal those of the same samples converted first (without the conversion the router's
    bf16 Linear refused float32 input)."""
    layer = moe_ops.FusedMoE(E, TOP_K, H, I, quant_config=STATIC[name], dtype=torch.bfloat16)
    x = 5 * torch.randn(64, H, generator=generator(21))
    layer.calibrate(x)
    from_float = [t.clone() for t in _act_scales(layer)]
    layer.calibrate(x.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(from_float, _act_scales(layer)))
    layer.calibrate(x.double())  # float64 samples too, as quantize_weights takes them (they were refused here)
    assert all(torch.equal(a, b) for a, b in zip(from_float, _act_scales(layer)))


@pytest.mark.parametrize("name", list(STATIC))
def test_calibrate_sets_the_scales_for_new_hidden_states(name):
    """calibrate(x) re-calibrates the current weights for hidden states of another magnitude: the
    scales are then x's (and GEMM2's inputs') amax, and the output accurate."""
    scheme = STATIC[name]
    layer = _layer(scheme)
    w13, w2 = _float_experts(seed=9)
    layer.load_weights({"w13": w13, "w2": w2}, calibration=torch.randn(32, H, generator=generator(10)))
    x = 40 * torch.randn(128, H, generator=generator(12))
    layer.calibrate(x.reshape(4, 32, H))  # any leading shape
    a13, a2 = _act_scales(layer)
    top = RANGE[scheme.activation.dtype]
    assert torch.allclose(a13.double(), x.double().abs().max() / top, rtol=1e-6)
    _, ids = layer.routing_for(x)
    c, wq = layer.quant_config(), layer.scheme.weight
    d13 = decode_weight(layer.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero)  # calibrate reads the stored weights
    assert torch.allclose(a2.double(), _intermediates64(x, d13, ids).abs().max() / top, rtol=1e-5)
    with torch.no_grad():
        out = layer(x)
    assert relative_error(out, _reference(layer, x)) <= BOUND[scheme.activation.dtype]


def test_calibrate_needs_a_static_scheme():
    with pytest.raises(ValueError, match=r"calibrate: scheme fp8_w8a8_per_token .* has no static activation scales"):
        _layer(DYNAMIC).calibrate(torch.randn(4, H))
    with pytest.raises(ValueError, match=r"calibrate: scheme unquantized .* has no static activation scales"):
        _layer(None).calibrate(torch.randn(4, H))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(STATIC))
def test_calibration_on_cuda_matches_the_cpu(name):
    """The same layer, weights and samples calibrate to the same scales on CUDA (the routing plan's
    Triton kernel, the CUDA grouped GEMM) as on the CPU, and the CUDA layer is as accurate."""
    scheme = STATIC[name]
    cpu = _layer(scheme)
    gpu = _layer(scheme).cuda()
    with torch.no_grad():
        gpu.router.weight.copy_(cpu.router.weight)
    w13, w2 = _float_experts(seed=13)
    x = 20 * torch.randn(128, H, generator=generator(14))
    cpu.load_weights({"w13": w13, "w2": w2}, calibration=x)
    gpu.load_weights({"w13": w13, "w2": w2}, calibration=x.cuda())
    for c, g in zip(_act_scales(cpu), _act_scales(gpu)):
        assert g.is_cuda and torch.allclose(g.cpu(), c, rtol=1e-5)
    gpu.calibrate(x.cuda())
    cpu.calibrate(x)
    for c, g in zip(_act_scales(cpu), _act_scales(gpu)):
        assert torch.allclose(g.cpu(), c, rtol=1e-5)
    with torch.no_grad():
        out = gpu(x.cuda())
    # tests/decoders.py decodes on the CPU: the reference reads a CPU copy of the calibrated CUDA layer
    assert relative_error(out, _reference(copy.deepcopy(gpu).cpu(), x)) <= BOUND[scheme.activation.dtype]


def test_load_weights_and_calibrate_agree():
    """Both calibrate GEMM2 on the stored weights; load_weights used the float ones before quantizing,
    12% off calibrate()'s scale for mxfp4 weights (the fp8 activations then clipped)."""
    scheme = QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("mxfp4", GroupShape(1, 32)))
    layer = _layer(scheme)
    x = torch.randn(40, H, generator=generator(17))
    layer.load_weights({"w13": torch.randn(E, 2 * I, H, generator=generator(18))}, calibration=x)
    loaded = [t.clone() for t in _act_scales(layer)]
    layer.calibrate(x)
    for got, want in zip(loaded, _act_scales(layer)):
        assert torch.allclose(got, want, rtol=1e-6)


def test_empty_load_with_calibration_calibrates():
    """load_weights({}, calibration=x) did nothing on a static scheme; now it calibrates, as calibrate(x)."""
    layer = _layer(STATIC["fp8_per_tensor_static"])
    x = 5 * torch.randn(16, H, generator=generator(19))
    layer.load_weights({}, calibration=x)
    assert torch.allclose(layer.a13_scale.double(), x.double().abs().max() / RANGE["fp8"], rtol=1e-6)


@pytest.mark.parametrize("name", list(STATIC))
def test_all_zero_calibration_keeps_a_positive_scale(name):
    """Samples that are all zero (say, padding tokens only) have an amax of 0; a scale of 0 would divide
    every later token by zero (NaN or inf outputs everywhere). The amax is floored at 1e-6 instead, so
    the scale is positive, zero tokens still give exact zeros and other tokens saturate finitely (int8,
    with no subnormals, then rounds GEMM2's tiny inputs to 0)."""
    scheme = STATIC[name]
    layer = _layer(scheme)
    w13, w2 = _float_experts(seed=31)
    layer.load_weights({"w13": w13, "w2": w2}, calibration=torch.zeros(4, H))
    for scale in _act_scales(layer):
        assert torch.equal(scale, torch.full((1,), 1e-6 / RANGE[scheme.activation.dtype]))
    x = torch.randn(6, H, generator=generator(32))
    x[0] = 0
    with torch.no_grad():
        out = layer(x)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(H))
