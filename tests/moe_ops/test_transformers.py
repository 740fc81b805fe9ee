"""The transformers integration: the experts implementation "moe_ops" gives the same logits (and the
same experts outputs) as transformers' eager experts for tiny random Mixtral, Qwen3-MoE and gpt-oss
models, through every way of selecting it, compiled too; importing moe_ops does not import
transformers."""
from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe_ops  # noqa: E402
from moe_ops.reference import relative_error, tolerance  # noqa: E402
from ..seeds import generator  # noqa: E402

INTEGRATION = importlib.import_module("moe_ops.integrations.transformers")
TOL = tolerance(torch.float32) * 10
LAYERS = 2
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts_per_tok=2,
)  # fmt: skip


def _config(name: str, **overrides):
    if name == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4)
    elif name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=6, norm_topk_prob=True
        )
    elif name == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **COMMON, intermediate_size=32, num_local_experts=4, layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        )  # fmt: skip
    else:
        raise AssertionError(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _reinit(model, seed=0):
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _build(name, seed=0, **kwargs):
    cfg = kwargs.pop("config", None) or _config(name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kwargs)
    return _reinit(model, seed)


def _experts(model):
    mods = [m for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]
    assert len(mods) == LAYERS
    return mods


def _input_ids(seed=1, shape=(2, 9)):
    return torch.randint(0, COMMON["vocab_size"], shape, generator=generator(seed))


@torch.no_grad()
def _run(model, ids):
    """(logits, [each experts module's output])."""
    outs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outs.append(out.detach().clone())) for m in _experts(model)]
    try:
        logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


@pytest.fixture
def spy(monkeypatch):
    """Counts (and records the keyword arguments of) the fused_experts calls the integration makes."""
    calls = []
    real = INTEGRATION.fused_experts

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(INTEGRATION, "fused_experts", counting)
    return calls


MODELS = {
    "mixtral": {},
    "qwen3_moe": {},
    "qwen3_moe_gelu_tanh_no_renorm": dict(hidden_act="gelu_pytorch_tanh", norm_topk_prob=False),
    "gpt_oss": {},
}


@pytest.mark.parametrize("variant", list(MODELS))
def test_set_experts_implementation_matches_eager(variant, spy):
    name = next(n for n in ("mixtral", "qwen3_moe", "gpt_oss") if variant.startswith(n))
    model = _build(name, config=_config(name, **MODELS[variant]))
    ids = _input_ids()
    model.set_experts_implementation("eager")
    eager_logits, eager_outs = _run(model, ids)
    assert spy == []  # eager never reaches moe_ops
    model.set_experts_implementation("moe_ops")
    assert model.config._experts_implementation == "moe_ops"
    logits, outs = _run(model, ids)
    assert len(spy) == LAYERS  # moe_ops really ran, once per MoE layer
    assert relative_error(logits, eager_logits) <= TOL
    for ours, theirs in zip(outs, eager_outs, strict=True):
        assert theirs.abs().max() > 0
        assert relative_error(ours, theirs) <= TOL
    # and back: switching to eager again stops calling moe_ops
    model.set_experts_implementation("eager")
    assert torch.equal(_run(model, ids)[0], eager_logits)
    assert len(spy) == LAYERS


def test_experts_activation_mapping():
    mix = _experts(_build("mixtral"))[0]
    assert INTEGRATION.experts_activation(mix) == moe_ops.Activation("silu")
    oss = _experts(_build("gpt_oss", config=_config("gpt_oss", swiglu_limit=3.5, swiglu_alpha=1.5)))[0]
    # Older transformers (5.17) fix alpha and limit in the module instead of reading the config: the
    # mapping follows the module, which is what its eager forward uses.
    oss.alpha, oss.limit = 1.5, 3.5
    assert INTEGRATION.experts_activation(oss) == moe_ops.Activation("swigluoai", alpha=1.5, limit=3.5, interleaved=True)
    gelu = _experts(_build("qwen3_moe", config=_config("qwen3_moe", hidden_act="gelu_pytorch_tanh")))[0]
    assert INTEGRATION.experts_activation(gelu).kind == "gelu_tanh"


