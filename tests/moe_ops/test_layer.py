"""FusedMoE: forward against the float64 re-computation, load_weights from every checkpoint naming it
accepts, quantization on load, DeepSeek-style routing options, expert biases and relu2."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import moe_ops
from moe_ops import quant
from moe_ops.quant import ActivationQuant, GroupShape, QuantScheme, WeightQuant
from moe_ops.quant import formats
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..decoders import decode_weight
from ..host_reads import no_host_reads
from ..seeds import generator

E, TOP_K, H, I = 8, 2, 64, 32
F32_TOL = tolerance(torch.float32)


def _layer(**kwargs) -> moe_ops.FusedMoE:
    args = dict(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, dtype=torch.float32)
    return moe_ops.FusedMoE(**{**args, **kwargs})


def _decoded(layer: moe_ops.FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's stored weights decoded in float64 by tests/decoders.py, not by the layer's own
    float_weights(): w13 [E, n13, H], w2 [E, H, I]."""
    c, wq = layer.quant_config(), layer.scheme.weight
    return (
        decode_weight(layer.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero),
        decode_weight(layer.w2, wq, c.w2_scale, c.w2_global_scale, c.w2_zero),
    )


def _reference(layer: moe_ops.FusedMoE, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """moe_float64 of the layer's stored weights (independently decoded) and routing, for x [..., H]."""
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        tw, ti = layer.routing_for(x2)
        w13, w2 = _decoded(layer)
    ref = moe_float64(
        x2, w13, w2, tw, ti, activation=layer.activation, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, **kwargs
    )
    return ref.reshape(x.shape)


def _forward(layer, x):
    with torch.no_grad():
        return layer(x)


def _expert_tensors(num=E, n13_parts=("gate", "up"), seed=0):
    """Per-expert float tensors: {part: [tensor of expert e]}."""
    g = generator(seed)
    out = {p: [torch.randn(I, H, generator=g) / math.sqrt(H) for _ in range(num)] for p in n13_parts}
    out["down"] = [torch.randn(H, I, generator=g) / math.sqrt(I) for _ in range(num)]
    return out


def _stacked(parts, n13_parts=("gate", "up")):
    w13 = torch.stack([torch.cat([parts[p][e] for p in n13_parts]) for e in range(len(parts["down"]))])
    w2 = torch.stack(parts["down"])
    return w13, w2


# ---- forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(activation="gelu"),
        dict(activation="gelu_tanh", renormalize=False),
        dict(activation=moe_ops.Activation("swigluoai", interleaved=True)),
        dict(scoring="sigmoid", renormalize=False, top_k=1),
        dict(top_k=E),
        # DeepSeek-V4's recipe: sqrt(softplus) scores with a correction bias, its clamped SwiGLU
        dict(scoring="sqrtsoftplus", correction_bias=True, routed_scaling_factor=1.5,
             activation=moe_ops.Activation("silu_clamped", limit=0.5)),
    ],
    ids=["silu", "gelu", "gelu_tanh_norenorm", "swigluoai_interleaved", "sigmoid_top1", "top_k_eq_E", "deepseek_v4"],
)
def test_forward_matches_float64(kwargs):
    layer = _layer(**kwargs)
    x = torch.randn(3, 5, H)  # any leading shape
    out = _forward(layer, x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert relative_error(out, _reference(layer, x)) <= F32_TOL


def test_forward_reads_no_values_on_the_host():
    """A layer's ids come from its own route(), in range by construction: an eager forward skips
    fused_experts' id check, the one value check that would read them back (a host sync on a GPU),
    while a direct fused_experts call with the same ids still makes it."""
    layer = _layer()
    x = torch.randn(5, H)
    with torch.no_grad():
        want = _forward(layer, x)
        with no_host_reads():
            got = _forward(layer, x)
        assert torch.equal(got, want)
        tw, ids = layer.routing_for(x)
        with no_host_reads(), pytest.raises(AssertionError, match="host sync"):
            moe_ops.fused_experts(x, layer.w13, layer.w2, tw, ids)


def test_forward_zero_tokens():
    layer = _layer()
    assert _forward(layer, torch.randn(0, H)).shape == (0, H)


def test_forward_bf16_layer():
    layer = _layer(dtype=torch.bfloat16)
    assert layer.w13.dtype == torch.bfloat16 and layer.router.weight.dtype == torch.bfloat16
    x = torch.randn(17, H).bfloat16()
    out = _forward(layer, x)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, _reference(layer, x, intermediate_dtype=torch.bfloat16)) <= tolerance(torch.bfloat16)


def test_expert_bias():
    layer = _layer(expert_bias=True)
    assert layer.w13_bias.shape == (E, 2 * I) and layer.w2_bias.shape == (E, H)
    with torch.no_grad():
        layer.w13_bias.normal_()
        layer.w2_bias.normal_()
    x = torch.randn(11, H)
    out = _forward(layer, x)
    assert relative_error(out, _reference(layer, x)) <= F32_TOL
    # the biases matter: without them the reference differs
    tw, ti = layer.routing_for(x)
    no_bias = moe_float64(x, *layer.float_weights(), tw, ti)
    assert relative_error(out, no_bias) > 1e-2


