"""quantize_experts (moe_ops.integrations.transformers): float experts of transformers models re-stored in place
in a moe_ops weight scheme, then run by the "moe_ops" experts implementation. gpt-oss dequantized by transformers'
own mxfp4 decoder comes back to its checkpoint's exact values; every module is checked before any is changed."""
from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe_ops  # noqa: E402
from moe_ops.quant import GroupShape, QuantScheme, WeightQuant, formats  # noqa: E402
from moe_ops.reference import relative_error  # noqa: E402
from ..seeds import generator  # noqa: E402

INTEGRATION = importlib.import_module("moe_ops.integrations.transformers")
MXFP4 = QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32)))
FP8_PER_CHANNEL = QuantScheme(None, WeightQuant("fp8", GroupShape(1, -1)))
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts_per_tok=2,
)  # fmt: skip


def _gpt_oss(seed=0):
    """A bf16 gpt-oss of 2 layers whose experts hold what transformers' mxfp4 decoder (convert_moe_packed_tensors,
    its path without hub kernels) makes of random blocks and scales: transposed [E, K, N] bf16, as loaded."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = transformers.GptOssConfig(
        **COMMON, intermediate_size=64, num_local_experts=4, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for _, experts in INTEGRATION._experts_modules(model):
            for name in ("gate_up_proj", "down_proj"):
                e, k, n = getattr(experts, name).shape
                blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(118, 126, (e, n, k // 32), generator=g, dtype=torch.uint8)
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    model.set_experts_implementation("moe_ops")
    return model


def _qwen3(seed=0):
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=6)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = generator(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.set_experts_implementation("moe_ops")
    return model


def _ids(seed=1):
    return torch.randint(0, COMMON["vocab_size"], (2, 9), generator=generator(seed))


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


def _experts_inputs(experts, seed=2, tokens=10, device="cpu"):
    """Random bf16 hidden states [tokens, H], top-2 ids and router weights for an experts module."""
    g = generator(seed)
    hidden = torch.randn(tokens, experts.hidden_size if hasattr(experts, "hidden_size") else COMMON["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(tokens)])
    return hidden.bfloat16().to(device), ids.to(device), torch.rand(tokens, 2, generator=g).to(device)


@torch.no_grad()
def _experts_call(experts, implementation, seed=2, tokens=10):
    """One experts module's output on random bf16 hidden states and top-2 routing, through `implementation`."""
    experts.config._experts_implementation = implementation
    try:
        return experts(*_experts_inputs(experts, seed, tokens)).float()
    finally:
        experts.config._experts_implementation = "moe_ops"