@pytest.mark.parametrize("limit", [0.03, 7.0], ids=["clamp_active", "default_limit"])
def test_gpt_oss_clamped_swiglu_biases_and_transposed_weights(limit, spy):
    """gpt-oss: interleaved gate/up, [E, H, N] (transposed) weights read as column-major views, biases,
    and a clamped SwiGLU whose limit (0.03: the clamp binds) moe_ops must honour."""
    model = _build("gpt_oss", config=_config("gpt_oss", swiglu_limit=limit))
    experts = _experts(model)
    assert experts[0].is_transposed and experts[0].has_bias and not experts[0].is_concatenated
    with torch.no_grad():
        for m in experts:  # make the biases large enough to matter
            m.limit = limit  # transformers 5.17 ignores config.swiglu_limit; eager reads the module's
            m.gate_up_proj_bias.normal_(0, 0.5)
            m.down_proj_bias.normal_(0, 0.5)
    ids = _input_ids(seed=2)
    model.set_experts_implementation("eager")
    eager_logits, eager_outs = _run(model, ids)
    model.set_experts_implementation("moe_ops")
    logits, outs = _run(model, ids)
    assert len(spy) == LAYERS
    act = spy[0]["activation"]
    assert act == moe_ops.Activation("swigluoai", alpha=1.702, limit=limit, interleaved=True)
    assert spy[0]["w13_bias"] is not None and spy[0]["w2_bias"] is not None
    assert relative_error(logits, eager_logits) <= TOL
    for ours, theirs in zip(outs, eager_outs, strict=True):
        assert relative_error(ours, theirs) <= TOL
    if limit < 1:
        # the clamp binds: the same model with the default limit gives other experts outputs
        other = _build("gpt_oss", config=_config("gpt_oss"))
        other.load_state_dict(model.state_dict())
        other.set_experts_implementation("eager")
        assert relative_error(_run(other, ids)[1][0], eager_outs[0]) > 1e-2


def test_row_major_experts_restores_transposed_experts_in_place(tmp_path, spy):
    """row_major_experts re-stores gpt-oss's [E, K, N] experts so the [E, N, K] views moe_ops reads are
    row-major: same Parameter objects, shapes and values; both implementations give the logits they
    gave before; a second call and a model without transposed experts change nothing; .to() keeps the
    layout, and the model saves and loads as before."""
    model = _build("gpt_oss")
    ids = _input_ids(seed=9)
    model.set_experts_implementation("eager")
    eager_before, _ = _run(model, ids)
    model.set_experts_implementation("moe_ops")
    ours_before, _ = _run(model, ids)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    assert [m.gate_up_proj.transpose(1, 2).is_contiguous() for m in _experts(model)] == [False] * LAYERS

    names = INTEGRATION.row_major_experts(model)
    assert names == [n for n, m in model.named_modules() if m in _experts(model)]
    for m in _experts(model):
        for w in (m.gate_up_proj, m.down_proj):
            e, k, n = w.shape
            assert w.stride() == (n * k, 1, k) and w.transpose(1, 2).is_contiguous()
    for n, p in model.named_parameters():
        assert p is params[n][0] and torch.equal(p, params[n][1]), n
    ours, _ = _run(model, ids)
    assert relative_error(ours, ours_before) <= TOL and relative_error(ours, eager_before) <= TOL
    model.set_experts_implementation("eager")
    assert relative_error(_run(model, ids)[0], eager_before) <= TOL
    assert len(spy) == 2 * LAYERS

    assert INTEGRATION.row_major_experts(model) == []
    wide = _experts(model.to(torch.float64))[0].gate_up_proj
    assert wide.dtype == torch.float64 and wide.transpose(1, 2).is_contiguous()
    model.float().save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded.set_experts_implementation("eager")
    assert relative_error(_run(loaded, ids)[0], eager_before) <= TOL

    mixtral = _build("mixtral")
    pointers = [p.data_ptr() for p in mixtral.parameters()]
    assert INTEGRATION.row_major_experts(mixtral) == []
    assert [p.data_ptr() for p in mixtral.parameters()] == pointers


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_config_attribute_selects_moe_ops(name, spy):
    reference = _build(name)
    reference.set_experts_implementation("eager")
    ids = _input_ids(seed=3)
    eager_logits, _ = _run(reference, ids)
    cfg = _config(name)
    cfg._experts_implementation = "moe_ops"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert model.config._experts_implementation == "moe_ops"
    model.load_state_dict(reference.state_dict())
    model.eval()
    logits, _ = _run(model, ids)
    assert len(spy) == LAYERS
    assert relative_error(logits, eager_logits) <= TOL


