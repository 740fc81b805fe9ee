"""The transformers integration for fine-grained fp8 checkpoints: transformers' FP8Experts (what
`replace_with_fp8_linear` puts in place of a Qwen3-FP8 or DeepSeek-V3 experts module) under the
"moe_ops" experts implementation runs its e4m3 codes and block scales as moe_ops' fp8_w8a8_block, and
matches a float64 evaluation of the module's own arithmetic: weights decoded from its codes and scales,
activations quantized per token in 1 x 128 groups, its own _apply_gate."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

import moe_ops  # noqa: E402, F401  (registers the implementation)
from moe_ops.reference import fake_quantize, relative_error, tolerance  # noqa: E402
from ..seeds import generator  # noqa: E402

INTEGRATION = importlib.import_module("moe_ops.integrations.transformers")
HIDDEN, INTER, EXPERTS, TOP_K, BLOCK = 256, 128, 4, 2, 128
# The module's gating variants, as config attributes FP8Experts reads.
GATES = {
    "silu": {},
    "swigluoai": dict(swiglu_alpha=1.702, swiglu_limit=7.0),
    "silu_clamped": dict(swiglu_limit=3.0),
    "swiglu_softcapped": dict(mlp_gate_softcap=4.0, mlp_up_softcap=25.0),
}


def _fp8_experts(seed=0, scale_dtype=torch.float32, expert_dtype="fp8", **config):
    """An FP8Experts as replace_with_fp8_linear builds it (4 experts, H = 256, I = 128, [128, 128]
    weight blocks, dynamic activations), with random e4m3 codes and power-of-two block scales, under the
    "moe_ops" implementation; `config` sets attributes of its model config. expert_dtype "fp4": its
    fp4 storage, left uninitialised."""
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    for k, v in config.items():
        setattr(cfg, k, v)
    cfg._experts_implementation = "moe_ops"
    cls = finegrained_fp8.use_experts_implementation(
        experts_class=finegrained_fp8.FP8Experts, experts_interface=finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False, has_gate=True
    )  # fmt: skip
    # expert_dtype only where given: transformers 5.17 (the GPU host's) has no fp4 experts.
    kind = {} if expert_dtype == "fp8" else {"expert_dtype": expert_dtype}
    experts = cls(cfg, block_size=[BLOCK, BLOCK], activation_scheme="dynamic", **kind)
    if expert_dtype != "fp8":
        return experts
    g = generator(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            w.data = (torch.randn(w.shape, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = getattr(experts, f"{name}_scale_inv")
            s.data = torch.exp2(torch.randint(-10, -6, s.shape, generator=g).float()).to(scale_dtype)
    return experts


def _decoded(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [E, N, K] weights: each code times its 128 x 128 block's scale."""
    n, k = codes.shape[-2:]
    full = scales.double().repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    return codes.double() * full


def _module_float64(experts, x, ids, weights):
    """[S, H]: the module's arithmetic in float64, pair by pair."""
    d13 = _decoded(experts.gate_up_proj.data, experts.gate_up_proj_scale_inv.data)
    d2 = _decoded(experts.down_proj.data, experts.down_proj_scale_inv.data)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for s in range(x.shape[0]):
        xq = fake_quantize(x[s : s + 1].double(), "fp8", (1, BLOCK))
        for j in range(ids.shape[1]):
            e = int(ids[s, j])
            h = experts._apply_gate(xq @ d13[e].T)
            out[s] += float(weights[s, j]) * (fake_quantize(h, "fp8", (1, BLOCK)) @ d2[e].T)[0]
    return out


def _routing(seed, tokens=12):
    g = generator(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, TOP_K, generator=g)


@pytest.mark.parametrize("gate", list(GATES))
def test_fp8_experts_match_their_own_arithmetic_in_float64(gate):
    experts = _fp8_experts(**GATES[gate])
    x, ids, weights = _routing(1)
    with torch.no_grad():
        out = experts(x, ids, weights)
    assert out.dtype == x.dtype and out.shape == x.shape
    err = relative_error(out, _module_float64(experts, x, ids, weights))
    assert err <= tolerance(torch.float32, "fp8", fake_quant=True), (gate, err)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch has no float8_e8m0fnu")
def test_ue8m0_scales_give_the_float32_scales_result():
    """DeepSeek-V4-style UE8M0 scales are powers of two: read as float32 they give the same layer."""
    x, ids, weights = _routing(2)
    with torch.no_grad():
        f32 = _fp8_experts(seed=3)(x, ids, weights)
        ue8m0 = _fp8_experts(seed=3, scale_dtype=torch.float8_e8m0fnu)(x, ids, weights)
    assert torch.equal(f32, ue8m0)