def _stacked(experts):
    """The module's float experts as [E, N, K] views (w13, w2)."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    return (w13.transpose(1, 2), w2.transpose(1, 2)) if experts.is_transposed else (w13, w2)


def test_gpt_oss_mxfp4_comes_back_exactly():
    """Re-quantized to mxfp4, each weight decodes to the bf16 value transformers loaded, so the model's logits
    equal those of its float experts through moe_ops bit for bit; the codes are row-major [E, N, K/2] uint8."""
    model = _gpt_oss()
    ids = _ids()
    before = _logits(model, ids)
    floats = [tuple(w.detach().float().clone() for w in _stacked(m)) for _, m in INTEGRATION._experts_modules(model)]
    names = INTEGRATION.quantize_experts(model, MXFP4)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for (_, experts), (f13, f2) in zip(INTEGRATION._experts_modules(model), floats, strict=True):
        config = experts.moe_ops_quant_config
        assert config.name == "mxfp4_w4a16" and config.scheme.tiled is None  # CPU: not tiled
        assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_proj.shape == (4, 128, 32)
        assert experts.gate_up_proj.is_contiguous() and not experts.gate_up_proj.requires_grad
        assert experts.gate_up_proj_bias.dtype == torch.bfloat16  # biases stay the module's own
        assert torch.equal(formats.dequantize(experts.gate_up_proj, "mxfp4", (1, 32), config.w13_scale), f13)
        assert torch.equal(formats.dequantize(experts.down_proj, "mxfp4", (1, 32), config.w2_scale), f2)
    assert torch.equal(_logits(model, ids), before)


def test_gpt_oss_mxfp4_against_transformers_eager():
    """Each quantized experts module against transformers' eager forward on its float weights: equal but for bf16
    arithmetic (eager rounds its products and h to bf16: 4-7e-3 over 50 modules of fresh draws)."""
    model = _gpt_oss(seed=3)
    eager = [_experts_call(m, "eager") for _, m in INTEGRATION._experts_modules(model)]
    INTEGRATION.quantize_experts(model, MXFP4)
    for (_, m), want in zip(INTEGRATION._experts_modules(model), eager, strict=True):
        assert relative_error(_experts_call(m, "moe_ops"), want) <= 1.5e-2


def test_tile_on_request_reads_the_same_values():
    """tile=True lays mxfp4 weights out for the w4a16 kernels (on CUDA the default) with the activation's gate
    layout (gpt-oss: interleaved); the reference reads the tiles back to the same logits."""
    model = _gpt_oss(seed=5)
    ids = _ids(seed=6)
    untiled = _gpt_oss(seed=5)
    INTEGRATION.quantize_experts(untiled, MXFP4)
    INTEGRATION.quantize_experts(model, MXFP4, tile=True)
    experts = INTEGRATION._experts_modules(model)[0][1]
    assert experts.moe_ops_quant_config.scheme.tiled == "interleaved"
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_proj.shape[:2] == (4, 128)
    assert torch.equal(_logits(model, ids), _logits(untiled, ids))


def test_fp8_weights_match_fused_experts_on_the_same_codes(monkeypatch):
    """Another weight-only scheme (fp8 per channel) on Qwen3-MoE: each layer calls fused_experts with the codes and
    the config quantize_experts stored, and each experts module stays within fp8's rounding of its float self."""
    model = _qwen3()
    ids = _ids(seed=7)
    floats = [_experts_call(m, "moe_ops") for _, m in INTEGRATION._experts_modules(model)]
    INTEGRATION.quantize_experts(model, FP8_PER_CHANNEL)
    for (_, m), want in zip(INTEGRATION._experts_modules(model), floats, strict=True):
        # e4m3 rounds each weight by up to 2^-4 relative, in both GEMMs: 3.4-5.4% over 50 modules of fresh draws
        assert 0 < relative_error(_experts_call(m, "moe_ops"), want) <= 0.1
    calls = []
    real = INTEGRATION.fused_experts

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(INTEGRATION, "fused_experts", spy)
    _logits(model, ids)
    experts = [m for _, m in INTEGRATION._experts_modules(model)]
    assert len(calls) == len(experts)
    for (args, kwargs), m in zip(calls, experts, strict=True):
        assert args[1] is m.gate_up_proj and args[2] is m.down_proj and args[1].dtype == torch.float8_e4m3fn
        assert kwargs["quant_config"] is m.moe_ops_quant_config


def test_refusals_name_the_argument():
    model = _gpt_oss()
    with pytest.raises(TypeError, match="scheme: expected a moe_ops QuantScheme, got str"):
        INTEGRATION.quantize_experts(model, "mxfp4")
    with pytest.raises(ValueError, match="quantizes activations; quantize_experts takes weight-only schemes"):
        INTEGRATION.quantize_experts(model, moe_ops.quant.QuantScheme(moe_ops.quant.ActivationQuant("fp8", GroupShape(1, -1)), WeightQuant("fp8", GroupShape(1, -1))))
    with pytest.raises(ValueError, match="is tiled; give the untiled scheme"):
        INTEGRATION.quantize_experts(model, QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32), tiled="concat")))
    with pytest.raises(TypeError, match="tile: expected None or a bool, got 'yes'"):
        INTEGRATION.quantize_experts(model, MXFP4, tile="yes")
    with pytest.raises(ValueError, match="config: tiling takes an untiled mxfp4_w4a16 layer"):
        INTEGRATION.quantize_experts(model, FP8_PER_CHANNEL, tile=True)
    assert all(m.gate_up_proj.dtype == torch.bfloat16 for _, m in INTEGRATION._experts_modules(model))
    INTEGRATION.quantize_experts(model, MXFP4)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: its experts are quantized already \(mxfp4_w4a16\)"):
        INTEGRATION.quantize_experts(model, MXFP4)


def test_quantized_experts_switch_the_model_to_moe_ops():
    """Quantized experts run with the "moe_ops" implementation only (transformers' own ones read float weights:
    uint8 codes made them fail deep in torch): quantize_experts sets it, whichever the model had."""
    for implementation in ("eager", "grouped_mm"):
        model, reference = _qwen3(seed=4), _qwen3(seed=4)
        model.set_experts_implementation(implementation)
        assert INTEGRATION.quantize_experts(model, FP8_PER_CHANNEL) == INTEGRATION.quantize_experts(reference, FP8_PER_CHANNEL)
        assert all(m.config._experts_implementation == "moe_ops" for _, m in INTEGRATION._experts_modules(model))
        ids = _ids()
        with torch.no_grad():
            assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_a_model_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module .*, got str"):
        INTEGRATION.quantize_experts("model", MXFP4)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module .*, got str"):
        INTEGRATION.row_major_experts("model")
    with pytest.raises(ValueError, match="model: Linear holds no experts module .*; nothing to quantize"):
        INTEGRATION.quantize_experts(torch.nn.Linear(4, 4), MXFP4)