def test_from_pretrained_with_experts_implementation(tmp_path, spy):
    reference = _build("qwen3_moe")
    reference.save_pretrained(tmp_path)
    reference.set_experts_implementation("eager")
    ids = _input_ids(seed=4)
    eager_logits, _ = _run(reference, ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moe_ops", dtype=torch.float32)
    assert model.config._experts_implementation == "moe_ops"
    logits, _ = _run(model.eval(), ids)
    assert len(spy) == LAYERS
    assert relative_error(logits, eager_logits) <= TOL


def _moe_ops_ops(gm) -> list[str]:
    return [
        n.target.name().split("::")[1]
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "moe_ops"
    ]


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_compiled_fullgraph_matches_eager(name, spy):
    """torch.compile(fullgraph=True) of the whole model with moe_ops experts. The aot_eager backend traces
    exactly what inductor would be given (dynamo + AOT autograd + the ops' fake impls) without the C++
    compile, which on a cold cache costs ~30 s per model; test_compile.py compiles with inductor."""
    from torch._dynamo.backends.debugging import aot_eager

    model = _build(name)
    ids, other_ids = _input_ids(seed=5), _input_ids(seed=6)
    model.set_experts_implementation("eager")
    eager_logits, _ = _run(model, ids)
    eager_other, _ = _run(model, other_ids)
    model.set_experts_implementation("moe_ops")
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        logits = compiled(ids).logits
        again = compiled(other_ids).logits  # a second call runs the compiled code
    assert len(spy) >= LAYERS  # traced through the moe_ops implementation
    assert relative_error(logits, eager_logits) <= TOL
    assert relative_error(again, eager_other) <= TOL
    ops = _moe_ops_ops(graphs[-1])
    assert ops.count("grouped_gemm") == 2 * LAYERS and ops.count("weighted_reduce") == LAYERS


def test_expert_parallel_sentinels_are_dropped(spy):
    """With _is_expert_parallel, ids == num_experts are sentinels for experts on other ranks: moe_ops
    drops them, matching transformers' eager experts run on the same pairs with the sentinel pairs'
    weights set to 0 (older transformers' eager experts cannot take sentinel ids themselves)."""
    experts = _experts(_build("mixtral"))[0]
    g = generator(7)
    hidden = torch.randn(10, COMMON["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    ids[::3, 1] = experts.num_experts  # sentinels
    weights = torch.rand(10, 2, generator=g)
    kept = weights.clone()
    kept[::3, 1] = 0.0
    ids_valid = ids.clone()
    ids_valid[::3, 1] = (ids[::3, 0] + 1) % experts.num_experts
    with torch.no_grad():
        experts._is_expert_parallel = False
        experts.config._experts_implementation = "eager"
        eager = experts(hidden, ids_valid, kept)
        experts._is_expert_parallel = True
        experts.config._experts_implementation = "moe_ops"
        ours = experts(hidden, ids, weights)
    assert len(spy) == 1 and spy[0]["expert_map"] is not None
    assert relative_error(ours, eager) <= TOL
    # and the sentinel pairs did matter: keeping their weights changes the result
    with torch.no_grad():
        experts._is_expert_parallel = False
        experts.config._experts_implementation = "eager"
        assert relative_error(experts(hidden, ids_valid, weights), eager) > TOL


@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
def test_experts_with_a_plain_function_as_act_fn(act_fn, spy):
    """LFM2-MoE's experts hold torch.nn.functional.silu itself as act_fn, not an activation module:
    moe_ops maps it by identity and matches the experts' own eager forward."""
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts

    cfg = transformers.Lfm2MoeConfig(hidden_size=COMMON["hidden_size"], moe_intermediate_size=32, num_experts=4)
    experts = _reinit(Lfm2MoeExperts(cfg))
    experts.act_fn = getattr(torch.nn.functional, act_fn)
    assert INTEGRATION.experts_activation(experts) == moe_ops.Activation(act_fn)
    g = generator(8)
    hidden = torch.randn(10, COMMON["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=g)
    with torch.no_grad():
        experts.config._experts_implementation = "eager"
        eager = experts(hidden, ids, weights)
        experts.config._experts_implementation = "moe_ops"
        ours = experts(hidden, ids, weights)
    assert len(spy) == 1
    assert eager.abs().max() > 0
    assert relative_error(ours, eager) <= TOL


def test_unknown_plain_function_act_fn_is_named():
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts

    experts = Lfm2MoeExperts(transformers.Lfm2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    experts.act_fn = torch.nn.functional.mish
    with pytest.raises(NotImplementedError, match=r"Lfm2MoeExperts: activation mish has no moe_ops equivalent; known: .*torch\.nn\.functional\.silu"):
        INTEGRATION.experts_activation(experts)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)


def test_import_does_not_import_transformers_and_registers_later():
    result = _python(
        """
        import sys
        import moe_ops
        assert "transformers" not in sys.modules, sorted(m for m in sys.modules if m.startswith("transformers"))
        layer = moe_ops.FusedMoE(4, 2, 16, 8)  # the layer does not need it either
        assert "transformers" not in sys.modules
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        assert "moe_ops" in ALL_EXPERTS_FUNCTIONS, "not registered when transformers was imported after moe_ops"
        # The fp8 experts' interface, a module of its own imported later still (by a quantized load).
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        assert "moe_ops" in ALL_FP8_EXPERTS_FUNCTIONS, "not registered for FP8Experts"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_registers_when_transformers_was_imported_first():
    result = _python(
        """
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        assert "moe_ops" not in ALL_EXPERTS_FUNCTIONS and "moe_ops" not in ALL_FP8_EXPERTS_FUNCTIONS
        import moe_ops
        assert "moe_ops" in ALL_EXPERTS_FUNCTIONS and "moe_ops" in ALL_FP8_EXPERTS_FUNCTIONS
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_registers_for_fp8_experts_imported_after_moe_ops():
    """transformers' moe module already imported, its fp8 module not yet: moe_ops registers in the
    first at once and in the second when it is imported."""
    result = _python(
        """
        import sys
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        import moe_ops
        assert "moe_ops" in ALL_EXPERTS_FUNCTIONS and "transformers.integrations.finegrained_fp8" not in sys.modules
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        assert "moe_ops" in ALL_FP8_EXPERTS_FUNCTIONS
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_quantized_experts_are_refused_by_name():
    """Experts stored in fp8 (a quantized checkpoint's codes, scales kept elsewhere): the input was cast
    to fp8 and fused_experts then named hidden_states, which the caller never gave in fp8."""
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts

    experts = Lfm2MoeExperts(transformers.Lfm2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match=r"Lfm2MoeExperts.gate_up_proj: dtype torch.float8_e4m3fn; the moe_ops experts implementation reads float experts"):
        INTEGRATION.moe_ops_experts_forward(experts, torch.randn(3, 16), ids, torch.rand(3, 2))


def _mixtral_experts(seed=0):
    """One float32 MixtralExperts (4 experts, top-2, concatenated [gate; up]) with random weights."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return _reinit(MixtralExperts(_config("mixtral")), seed)


def _routing(seed, tokens=10, num_experts=4, dtype=torch.float32):
    g = generator(seed)
    hidden = torch.randn(tokens, COMMON["hidden_size"], generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])
    return hidden, ids, torch.rand(tokens, 2, generator=g)


@torch.no_grad()
def _eager_and_ours(experts, hidden, ids, weights):
    """(the experts module's own eager forward, the same call through the moe_ops implementation)."""
    experts.config._experts_implementation = "eager"
    eager = experts(hidden, ids, weights)
    experts.config._experts_implementation = "moe_ops"
    return eager, experts(hidden, ids, weights)


def test_experts_without_is_concatenated_read_as_concatenated(spy):
    """An experts module that lacks the is_concatenated flag (a class not decorated with transformers'
    current use_experts_implementation, or one from an older release) keeps [gate; up] concatenated, as
    eager's chunk(2) reads it: moe_ops must default to concatenated, not interleaved (a flipped default
    of getattr(experts, "is_concatenated", ...) would pair gate rows with up rows)."""
    experts = _mixtral_experts()
    del experts.is_concatenated
    assert not hasattr(experts, "is_concatenated")
    assert INTEGRATION.experts_activation(experts) == moe_ops.Activation("silu", interleaved=False)
    eager, ours = _eager_and_ours(experts, *_routing(9))
    assert len(spy) == 1 and not spy[0]["activation"].interleaved
    assert eager.abs().max() > 0
    assert relative_error(ours, eager) <= TOL


@pytest.mark.parametrize(
    "act_fn",
    [lambda: torch.nn.GELU(approximate="tanh"), lambda: transformers.activations.NewGELUActivation(),
     lambda: transformers.activations.FastGELUActivation()],
    ids=["nn_GELU_tanh", "NewGELUActivation", "FastGELUActivation"],
)
def test_tanh_gelu_act_fns_map_to_gelu_tanh(act_fn, spy):
    """torch.nn.GELU(approximate="tanh") (class name GELU, told apart by its approximate attribute) and
    transformers' NewGELUActivation (gelu_new) and FastGELUActivation (gelu_fast), both the tanh formula,
    are the tanh-approximated GELU: moe_ops must run gelu_tanh, not exact (erf) gelu, matching the
    experts' eager forward. Catches dropping the
    approximate == "tanh" check and mapping NewGELUActivation to "gelu". The two GELUs differ by at most
    ~2e-4 relative (gate pre-activations ~N(0, 0.8^2), where they differ most), so the comparison uses the
    float32 tolerance itself (1e-5), not TOL, and checks on eager that exact GELU falls outside it."""
    experts = _mixtral_experts(seed=10)
    experts.act_fn = act_fn()
    with torch.no_grad():
        experts.gate_up_proj.mul_(2)  # gate pre-activations ~N(0, 0.8^2)
    assert INTEGRATION.experts_activation(experts) == moe_ops.Activation("gelu_tanh")
    inputs = _routing(11)
    eager, ours = _eager_and_ours(experts, *inputs)
    assert len(spy) == 1 and spy[0]["activation"].kind == "gelu_tanh"
    tight = tolerance(torch.float32)
    assert relative_error(ours, eager) <= tight
    # the test can tell the two GELUs apart: exact GELU in eager gives a result well outside the tolerance
    experts.act_fn = torch.nn.GELU()
    assert relative_error(_eager_and_ours(experts, *inputs)[0], eager) > 5 * tight


def test_gate_and_activation_mismatch_is_refused_by_name():
    """relu2 is moe_ops' only activation without a gate: gated experts (has_gate) holding relu2, or
    ungated ones (NemotronH's has_gate=False experts) holding a gated activation such as silu, have no
    moe_ops equivalent and raise NotImplementedError naming the class, the activation and has_gate,
    instead of running a layout that does not match the weights."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    gated = _mixtral_experts()
    gated.act_fn = transformers.activations.ACT2FN["relu2"]
    with pytest.raises(NotImplementedError, match=r"MixtralExperts: activation relu2 with has_gate=True is not supported"):
        INTEGRATION.experts_activation(gated)
    cfg = transformers.NemotronHConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, mlp_hidden_act="relu2")
    ungated = NemotronHExperts(cfg)
    assert not ungated.has_gate
    assert INTEGRATION.experts_activation(ungated) == moe_ops.Activation("relu2")  # the supported pairing
    ungated.act_fn = transformers.activations.ACT2FN["silu"]
    with pytest.raises(NotImplementedError, match=r"NemotronHExperts: activation silu with has_gate=False is not supported"):
        INTEGRATION.experts_activation(ungated)


@pytest.mark.parametrize(
    "hidden_dtype, experts_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16_hidden_f32_experts", "f16_hidden_f32_experts", "f32_hidden_bf16_experts"],
)
def test_output_dtype_is_the_hidden_states_dtype(hidden_dtype, experts_dtype, spy):
    """moe_ops computes in the experts' dtype (hidden_states are cast to it) and must cast the result back:
    the experts module returns hidden_states' dtype, as transformers' callers (residual adds) expect.
    Catches returning fused_experts' output uncast (then in the experts' dtype). The values match the eager
    forward of a float32 copy of the same (rounded) weights and inputs within the lower precision's
    tolerance."""
    experts = _mixtral_experts(seed=12)
    low = hidden_dtype if hidden_dtype != torch.float32 else experts_dtype
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(p.to(low).float())  # representable in both dtypes: only the computation differs
    hidden, ids, weights = _routing(13, dtype=low)
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        eager = experts(hidden.float(), ids, weights)
    experts.to(experts_dtype)
    experts.config._experts_implementation = "moe_ops"
    with torch.no_grad():
        ours = experts(hidden.to(hidden_dtype), ids, weights)
    assert len(spy) == 1
    assert ours.dtype == hidden_dtype
    assert eager.abs().max() > 0
    assert relative_error(ours, eager) <= tolerance(low)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_router_weights_in_a_half_dtype_are_taken(weight_dtype, spy):
    """Models hand the experts their routing weights cast to the hidden dtype (Mixtral's router does
    `.to(hidden_states.dtype)`), while moe_ops' fused_experts takes float32 weights only: the
    integration must widen them, not fail with a TypeError. The result equals the eager forward of
    the same (rounded) weights."""
    experts = _mixtral_experts(seed=14)
    hidden, ids, weights = _routing(15)
    eager, ours = _eager_and_ours(experts, hidden, ids, weights.to(weight_dtype))
    assert len(spy) == 1
    assert eager.abs().max() > 0
    assert relative_error(ours, eager) <= TOL


# CUSTOM_GATES' classes by model type, with the Activation each must map to for _custom_gate_experts'
# alpha (1.3) and limit (0.8: with unit-variance weights and inputs the clamps bind on most elements), or
# softcaps (1.5 for the gate, 2.5 for up: they bend most elements).
CUSTOM_GATE_CASES = {
    "deepseek_v4": ("DeepseekV4Experts", moe_ops.Activation("silu_clamped", limit=0.8)),
    "glm5_next": ("Glm5NextTextExperts", moe_ops.Activation("silu_clamped", limit=0.8)),
    "hy_v4": ("HYV4Experts", moe_ops.Activation("silu_clamped", limit=0.8)),
    "hy_v4_vl": ("HYV4VLExperts", moe_ops.Activation("silu_clamped", limit=0.8)),
    "minimax_m3_vl": ("MiniMaxM3VLExperts", moe_ops.Activation("swigluoai", alpha=1.3, limit=0.8)),
    "openai_privacy_filter": ("OpenAIPrivacyFilterExperts", moe_ops.Activation("swigluoai", alpha=1.3, limit=0.8)),
    "gpt_oss": ("GptOssExperts", moe_ops.Activation("swigluoai", alpha=1.3, limit=0.8, interleaved=True)),
    "beam": ("BeamExperts", moe_ops.Activation("silu")),
    "inkling2": ("Inkling2Experts", moe_ops.Activation("swiglu_softcapped", alpha=1.5, limit=2.5)),
    "inkling2_loop": ("Inkling2LoopExperts", moe_ops.Activation("swiglu_softcapped", alpha=1.5, limit=2.5)),
}


def _custom_gate_experts(model_type: str, cls: str, seed=0):
    """One float32 experts module of that model type (4 experts, H 64, I 32), unit-variance weights."""
    module = pytest.importorskip(f"transformers.models.{model_type}.modeling_{model_type}")
    cfg = transformers.PretrainedConfig(
        num_local_experts=4, num_experts=4, n_routed_experts=4, hidden_size=COMMON["hidden_size"], intermediate_size=32,
        moe_intermediate_size=32, hidden_act="silu", swiglu_limit=0.8, swiglu_alpha=1.3, mlp_gate_softcap=1.5,
        mlp_up_softcap=2.5,
    )  # fmt: skip
    experts = getattr(module, cls)(cfg)
    g = generator(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return experts


def test_custom_gates_cover_the_table():
    assert {cls for cls, _ in CUSTOM_GATE_CASES.values()} == set(INTEGRATION.CUSTOM_GATES)


@pytest.mark.parametrize("model_type", list(CUSTOM_GATE_CASES))
def test_custom_gates_match_their_eager_forward(model_type, spy):
    """Each experts class of CUSTOM_GATES (transformers' _apply_gate of its own: gpt-oss's clamped SwiGLU
    under other attribute names, DeepSeek-V4's clamps on plain SiLU, Beam's SiLU in float32, Inkling-2's
    softcapped SwiGLU) maps to the Activation that computes it, with alpha and limit read from the
    module, and moe_ops' output equals the class's own eager forward where the clamps and caps bind. The
    same module with another kind's arithmetic is far off, so the comparison tells them apart."""
    cls, want = CUSTOM_GATE_CASES[model_type]
    experts = _custom_gate_experts(model_type, cls)
    if model_type in ("gpt_oss", "openai_privacy_filter") and (experts.alpha, experts.limit) == (1.702, 7.0):
        # transformers before 5.24 (5.17 on the GPU host) holds gpt-oss's constants whatever the config
        # says; the integration must read the module, not the config.
        want = dataclasses.replace(want, alpha=1.702, limit=7.0)
    assert INTEGRATION.experts_activation(experts) == want
    inputs = _routing(21)
    eager, ours = _eager_and_ours(experts, *inputs)
    assert len(spy) == 1 and spy[0]["activation"] == want
    assert eager.abs().max() > 0
    assert relative_error(ours, eager) <= TOL
    other = {"silu_clamped": "swigluoai", "swigluoai": "silu_clamped", "silu": "silu_clamped", "swiglu_softcapped": "silu"}[want.kind]
    wrong = moe_ops.fused_experts(
        inputs[0], *_stacked(experts), inputs[2], inputs[1], activation=dataclasses.replace(want, kind=other),
        w13_bias=getattr(experts, "gate_up_proj_bias", None), w2_bias=getattr(experts, "down_proj_bias", None),
    )  # fmt: skip
    assert relative_error(wrong, eager) > 1e-2


def _stacked(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, N, H], w2 [E, H, I]) as the integration reads an experts module's weights."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    return (w13.transpose(1, 2), w2.transpose(1, 2)) if experts.is_transposed else (w13, w2)


def test_custom_gates_are_named_not_guessed():
    """A class outside CUSTOM_GATES is refused even with gpt-oss's attribute names (alpha and limit: its
    arithmetic may differ), and so is a subclass of a listed class that overrides _apply_gate again;
    one that inherits the listed class's gate keeps its mapping."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = _custom_gate_experts("gpt_oss", "GptOssExperts")

    class Inherits(GptOssExperts):
        pass

    class Overrides(GptOssExperts):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    experts.__class__ = Inherits
    assert INTEGRATION.experts_activation(experts).kind == "swigluoai"
    experts.__class__ = Overrides
    with pytest.raises(NotImplementedError, match=r"Overrides: its custom _apply_gate has no moe_ops equivalent \(moe_ops computes those of GptOssExperts, "):
        INTEGRATION.experts_activation(experts)
    unlisted = _mixtral_experts()
    unlisted.__class__ = type("Unlisted", (type(unlisted),), {"_apply_gate": GptOssExperts._apply_gate})
    unlisted.alpha, unlisted.limit = 1.702, 7.0
    with pytest.raises(NotImplementedError, match=r"Unlisted: its custom _apply_gate has no moe_ops equivalent"):
        INTEGRATION.experts_activation(unlisted)


def test_fused_moe_computes_deepseek_v4_routed_experts():
    """A FusedMoE with DeepSeek-V4's recipe (sqrt(softplus) scores, a correction bias for selection,
    renormalized, scaled, silu_clamped experts) loaded from transformers' DeepseekV4TopKRouter and
    DeepseekV4Experts computes their routed output (the block's output before its shared expert).
    With sigmoid scores, or gpt-oss's clamped gate, the same weights give another output."""
    module = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = transformers.DeepseekV4Config(
        hidden_size=COMMON["hidden_size"], intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=0.8, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", hidden_act="silu",
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    router, experts = module.DeepseekV4TopKRouter(cfg), module.DeepseekV4Experts(cfg)
    g = generator(31)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        x = torch.randn(13, COMMON["hidden_size"], generator=g)
        _, weights, ids = router(x)
        want = experts(x, ids, weights)
    state = {"gate.weight": router.weight, "e_score_correction_bias": router.e_score_correction_bias,
             "experts.gate_up_proj": experts.gate_up_proj, "experts.down_proj": experts.down_proj}  # fmt: skip
    recipe = dict(scoring="sqrtsoftplus", correction_bias=True, routed_scaling_factor=1.5, dtype=torch.float32)

    def layer_output(**changes):
        kwargs = {**recipe, "activation": moe_ops.Activation("silu_clamped", limit=0.8), **changes}
        layer = moe_ops.FusedMoE(8, 2, COMMON["hidden_size"], 32, **kwargs)
        layer.load_weights(state)
        with torch.no_grad():
            return layer(x)

    assert want.abs().max() > 0
    assert relative_error(layer_output(), want) <= TOL
    assert relative_error(layer_output(scoring="sigmoid"), want) > 1e-2
    assert relative_error(layer_output(activation=moe_ops.Activation("swigluoai", alpha=1.0, limit=0.8)), want) > 1e-2


def _muse_spark_experts(seed=0):
    """MuseSpark's float32 experts (4 experts, H 64, I 32) with its post-expert norm (input-scaled RMS)."""
    module = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    cfg = transformers.PretrainedConfig(
        num_local_experts=4, moe_hidden_size=COMMON["hidden_size"], moe_intermediate_size=32, hidden_act="silu",
        post_norm_eps=1e-5,
    )  # fmt: skip
    experts = module.MuseSparkExperts(cfg)
    g = generator(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return experts


def test_post_expert_norm_matches_its_eager_forward(spy):
    """MuseSpark's experts normalize each expert's output row (scaled by 1 + weight) before the router
    weight: the integration passes the norm's weight and eps as a PostExpertNorm and the output equals the
    class's own eager forward; the same call without the norm is far off."""
    experts = _muse_spark_experts()
    norm = INTEGRATION.experts_norm(experts)
    assert norm.weight is experts.post_expert_norm.weight and norm.eps == 1e-5
    inputs = _routing(22)
    eager, ours = _eager_and_ours(experts, *inputs)
    assert len(spy) == 1 and spy[0]["post_expert_norm"] is not None
    assert relative_error(ours, eager) <= TOL
    plain = moe_ops.fused_experts(inputs[0], experts.gate_up_proj, experts.down_proj, inputs[2], inputs[1])
    assert relative_error(plain, eager) > 1e-1


def test_unknown_post_expert_norm_is_refused_by_name():
    """A post-expert norm of a class moe_ops does not compute (another norm's arithmetic) raises
    NotImplementedError naming the experts class and the norm's."""
    experts = _muse_spark_experts()
    experts.post_expert_norm = torch.nn.LayerNorm(COMMON["hidden_size"])
    with pytest.raises(NotImplementedError, match=r"MuseSparkExperts: its post-expert norm LayerNorm has no moe_ops equivalent"):
        INTEGRATION.experts_norm(experts)
    assert INTEGRATION.experts_norm(_mixtral_experts()) is None