def test_the_call_is_fp8_w8a8_block_on_the_codes(monkeypatch):
    calls = []
    real = INTEGRATION.fused_experts
    monkeypatch.setattr(INTEGRATION, "fused_experts", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    experts = _fp8_experts(**GATES["swigluoai"])
    x, ids, weights = _routing(4, tokens=3)
    with torch.no_grad():
        experts(x, ids, weights)
    (args, kwargs), = calls
    assert args[1] is experts.gate_up_proj and args[2] is experts.down_proj
    assert kwargs["quant_config"].name == "fp8_w8a8_block"
    assert kwargs["activation"] == moe_ops.Activation("swigluoai", alpha=1.702, limit=7.0)


def test_compiled_fullgraph_equals_eager():
    """The quant config built inside forward traces: fullgraph, bit for bit the eager call."""
    torch._dynamo.reset()
    experts = _fp8_experts(**GATES["swigluoai"])
    x, ids, weights = _routing(8)
    with torch.no_grad():
        eager = experts(x, ids, weights)
        compiled = torch.compile(experts, fullgraph=True)(x, ids, weights)
    assert torch.equal(eager, compiled)


def test_moe_ops_is_registered_for_fp8_experts():
    assert "moe_ops" in finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation_scheme="static"), r"FP8Experts: activation_scheme 'static'; moe_ops runs 'dynamic'"),
        (dict(block_size=None), r"FP8Experts: weight_block_size None; moe_ops runs square weight blocks"),
        (dict(block_size=[128, 64]), r"FP8Experts: weight_block_size \[128, 64\]; moe_ops runs square weight blocks"),
    ],
)  # fmt: skip
def test_unsupported_fp8_experts_are_refused_by_name(change, message):
    experts = _fp8_experts()
    for name, value in change.items():
        setattr(experts, name, value)
    x, ids, weights = _routing(5, tokens=2)
    with pytest.raises(NotImplementedError, match=message):
        experts(x, ids, weights)


@pytest.mark.skipif(
    "expert_dtype" not in inspect.signature(finegrained_fp8.FP8Experts.__init__).parameters, reason="FP8Experts without fp4 experts"
)
def test_fp4_experts_are_refused_by_name():
    """DeepSeek-V4-style fp4 experts (expert_dtype "fp4": e2m1 pairs in int8, UE8M0 scales per 32)."""
    experts = _fp8_experts(expert_dtype="fp4")
    x, ids, weights = _routing(5, tokens=2)
    with pytest.raises(NotImplementedError, match=r"FP8Experts.gate_up_proj: dtype torch.int8; moe_ops runs fp8 \(torch.float8_e4m3fn\) experts, not fp4 ones"):
        experts(x, ids, weights)


def test_a_clamp_on_another_activation_is_refused_by_name():
    experts = _fp8_experts(swiglu_limit=3.0, hidden_act="gelu")
    x, ids, weights = _routing(6, tokens=2)
    with pytest.raises(NotImplementedError, match=r"a clamped gate \(limit=3.0\) with activation gelu; moe_ops clamps SiLU only"):
        experts(x, ids, weights)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 16))
def test_fp8_experts_run_the_fp8_kernels_on_hopper(tokens):
    """In bf16 on an sm_90 GPU the FP8Experts layer runs the fp8 block-scale kernels on its codes (two
    MoeGemm launches, no decoding), within the fp8 tolerance of the module's arithmetic (its bf16
    intermediate included)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need a Hopper (sm_90) GPU")
    from moe_ops.bench import kernel_launches

    experts = _fp8_experts(**GATES["silu"]).cuda()
    x, ids, weights = _routing(7, tokens=tokens)
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        out = experts(x.cuda(), ids.cuda(), weights.cuda())
        with moe_ops.value_checks(False):
            names = kernel_launches(lambda: experts(x.cuda(), ids.cuda(), weights.cuda()))
    assert sum("MoeGemm" in n for n in names) == 2 and not any("decode" in n for n in names), names
    apply_gate = experts._apply_gate
    experts._apply_gate = lambda gu: apply_gate(gu).to(torch.bfloat16).double()  # the module's bf16 intermediate
    ref = _module_float64(experts.cpu(), x.double(), ids, weights)
    assert relative_error(out.cpu(), ref) <= tolerance(torch.bfloat16, "fp8", fake_quant=True)