def test_relu2_has_no_gate():
    layer = _layer(activation="relu2")
    assert layer.w13.shape == (E, I, H)  # no gate: I rows
    parts = _expert_tensors(n13_parts=("up",))
    names = {}
    for e in range(E):
        names[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = parts["up"][e]
        names[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = parts["down"][e]
    layer.load_weights(names)
    w13, w2 = layer.float_weights()
    assert torch.equal(w13, torch.stack(parts["up"])) and torch.equal(w2, torch.stack(parts["down"]))
    x = torch.randn(9, H)
    out = _forward(layer, x)
    assert relative_error(out, _reference(layer, x)) <= F32_TOL
    tw, ti = layer.routing_for(x)
    relu2_ref = moe_float64(x, w13, w2, tw, ti, activation="relu2")
    assert relative_error(out, relu2_ref) <= F32_TOL
    # stacked [E, I, H] too
    layer.load_weights({"w13": 2 * torch.stack(parts["up"]), "w2": torch.stack(parts["down"])})
    assert torch.equal(layer.float_weights()[0], 2 * torch.stack(parts["up"]))


# ---- DeepSeek-style routing ----------------------------------------------------------------------


def _deepseek_v3_route(logits, bias, top_k, groups, topk_group, scale):
    """An independent float64 DeepSeek-V3 router: returns {token: {expert: weight}}."""
    scores = torch.sigmoid(logits.double())
    sel = scores + bias.double()
    m, e = logits.shape
    per_group = e // groups
    group_score = sel.view(m, groups, per_group).topk(2, dim=-1).values.sum(-1)
    out = []
    for r in range(m):
        kept = group_score[r].topk(topk_group).indices.tolist()
        allowed = [x for g in kept for x in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda x: -sel[r, x].item())[:top_k]
        w = scores[r, chosen]
        w = w / w.sum() * scale
        out.append(dict(zip(chosen, w.tolist())))
    return out


def test_deepseek_style_routing():
    layer = _layer(
        top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True, routed_scaling_factor=2.5
    )
    assert layer.e_score_correction_bias.shape == (E,)
    bias = torch.linspace(-0.3, 0.3, E)
    layer.load_weights({"model.layers.3.mlp.gate.e_score_correction_bias": bias, "model.layers.3.mlp.gate.weight": torch.randn(E, H)})
    assert torch.equal(layer.e_score_correction_bias, bias)
    x = torch.randn(40, H)
    tw, ti = layer.routing_for(x)
    with torch.no_grad():
        logits = layer.router(x)
    expected = _deepseek_v3_route(logits, bias, 3, 4, 2, 2.5)
    for r in range(x.shape[0]):
        got = dict(zip(ti[r].tolist(), tw[r].tolist()))
        assert set(got) == set(expected[r]), r
        for k, v in expected[r].items():
            assert math.isclose(got[k], v, rel_tol=1e-5), (r, k)
        assert len({k // 2 for k in got}) <= 2  # at most topk_group groups of 2 experts
    assert torch.allclose(tw.sum(-1), torch.full((x.shape[0],), 2.5))
    out = _forward(layer, x)
    assert relative_error(out, _reference(layer, x)) <= F32_TOL


@pytest.mark.parametrize("convert", ["to_bf16", "half"])
def test_dtype_conversion_keeps_the_correction_bias_float32(convert):
    """layer.to(bf16) / .half() route as a layer built in that dtype: the correction bias stays float32
    (transformers keeps it so too). It was rounded to bf16, which moved tokens to other experts."""
    kwargs = dict(top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True)
    dtype = torch.bfloat16 if convert == "to_bf16" else torch.float16
    bias = 1.0 + 0.05 * torch.randn(E)  # around 1, as trained biases are: bf16 keeps 8 bits of it
    weights = {"e_score_correction_bias": bias, "gate.weight": torch.randn(E, H)}
    built = _layer(**{**kwargs, "dtype": dtype})
    built.load_weights(weights)
    converted = _layer(**kwargs)
    converted.load_weights(weights)
    converted = converted.to(torch.bfloat16) if convert == "to_bf16" else converted.half()
    assert converted.e_score_correction_bias.dtype == built.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(converted.e_score_correction_bias, bias) and converted.router.weight.dtype == dtype
    x = torch.randn(256, H, dtype=dtype)
    assert torch.equal(converted.routing_for(x)[1], built.routing_for(x)[1])


def test_correction_bias_steers_selection_only():
    layer = _layer(scoring="sigmoid", correction_bias=True, num_expert_group=4, topk_group=2)
    bias = torch.zeros(E)
    bias[5] = 100.0  # expert 5 is always chosen ...
    layer.load_weights({"e_score_correction_bias": bias})
    x = torch.randn(16, H)
    tw, ti = layer.routing_for(x)
    assert (ti == 5).any(dim=1).all()
    with torch.no_grad():
        scores = torch.sigmoid(layer.router(x).float())
    # ... but its weight comes from its unbiased score (renormalized), not from the bias
    pos = (ti == 5).float().argmax(dim=1)
    w5 = tw[torch.arange(16), pos]
    expected = scores[:, 5] / scores.gather(1, ti.long()).sum(1)
    assert torch.allclose(w5, expected, rtol=1e-5)


def test_routed_scaling_factor_scales_output():
    a = _layer(routed_scaling_factor=1.0)
    b = _layer(routed_scaling_factor=3.0)
    b.load_state_dict(a.state_dict())
    x = torch.randn(10, H)
    assert relative_error(_forward(b, x), 3.0 * _forward(a, x).double()) <= F32_TOL
    assert relative_error(_forward(b, x), _reference(b, x)) <= F32_TOL


# ---- load_weights --------------------------------------------------------------------------------


def _assert_load_rejected(layer, weights, match):
    """load_weights raises a ValueError matching `match` and leaves both expert weights as they were."""
    before = [t.clone() for t in layer.float_weights()]
    with pytest.raises(ValueError, match=match):
        layer.load_weights(weights)
    after = layer.float_weights()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize(
    "naming",
    [
        ("model.layers.0.mlp.experts.{e}.{p}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
        ("model.layers.0.block_sparse_moe.experts.{e}.{p}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
        ("experts.{e}.{p}.weight", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    ],
    ids=["hf_proj_names", "mixtral_w1_w3_w2", "no_prefix"],
)
@pytest.mark.parametrize("as_iterable", [False, True], ids=["mapping", "iterable"])
def test_load_per_expert(naming, as_iterable):
    template, part_names = naming
    parts = _expert_tensors()
    weights = {
        template.format(e=e, p=part_names[p]): parts[p][e] for e in reversed(range(E)) for p in ("down", "up", "gate")
    }
    router = torch.randn(E, H)
    router_name = template.split("experts")[0] + "gate.weight"
    weights[router_name] = router
    layer = _layer()
    layer.load_weights(iter(weights.items()) if as_iterable else weights)
    w13, w2 = layer.float_weights()
    e13, e2 = _stacked(parts)
    assert torch.equal(w13, e13)  # [gate; up] per expert, in expert order
    assert torch.equal(w2, e2)
    assert torch.equal(layer.router.weight, router)
    x = torch.randn(12, H)
    tw, ti = moe_ops.route(x @ router.T, TOP_K)
    assert relative_error(_forward(layer, x), moe_float64(x, e13, e2, tw, ti)) <= F32_TOL


@pytest.mark.parametrize(
    "names",
    [("w13", "w2"), ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"), ("mlp.w13", "mlp.w2")],
    ids=["moe_ops_names", "transformers_fused", "prefixed_moe_ops"],
)
def test_load_stacked(names):
    e13, e2 = _stacked(_expert_tensors(seed=1))
    layer = _layer()
    layer.load_weights({names[0]: e13, names[1]: e2, "router.weight": torch.randn(E, H)})
    w13, w2 = layer.float_weights()
    assert torch.equal(w13, e13) and torch.equal(w2, e2)
    x = torch.randn(6, H)
    assert relative_error(_forward(layer, x), _reference(layer, x)) <= F32_TOL


def test_load_stacked_transposed():
    """transposed=True reads transformers' is_transposed experts (gpt-oss): gate_up_proj [E, H, 2I],
    down_proj [E, I, H]. With I == H the two layouts of down_proj have one shape, and a transposed one
    loaded silently as [E, H, I]; the layout is now said, not guessed."""
    e13, e2 = _stacked(_expert_tensors(seed=3))
    layer = _layer()
    layer.load_weights({"experts.gate_up_proj": e13.transpose(1, 2).contiguous(), "experts.down_proj": e2.transpose(1, 2).contiguous()},
                       transposed=True)  # fmt: skip
    w13, w2 = layer.float_weights()
    assert torch.equal(w13, e13) and torch.equal(w2, e2)
    square = _layer(intermediate_size=H)  # I == H: shapes cannot tell the layouts apart
    down = torch.randn(E, H, H)
    square.load_weights({"experts.down_proj": down}, transposed=True)
    assert torch.equal(square.float_weights()[1], down.transpose(1, 2))
    square.load_weights({"experts.down_proj": down})
    assert torch.equal(square.float_weights()[1], down)
    with pytest.raises(ValueError, match=r"weights\[w13\]: expected shape \(8, 64, 64\), got \(8, 65, 64\)"):
        layer.load_weights({"w13": torch.zeros(E, 2 * I + 1, H)}, transposed=True)
    with pytest.raises(ValueError, match=r"weights\[w2\]: expected shape \(8, 32, 64\), got \(8, 64, 32\) \(the untransposed layout: pass transposed=False\)"):
        layer.load_weights({"w2": torch.zeros(E, H, I)}, transposed=True)
    with pytest.raises(TypeError, match=r"transposed: expected a bool, got str 'yes'"):
        layer.load_weights({}, transposed="yes")


def test_transposed_leaves_per_expert_weights_as_they_are():
    """transposed=True concerns stacked tensors only: per-expert weights are [out, in] (nn.Linear) in
    every checkpoint, and are not flipped with it (I == H, where a flip would pass the shape check)."""
    layer = _layer(intermediate_size=H)
    parts = {p: torch.randn(E, H, H) for p in ("gate_proj", "up_proj", "down_proj")}
    layer.load_weights({f"experts.{e}.{p}.weight": parts[p][e] for p in parts for e in range(E)}, transposed=True)
    w13, w2 = layer.float_weights()
    assert torch.equal(w2, parts["down_proj"]) and torch.equal(w13, torch.cat((parts["gate_proj"], parts["up_proj"]), dim=1))


def test_load_only_some_tensors_keeps_the_rest():
    layer = _layer()
    old13, _ = layer.float_weights()
    old_router = layer.router.weight.clone()
    new2 = torch.randn(E, H, I)
    layer.load_weights({"experts.down_proj": new2})
    w13, w2 = layer.float_weights()
    assert torch.equal(w13, old13) and torch.equal(w2, new2)
    assert torch.equal(layer.router.weight, old_router)
    layer.load_weights({"gate.weight": torch.zeros(E, H)})
    assert torch.equal(layer.router.weight, torch.zeros(E, H))
    assert torch.equal(layer.float_weights()[1], new2)


def test_load_converts_to_layer_dtype():
    layer = _layer(dtype=torch.bfloat16)
    e13, e2 = _stacked(_expert_tensors(seed=2))
    layer.load_weights({"w13": e13, "w2": e2.double()})
    assert layer.w13.dtype == torch.bfloat16 and layer.w2.dtype == torch.bfloat16
    assert torch.equal(layer.w13, e13.bfloat16())


@pytest.mark.parametrize(
    "drop, match",
    [
        ({("gate", 3)}, r"weights: gate projection missing for experts \[3\]"),
        ({("up", 0), ("up", 5)}, r"weights: up projection missing for experts \[0, 5\]"),
        ({("down", e) for e in range(1, E)}, r"weights: down projection missing for experts \[1, 2, 3, 4, 5, 6, 7\]"),
    ],
    ids=["gate_3", "up_0_5", "down_all_but_0"],
)
def test_load_missing_expert_raises(drop, match):
    parts = _expert_tensors()
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    weights = {f"experts.{e}.{names[p]}.weight": parts[p][e] for p in parts for e in range(E) if (p, e) not in drop}
    _assert_load_rejected(_layer(), weights, match)


def test_load_missing_expert_list_is_truncated():
    layer = _layer(num_experts=12)
    with pytest.raises(ValueError, match=r"gate projection missing for experts \[1, 2, 3, 4, 5, 6, 7, 8\]\.\.\."):
        layer.load_weights({"experts.0.gate_proj.weight": torch.randn(I, H), "experts.0.up_proj.weight": torch.randn(I, H)})


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.shared_expert.down_proj.weight",
        "model.layers.0.mlp.shared_experts.0.gate_proj.weight",  # not routed expert 0: "experts" is a whole name part
        "model.layers.0.mlp.fc_w2",  # not the stacked w2: a stacked name is a whole name part too
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.experts.0.gate_proj.scale",
        "model.layers.0.mlp.experts.x.up_proj.weight",
        "e_score_correction_bias",  # the layer has no correction bias
        "w13_scale",
        "gate",
    ],
)
def test_load_unknown_name_raises(name):
    layer = _layer()
    with pytest.raises(ValueError, match=rf"weights: unknown name {name!r}; expected per-expert, stacked or router names"):
        layer.load_weights({name: torch.zeros(3)})


def test_correction_bias_name_is_a_whole_name_part():
    """A layer with a correction bias takes "...e_score_correction_bias", not a longer name ending so."""
    layer = _layer(scoring="sigmoid", correction_bias=True)
    name = "model.layers.0.mlp.gate.my_e_score_correction_bias"
    with pytest.raises(ValueError, match=rf"weights: unknown name {name!r}"):
        layer.load_weights({name: torch.zeros(E)})


@pytest.mark.parametrize(
    "weights, match",
    [
        ({"w13": torch.zeros(E, 2 * I + 1, H)}, r"weights\[w13\]: expected shape \(8, 64, 64\), got \(8, 65, 64\)"),
        ({"w2": torch.zeros(E, I, H)}, r"weights\[w2\]: expected shape \(8, 64, 32\), got \(8, 32, 64\) \(the transposed layout: pass transposed=True\)"),
        ({"experts.gate_up_proj": torch.zeros(E - 1, 2 * I, H)}, r"weights\[w13\]: expected shape \(8, 64, 64\), got \(7, 64, 64\)"),
        ({"gate.weight": torch.zeros(E, H + 1)}, r"weights\['gate.weight'\]: expected shape \(8, 64\), got \(8, 65\)"),
        ({"router.weight": torch.zeros(H, E)}, r"weights\['router.weight'\]: expected shape \(8, 64\), got \(64, 8\)"),
        (
            {f"experts.{e}.{p}.weight": torch.zeros(I, H) for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")},
            r"weights\['experts\.\d+\.down_proj\.weight'\]: expected shape \(64, 32\), got \(32, 64\)",
        ),
    ],
    ids=["w13_rows", "w2_transposed", "gate_up_proj_E", "router_cols", "router_transposed", "per_expert_down_transposed"],
)
def test_load_wrong_shape_raises(weights, match):
    _assert_load_rejected(_layer(), weights, match)


def test_load_correction_bias_wrong_shape_raises():
    layer = _layer(scoring="sigmoid", correction_bias=True)
    with pytest.raises(ValueError, match=r"weights\['gate.e_score_correction_bias'\]: expected shape \(8,\), got \(9,\)"):
        layer.load_weights({"gate.e_score_correction_bias": torch.zeros(E + 1)})


@pytest.mark.parametrize(
    "bad",
    [
        {"experts.0.gate_proj.weight": torch.zeros(I, H)},
        {"w13": torch.zeros(E, 2 * I + 1, H)},
        {"not.a.weight": torch.zeros(1)},
    ],
    ids=["missing_experts", "wrong_shape", "unknown_name_after_router"],
)
def test_failed_load_leaves_router_untouched(bad):
    layer = _layer()
    router = layer.router.weight.clone()
    with pytest.raises(ValueError):
        layer.load_weights({"gate.weight": torch.zeros(E, H), **bad})
    assert torch.equal(layer.router.weight, router)


@pytest.mark.parametrize("case", ["extra_experts", "expert_E", "relu2_gate", "stacked_and_per_expert"])
def test_load_rejects_unused_tensors(case):
    parts = _expert_tensors(num=E + 2)
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if case in ("extra_experts", "expert_E"):
        # expert_E: one past the last expert exactly (an off-by-one, expert > E, let it through)
        count = E + 2 if case == "extra_experts" else E + 1
        layer, weights = _layer(), {f"experts.{e}.{names[p]}.weight": parts[p][e] for p in parts for e in range(count)}
        with pytest.raises(ValueError, match=rf"weights\['experts\.{E}\.\w+\.weight'\]: expert {E} >= num_experts={E}"):
            layer.load_weights(weights)
        return
    elif case == "relu2_gate":
        layer = _layer(activation="relu2")
        weights = {f"experts.{e}.{names[p]}.weight": parts[p][e] for p in parts for e in range(E)}
        match = r"weights\['experts\.\d+\.gate_proj\.weight'\]: activation 'relu2' has no gate projection"
    else:
        layer = _layer()
        weights = {f"experts.{e}.{names[p]}.weight": parts[p][e] for p in parts for e in range(E)}
        weights["w13"] = torch.zeros(E, 2 * I, H)
        match = r"weights: w13 weight given both stacked \('w13'\) and per expert; give one"
    with pytest.raises(ValueError, match=match):
        layer.load_weights(weights)


def test_load_one_expert_wrong_shape_raises_value_error():
    parts = _expert_tensors()
    parts["gate"][2] = torch.zeros(I + 1, H)
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    with pytest.raises(ValueError, match=rf"weights\['experts\.2\.gate_proj\.weight'\]: expected shape \({I}, {H}\), got \({I + 1}, {H}\)"):
        _layer().load_weights({f"experts.{e}.{names[p]}.weight": parts[p][e] for p in parts for e in range(E)})


def test_load_router_bias_without_bias_raises_value_error():
    with pytest.raises(ValueError, match=r"gate.bias"):
        _layer().load_weights({"gate.bias": torch.zeros(E)})


# ---- quantized layers: quantize on load ----------------------------------------------------------

FP8_BLOCK = QuantScheme(ActivationQuant("fp8", GroupShape(1, 32)), WeightQuant("fp8", GroupShape(32, 32)))
INT4 = QuantScheme(None, WeightQuant("int4", GroupShape(1, 32)))
INT4_ZP = QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True))


@pytest.mark.parametrize("scheme", [FP8_BLOCK, INT4, INT4_ZP], ids=["fp8_block", "int4", "int4_zero_point"])
def test_quantized_layer_quantizes_on_load(scheme):
    layer = _layer(quant_config=scheme)
    wq = scheme.weight
    assert layer.w13.dtype == wq.storage and layer.w13.shape == (E, 2 * I, H // wq.packing)
    old13, _ = layer.float_weights()
    parts = _expert_tensors(seed=3)
    e13, e2 = _stacked(parts)
    layer.load_weights({f"experts.{e}.{n}.weight": parts[p][e] for e in range(E) for p, n in
                        (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))})  # fmt: skip
    assert layer.w13.dtype == wq.storage and layer.w2.dtype == wq.storage
    w13, w2 = _decoded(layer)
    assert torch.equal(w13.float(), layer.float_weights()[0]) and torch.equal(w2.float(), layer.float_weights()[1])
    # exactly the reference quantizer's encoding of what was loaded ...
    r13, r2, cfg = quant.quantize_weights(scheme, e13, e2, calibration=torch.randn(4, H), intermediate_calibration=torch.randn(4, I))
    assert torch.equal(layer.w13, r13) and torch.equal(layer.w2, r2)
    assert torch.equal(layer.w13_scale, cfg.w13_scale) and torch.equal(layer.w2_scale, cfg.w2_scale)
    # ... which is close to it: each element within what its format can represent
    for deq, w, q, scale in ((w13, e13, layer.w13, layer.w13_scale), (w2, e2, layer.w2, layer.w2_scale)):
        full = formats.expand_groups(scale.float(), wq.group.astuple(), *w.shape[-2:])
        err = (deq - w).abs()
        if wq.dtype == "fp8":  # e4m3: half an ulp is 1/16 relative (normals), 2**-10 * scale (subnormals)
            assert (err <= w.abs() / 16 + full * 2.0**-10 + 1e-7).all()
        else:  # int4: at most half a step (scale) away, inside the group's range
            assert (err <= full / 2 * (1 + 1e-5) + 1e-7).all()
    assert relative_error(w13, e13) < relative_error(old13, e13) / 5  # the loaded weights, not the old ones
    x = torch.randn(20, H)
    aq = scheme.activation.dtype if scheme.activation is not None else None
    assert relative_error(_forward(layer, x), _reference(layer, x)) <= tolerance(torch.float32, aq)


def test_quantized_layer_buffers_follow_the_scheme():
    layer = _layer(quant_config=INT4_ZP)
    names = dict(layer.named_buffers())
    assert names["w13_zero"].dtype == torch.uint8 and names["w13_zero"].shape == (E, 2 * I, H // 32)
    assert names["w13_scale"].shape == (E, 2 * I, H // 32)
    assert layer.quant_config().scheme == INT4_ZP
    plain = _layer()
    assert plain.quant_config().scheme == quant.UNQUANTIZED
    assert isinstance(plain.w13, torch.nn.Parameter) and not plain.w13.requires_grad


# ---- dtype conversion and device moves -----------------------------------------------------------

FP8_W8A16 = QuantScheme(None, WeightQuant("fp8", GroupShape(1, -1)))
NVFP4 = QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16)))
NVFP4_W4A4 = QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "convert, dtype",
    [(lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half(), torch.float16)],
    ids=["to_bf16", "half"],
)
@pytest.mark.parametrize(
    "scheme", [FP8_W8A16, INT4_ZP, NVFP4, NVFP4_W4A4], ids=["fp8_w8a16", "int4_zero_point", "nvfp4_w4a16", "nvfp4_w4a4"]
)
def test_dtype_conversion_keeps_quantized_storage(scheme, convert, dtype):
    """.to(dtype) / .half() convert the router and the expert biases, never the quantized weights nor
    their scales, global scales and zero points (fp8 storage and scales count as floating point), nor
    the correction bias, which stays float32 (test_dtype_conversion_keeps_the_correction_bias_float32)."""
    # top_k = E: the output does not hinge on which experts the lower-precision logits pick.
    layer = _layer(quant_config=scheme, top_k=E, expert_bias=True, correction_bias=True)
    x = torch.randn(16, H)
    want = _forward(layer, x)
    before = {name: b.clone() for name, b in layer.named_buffers()}
    assert {"w13", "w2", "w13_scale", "w2_scale"} <= set(before)
    converted = convert(copy.deepcopy(layer))
    for name, b in converted.named_buffers():
        assert b.dtype == before[name].dtype, f"{name}: {before[name].dtype} became {b.dtype}"
        assert torch.equal(_bits(b), _bits(before[name])), f"{name} changed"
    for name in ("router.weight", "w13_bias", "w2_bias"):
        assert converted.get_parameter(name).dtype == dtype
    assert converted.e_score_correction_bias.dtype == torch.float32
    assert converted.quant_config().w13_scale is converted.w13_scale  # the config follows the buffers
    out = _forward(converted, x.to(dtype))
    assert out.dtype == dtype
    aq = scheme.activation.dtype if scheme.activation is not None else None
    assert relative_error(out, want) <= tolerance(dtype, aq)


@pytest.mark.parametrize("scheme", [FP8_W8A16, NVFP4_W4A4, None], ids=["fp8_w8a16", "nvfp4_w4a4", "unquantized"])
def test_device_move_with_dtype(scheme):
    """.to(device, dtype) moves every tensor; only unquantized ones change dtype (meta stands in for
    another device here, and the layer runs on it)."""
    layer = _layer(quant_config=scheme)
    dtypes = {name: b.dtype for name, b in layer.named_buffers()}
    moved = layer.to(device="meta", dtype=torch.bfloat16)
    assert all(t.is_meta for t in (*moved.parameters(), *moved.buffers()))
    assert {name: b.dtype for name, b in moved.named_buffers()} == dtypes
    assert moved.w13.dtype == (torch.bfloat16 if scheme is None else scheme.weight.storage)
    out = _forward(moved, torch.randn(3, 5, H, device="meta", dtype=torch.bfloat16))
    assert out.is_meta and out.shape == (3, 5, H) and out.dtype == torch.bfloat16


# ---- state_dict round trips, input checks, load_weights copies -----------------------------------


@pytest.mark.parametrize("target", ["meta", "cpu"])
@pytest.mark.parametrize(
    "scheme", [None, FP8_W8A16, INT4_ZP, NVFP4_W4A4], ids=["unquantized", "fp8_w8a16", "int4_zero_point", "nvfp4_w4a4"]
)
def test_load_state_dict_assign(scheme, target):
    """load_state_dict(..., assign=True), the meta-device init path, replaces the buffers: the layer must
    then compute with the loaded weights and scales, not with the tensors they replaced."""
    source = _layer(quant_config=scheme, expert_bias=True)
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        source.w13_bias.normal_()
        source.w2_bias.normal_()
    if scheme is not None and quant.needs_calibration(scheme):
        source.calibrate(x)  # the biases changed GEMM2's inputs (nvfp4_w4a4's global scale)
    if target == "meta":
        with torch.device("meta"):
            layer = _layer(quant_config=scheme, expert_bias=True)
    else:
        layer = _layer(quant_config=scheme, expert_bias=True)
    layer.load_state_dict(source.state_dict(), assign=True)
    assert not any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))
    config = layer.quant_config()
    for name, t in config.tensors().items():
        if t is not None:
            assert t is getattr(layer, name), f"quant_config().{name} is not the loaded buffer"
    out = _forward(layer, x)
    assert torch.equal(out, _forward(source, x))
    aq = scheme.activation.dtype if scheme is not None and scheme.activation is not None else None
    assert relative_error(out, _reference(layer, x)) <= tolerance(torch.float32, aq)


@pytest.mark.parametrize(
    "layer_dtype, x_dtype, scheme",
    [(torch.bfloat16, torch.float32, None), (torch.float32, torch.bfloat16, FP8_W8A16), (torch.float16, torch.bfloat16, None)],
    ids=["bf16_layer_fp32_input", "fp32_fp8_layer_bf16_input", "fp16_layer_bf16_input"],
)
def test_forward_rejects_input_dtype_other_than_the_layers(layer_dtype, x_dtype, scheme):
    layer = _layer(dtype=layer_dtype, quant_config=scheme)
    x = torch.randn(4, H, dtype=x_dtype)
    with pytest.raises(TypeError, match=rf"hidden_states: dtype {x_dtype} differs from the layer's {layer_dtype}; allowed: {layer_dtype}"):
        _forward(layer, x)
    assert _forward(layer, x.to(layer_dtype)).dtype == layer_dtype  # the same input in the layer's dtype runs


def test_forward_input_dtype_may_differ_under_autocast():
    """Under autocast the router's linear casts for itself: a float32 fp8-weight layer takes bf16 input."""
    layer = _layer(quant_config=FP8_W8A16, top_k=E)  # top_k = E: the output does not hinge on bf16 logits
    x = torch.randn(6, H)
    want = _forward(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _forward(layer, x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert relative_error(out, want) <= tolerance(torch.bfloat16)


def test_forward_rejects_input_on_another_device():
    with torch.device("meta"):
        layer = _layer()
    with pytest.raises(ValueError, match=r"hidden_states: on cpu, but the layer is on meta; allowed: meta"):
        _forward(layer, torch.randn(3, H))


def test_load_weights_copies_the_given_tensors():
    """load_weights keeps copies: a later in-place change to the checkpoint (or to the layer it came from)
    leaves the loaded layer as it was."""
    source = _layer()
    layer = _layer()
    layer.load_weights(source.state_dict())
    x = torch.randn(9, H)
    want = _forward(source, x)
    assert torch.equal(_forward(layer, x), want)
    source.load_state_dict(_layer().state_dict())  # copies into source's tensors in place
    assert not torch.equal(_forward(source, x), want)
    assert torch.equal(_forward(layer, x), want)
    for name in ("w13", "w2"):
        assert getattr(layer, name).untyped_storage().data_ptr() != getattr(source, name).untyped_storage().data_ptr()


def test_load_weights_strided_views():
    """Stacked views with neither row- nor column-major experts are stored in a layout forward accepts."""
    e13, e2 = _stacked(_expert_tensors(seed=4))
    wide13 = torch.randn(E, 2 * I, 2 * H)
    wide13[..., ::2] = e13
    layer = _layer()
    layer.load_weights({"w13": wide13[..., ::2], "w2": e2})
    assert torch.equal(layer.float_weights()[0], e13)
    x = torch.randn(5, H)
    assert relative_error(_forward(layer, x), _reference(layer, x)) <= F32_TOL


# ---- load_weights: layouts, biases, duplicates, partial loads, dtypes ------------------------------


def _per_expert(parts, names=(("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")), kind="weight"):
    return {f"experts.{e}.{n}.{kind}": parts[p][e] for e in range(E) for p, n in names if p in parts}


def test_per_expert_gate_and_up_are_interleaved_for_an_interleaved_activation():
    """Per-expert gate_proj / up_proj rows go to w13 as gate_0, up_0, gate_1, ... when the activation
    reads them interleaved (they were concatenated: a relative error of 1.25 against float64), and so do
    their biases, which must land beside their rows."""
    layer = _layer(activation=moe_ops.Activation("silu", interleaved=True), expert_bias=True)
    parts = _expert_tensors(seed=21)
    g = generator(23)
    biases = {p: list(torch.randn(E, I if p != "down" else H, generator=g)) for p in ("gate", "up", "down")}
    layer.load_weights({**_per_expert(parts), **_per_expert(biases, kind="bias")})
    for e in range(E):
        assert torch.equal(layer.w13[e, 0::2], parts["gate"][e]) and torch.equal(layer.w13[e, 1::2], parts["up"][e])
        assert torch.equal(layer.w13_bias[e, 0::2], biases["gate"][e]) and torch.equal(layer.w13_bias[e, 1::2], biases["up"][e])
    x = torch.randn(9, H)
    tw, ti = layer.routing_for(x)
    concat13, w2 = _stacked(parts)  # the same experts in the concatenated layout, through the float64 reference
    b13 = torch.stack([torch.cat([biases["gate"][e], biases["up"][e]]) for e in range(E)])
    b2 = torch.stack(biases["down"])
    want = moe_float64(x, concat13.double(), w2.double(), tw, ti, activation="silu", w13_bias=b13, w2_bias=b2)
    assert relative_error(_forward(layer, x), want) <= F32_TOL


@pytest.mark.parametrize("per_expert", [False, True])
def test_expert_biases_load(per_expert):
    """Expert biases load stacked (w13_bias / gate_up_proj_bias, w2_bias / down_proj_bias) or per expert
    (.bias of each projection); before, every bias name was unknown, so gpt-oss-style checkpoints could
    not be loaded. A layer without biases refuses them."""
    layer = _layer(expert_bias=True)
    g = generator(22)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    if per_expert:
        parts = {"gate": list(b13[:, :I]), "up": list(b13[:, I:]), "down": list(b2)}
        layer.load_weights(_per_expert(parts, kind="bias"))
    else:
        layer.load_weights({"model.experts.gate_up_proj_bias": b13, "model.experts.down_proj_bias": b2})
    assert torch.equal(layer.w13_bias, b13) and torch.equal(layer.w2_bias, b2)
    x = torch.randn(5, H)
    assert relative_error(_forward(layer, x), _reference(layer, x)) <= F32_TOL
    source = _layer(expert_bias=True)
    layer.load_weights(dict(source.state_dict()))  # the layer's own names round-trip
    assert torch.equal(layer.w13_bias, source.w13_bias)
    with pytest.raises(ValueError, match=r"weights: w2_bias given, but the layer has no expert biases"):
        _layer().load_weights({"w2_bias": b2})


@pytest.mark.parametrize(
    "weights, match",
    [
        ({"experts.0.gate_proj.weight": 1, "experts.0.w1.weight": 2}, r"'experts.0.gate_proj.weight' and 'experts.0.w1.weight' both give w13.gate.weight.0"),
        ({"gate.weight": 1, "router.weight": 2}, r"'gate.weight' and 'router.weight' both give weight"),
        ({"w13": 1, "experts.gate_up_proj": 2}, r"'w13' and 'experts.gate_up_proj' both give w13.weight"),
    ],
    ids=["per_expert_aliases", "router_aliases", "stacked_aliases"],
)
def test_load_rejects_two_entries_for_one_tensor(weights, match):
    """The last entry used to win silently."""
    layer = _layer()
    shapes = {"experts.0.gate_proj.weight": (I, H), "experts.0.w1.weight": (I, H), "gate.weight": (E, H), "router.weight": (E, H),
              "w13": (E, 2 * I, H), "experts.gate_up_proj": (E, 2 * I, H)}  # fmt: skip
    _assert_load_rejected(layer, {n: torch.randn(shapes[n]) for n in weights}, match)


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (torch.ones(E, H, dtype=torch.int64), TypeError, r"weights\['gate.weight'\]: dtype torch.int64 is not allowed"),
        (torch.ones(E, H, dtype=torch.bool), TypeError, r"weights\['gate.weight'\]: dtype torch.bool is not allowed"),
        (torch.ones(E, H, dtype=torch.complex64), TypeError, r"dtype torch.complex64 is not allowed"),
        ([[0.0] * H] * E, TypeError, r"weights\['gate.weight'\]: expected a torch.Tensor, got list"),
    ],
    ids=["int64", "bool", "complex", "list"],
)
def test_load_rejects_non_float_entries(value, exc, match):
    """They were cast to the layer's dtype silently (complex dropping its imaginary part), or raised
    AttributeError."""
    layer = _layer()
    before = layer.router.weight.clone()
    with pytest.raises(exc, match=match):
        layer.load_weights({"gate.weight": value})
    assert torch.equal(layer.router.weight, before)


def test_partial_load_leaves_the_other_projection_as_stored():
    """Loading only w2 re-quantized w13 from its dequantized, dtype-rounded values (int4 with zero
    points in bf16 moved it by up to 0.4%); now w13's storage and scales stay bit for bit."""
    layer = _layer(quant_config=INT4_ZP, dtype=torch.bfloat16)
    before = {n: b.clone() for n, b in layer.named_buffers() if n.startswith("w13")}
    layer.load_weights({"w2": torch.randn(E, H, I)})
    for n, b in before.items():
        assert torch.equal(getattr(layer, n), b), f"{n} changed"


@pytest.mark.parametrize("size", ["num_experts", "top_k", "hidden_size", "intermediate_size"])
@pytest.mark.parametrize("value", [0, True, 2.0])
def test_sizes_must_be_positive_ints(size, value):
    """True is an int to isinstance, and would build a layer of size 1."""
    with pytest.raises(ValueError, match=rf"^{size}: got {value!r}; allowed: an int >= 1$"):
        _layer(**{size: value})


@pytest.mark.parametrize(
    "routing, match",
    [
        (dict(scoring="sigmod"), r"scoring: got 'sigmod'"),
        (dict(num_expert_group=3), r"num_expert_group and topk_group: got 3 and None"),
        (dict(routed_scaling_factor=float("nan")), r"routed_scaling_factor: got nan"),
    ],
)
def test_routing_options_are_checked_at_construction(routing, match):
    """A bad routing option fails when the layer is built, not at its first forward (possibly inside a
    compiled model, far from the line that set it)."""
    with pytest.raises(ValueError, match=match):
        _layer(**routing)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_layer_dtype_must_be_a_float_the_ops_take(dtype):
    """float64 built a layer whose forward rejected every input; int32 raised a bare RuntimeError."""
    with pytest.raises(TypeError, match=rf"dtype: got {dtype}; allowed: torch.float32, torch.float16, torch.bfloat16"):
        _layer(dtype=dtype)


def test_unquantized_layer_runs_under_autocast():
    """A float32 layer under bf16 autocast: the router casts for itself, the experts compute in float32
    (the ops rejected bf16 activations with float32 weights), the output comes back in bf16."""
    layer = _layer(top_k=E)
    x = torch.randn(6, H).bfloat16()
    want = _forward(layer, x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _forward(layer, x)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, want) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize(
    "weights, exc, match",
    [
        ({"w13": torch.full((E, 2 * I, H), float("inf"))}, ValueError, r"weights\['w13'\]: holds NaN or inf"),
        ({"gate.weight": torch.full((E, H), float("nan"))}, ValueError, r"weights\['gate.weight'\]: holds NaN or inf"),
        ({"gate.weight": torch.empty(E, H, device="meta")}, ValueError, r"weights\['gate.weight'\]: on meta, which holds no values; the layer is on cpu"),
        (None, TypeError, r"weights: expected a mapping or an iterable of \(name, tensor\) pairs, got NoneType"),
        ("w13", TypeError, r"weights: expected a mapping or an iterable of \(name, tensor\) pairs, got str"),
        ({1: torch.zeros(3)}, TypeError, r"weights: expected \(name: str, tensor\) pairs, got \(1, tensor"),
    ],
    ids=["inf_weight", "nan_router", "meta", "none", "str", "int_name"],
)
def test_load_rejects_unreadable_checkpoints(weights, exc, match):
    """Non-finite values loaded silently (every token routed to that expert came out NaN); a meta tensor
    raised NotImplementedError from inside torch; a malformed container raised errors naming nothing."""
    layer = _layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(exc, match=match):
        layer.load_weights(weights)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


@pytest.mark.parametrize(
    "dtype, weights, match",
    [
        (torch.float16, {"w13": torch.full((E, 2 * I, H), 1e6)}, r"weights \(the layer's w13\): holds NaN or inf once converted to the layer's torch.float16"),
        (torch.float16, {"w2": torch.randn(E, H, I).double() * 1e5}, r"weights \(the layer's w2\): holds NaN or inf once converted to the layer's torch.float16"),
        (torch.float32, {"gate.weight": torch.full((E, H), 1e300, dtype=torch.float64)},
         r"weights\['gate.weight'\]: holds NaN or inf once converted to the layer's torch.float32"),
    ],
    ids=["fp16_w13", "fp16_w2", "fp32_router_from_fp64"],
)
def test_load_rejects_values_past_the_layers_dtype(dtype, weights, match):
    """Finite as given, inf once stored in the layer's dtype: loaded silently before, and the forward gave NaN."""
    layer = moe_ops.FusedMoE(E, 2, H, I, dtype=dtype)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        layer.load_weights(weights)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_forward_takes_a_transposed_input():
    """hidden_states whose last dimension is not contiguous (a transposed view) give the contiguous input's
    output, as nn.Linear takes them; they raised after the router had run."""
    layer = _layer()
    x = torch.randn(H, 5).t()
    assert x.stride(-1) != 1
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x.contiguous()))