def test_nothing_changes_unless_every_module_quantizes():
    """The second layer's gating has no moe_ops equivalent: NotImplementedError, and the first layer keeps its float
    weights too."""
    model = _qwen3()
    second = INTEGRATION._experts_modules(model)[1][1]
    second.act_fn = torch.nn.Tanh()
    with pytest.raises(NotImplementedError, match="activation Tanh has no moe_ops equivalent"):
        INTEGRATION.quantize_experts(model, FP8_PER_CHANNEL)
    for _, m in INTEGRATION._experts_modules(model):
        assert m.gate_up_proj.dtype == torch.bfloat16 and getattr(m, "moe_ops_quant_config", None) is None


def test_row_major_experts_leaves_quantized_codes_alone():
    model = _gpt_oss()
    INTEGRATION.quantize_experts(model, MXFP4)
    codes = INTEGRATION._experts_modules(model)[0][1].gate_up_proj
    assert INTEGRATION.row_major_experts(model) == []
    assert INTEGRATION._experts_modules(model)[0][1].gate_up_proj is codes and codes.is_contiguous()


def test_compiled_fullgraph_reads_the_codes():
    """torch.compile(fullgraph=True) of the quantized gpt-oss (aot_eager: dynamo, AOT autograd and the ops' fake
    impls, as test_transformers.py does): the traced graph's grouped GEMMs read mxfp4 weights, and the logits
    equal the uncompiled model's but for the compiled graph's own rounding."""
    from torch._dynamo.backends.debugging import aot_eager

    model = _gpt_oss(seed=8)
    INTEGRATION.quantize_experts(model, MXFP4)
    ids = _ids(seed=9)
    want = _logits(model, ids)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    got = _logits(torch.compile(model, fullgraph=True, backend=backend), ids)
    assert relative_error(got.float(), want.float()) <= 1e-2
    gemms = [n for n in graphs[-1].graph.nodes if n.op == "call_function" and "moe_ops.grouped_gemm" in str(n.target)]
    assert len(gemms) == 2 * len(INTEGRATION._experts_modules(model))
    assert [g.args[9] for g in gemms] == ["mxfp4"] * len(gemms)  # w_dtype: the codes, not float weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper (sm_90) GPU")
def test_on_hopper_the_tiled_experts_run_the_kernels():
    """On CUDA quantize_experts tiles gpt-oss's mxfp4 experts (interleaved gates) by default; the module then runs the
    w4a16 kernels, eagerly (no reference fallback) and compiled with require_kernels, and matches the same module
    quantized on the CPU, where the reference runs it (float32 sums of the same decoded weights)."""
    import copy

    import lowering
    from moe_ops import eager_kernels
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=256, intermediate_size=384, num_local_experts=8, num_experts_per_tok=2)
    cpu = GptOssExperts(cfg).to(torch.bfloat16)
    g = generator(10)
    with torch.no_grad():
        for p in cpu.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    cuda = copy.deepcopy(cpu).cuda()
    INTEGRATION.quantize_experts(torch.nn.ModuleDict({"experts": cpu}), MXFP4)
    INTEGRATION.quantize_experts(torch.nn.ModuleDict({"experts": cuda}), MXFP4)
    assert cpu.moe_ops_quant_config.scheme.tiled is None and cuda.moe_ops_quant_config.scheme.tiled == "interleaved"
    for tokens in (1, 37):
        hidden, ids, weights = _experts_inputs(cuda, seed=11 + tokens, tokens=tokens, device="cuda")
        act = INTEGRATION.experts_activation(cuda)
        cuda.config._experts_implementation = cpu.config._experts_implementation = "moe_ops"
        with torch.no_grad():
            # In no_grad, as the module runs below: the parameters require grad, so grad mode needs the ops.
            why = eager_kernels.why_not(hidden, cuda.gate_up_proj, cuda.down_proj, weights, act,
                                        cuda.moe_ops_quant_config, cuda.gate_up_proj_bias, cuda.down_proj_bias)[1]
            assert why is None, why
            want = cpu(hidden.cpu(), ids.cpu(), weights.cpu()).float()
            got = cuda(hidden, ids, weights)
            torch._dynamo.reset()
            with lowering.enabled(require_kernels=True):
                compiled = torch.compile(cuda, fullgraph=True)(hidden, ids, weights)
        assert relative_error(got.float().cpu(), want) <= 1e-2
        assert torch.equal(compiled, got)
