"""Eager fused_experts on a Hopper GPU runs the CuTe DSL kernels (moe_ops/eager_kernels.py), and the op
chain everywhere else: when the kernels cannot serve a CUDA call it warns once per reason. Eager CUDA
routing without autograd calls the route op's CUDA impl without the dispatcher.

The CPU tests check the choice (why_not's reasons, with the device check answered as sm_90) and that a
CPU call never reaches the kernels; the GPU tests run them."""
from __future__ import annotations

import warnings

import pytest
import torch

import moe_ops
from moe_ops import eager_kernels
from moe_ops.activation import Activation
from moe_ops.quant import QuantConfig
from moe_ops.quant.scheme import UNQUANTIZED
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..seeds import generator

E, K, H, I = 4, 2, 128, 64
UNQUANT = QuantConfig(UNQUANTIZED)


def _weights(dtype=torch.bfloat16, hidden=H, inter=I, device="cpu", seed=0):
    g = generator(seed)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=g) / hidden**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, hidden, inter, generator=g) / inter**0.5).to(device=device, dtype=dtype)
    return w13, w2


def _routing(m, device="cpu", seed=1):
    g = generator(seed)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(m)]
    ids = (torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)).to(torch.int32)
    weights = torch.rand(m, K, generator=g)
    return weights.to(device), ids.to(device)


@pytest.fixture
def cute_interface(monkeypatch):
    """cute_kernels.interface with its device check answering sm_90, so the CPU can test the rest."""
    interface = pytest.importorskip("cute_kernels.interface")
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    return interface


def _reason(x, w13, w2, tw, act=Activation(), config=UNQUANT, b13=None, b2=None):
    return eager_kernels.why_not(x, w13, w2, tw, act, config, b13, b2)[1]


def test_why_not_serves_a_plain_bf16_call_and_names_each_obstacle(cute_interface):
    w13, w2 = _weights()
    x = torch.randn(3, H, dtype=torch.bfloat16)
    tw, _ = _routing(3)
    assert _reason(x, w13, w2, tw) is None
    assert _reason(x, w13, w2, tw, act=Activation("swigluoai", interleaved=True)) is None
    assert _reason(x, w13[:, :I].contiguous(), w2, tw, act=Activation("relu2")) is None
    assert _reason(x, w13, w2, tw, b13=torch.randn(E, 2 * I), b2=torch.randn(E, H, dtype=torch.bfloat16)) is None

    column_major = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert "column-major" in _reason(x, column_major, w2, tw) and "row_major_experts" in _reason(x, column_major, w2, tw)
    wide = torch.randn(E, 2 * H, I, dtype=torch.bfloat16)
    assert "not contiguous" in _reason(x, w13, wide[:, :H], tw)
    f32 = [t.float() for t in (x, w13, w2)]
    assert "bf16 or fp16" in _reason(*f32, tw)
    x96, (w13_96, w2_96) = torch.randn(3, 96, dtype=torch.bfloat16), _weights(hidden=96)
    assert "multiples of 64" in _reason(x96, w13_96, w2_96, tw)
    fp8 = QuantConfig(moe_ops.QuantScheme(weight=moe_ops.quant.WeightQuant("fp8", moe_ops.quant.PER_CHANNEL)),
                      w13_scale=torch.ones(E, 2 * I), w2_scale=torch.ones(E, H))  # fmt: skip
    assert _reason(x, w13, w2, tw, config=fp8) is None  # decoded per call (dequant_kernels.py)
    assert "bf16 or fp16" in _reason(x.float(), w13, w2, tw, config=fp8)
    shifted = torch.randn(3 * H + 1, dtype=torch.bfloat16)[1:].view(3, H)  # 2 bytes past a 16-byte boundary
    assert "16-byte" in _reason(shifted, w13, w2, tw)
    many = torch.randn(2000, 2 * I, H, dtype=torch.bfloat16)
    assert "1024" in _reason(x, many, torch.randn(2000, H, I, dtype=torch.bfloat16), tw)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_why_not_reads_the_sizes_of_packed_weights_unpacked(fmt, cute_interface, monkeypatch):
    """4-bit weights hold K/2 bytes per row: H = 192 packs into 96 columns, which is no multiple of 64,
    but the kernels see the decoded [E, N, 192] (dequant_kernels.py) and serve the call. A decoded weight
    over dequant_kernels.MAX_BYTES is declined with its size (int4); mxfp4 in a bf16 layer with a gated
    activation decodes nothing (the w4a16 kernels, w4_kernels.py), so the limit does not apply."""
    from moe_ops import dequant_kernels

    scheme = moe_ops.QuantScheme(None, moe_ops.quant.WeightQuant(fmt, moe_ops.quant.GroupShape(1, 32)))
    layer = moe_ops.FusedMoE(E, K, 192, I, dtype=torch.bfloat16, quant_config=scheme)
    assert layer.w13.shape[2] == 96
    x, (tw, _) = torch.randn(3, 192, dtype=torch.bfloat16), _routing(3)
    config = layer._quant_config
    assert _reason(x, layer.w13, layer.w2, tw, config=config) is None
    monkeypatch.setattr(dequant_kernels, "MAX_BYTES", E * 2 * I * 192 * 2 - 1)
    why = _reason(x, layer.w13, layer.w2, tw, config=config)
    assert why is None if fmt == "mxfp4" else "w13 decoded to torch.bfloat16 would take" in why


def test_why_not_in_grad_mode(cute_interface):
    """An input that requires grad sends the call to the chain (whose backward raises) only in grad
    mode; under no_grad the kernels serve it."""
    w13, w2 = _weights()
    w13.requires_grad_(True)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    tw, _ = _routing(3)
    assert _reason(x, w13, w2, tw) == eager_kernels.GRAD
    with torch.no_grad():
        assert _reason(x, w13, w2, tw) is None
    with torch.inference_mode():
        assert _reason(x, w13, w2, tw) is None


def test_why_not_without_the_cute_dsl(monkeypatch):
    monkeypatch.setattr(eager_kernels, "_interface", lambda: (None, "cute_kernels unavailable (no cutlass)"))
    w13, w2 = _weights()
    assert _reason(torch.randn(3, H, dtype=torch.bfloat16), w13, w2, _routing(3)[0]) == "cute_kernels unavailable (no cutlass)"


def test_cpu_calls_never_reach_the_kernels(monkeypatch):
    """On the CPU (and meta) fused_experts runs the op chain: the kernel path is never asked, and the
    result is the float64 reference's."""

    def boom(*args, **kwargs):
        raise AssertionError("the kernel path ran on the CPU")

    monkeypatch.setattr(eager_kernels, "why_not", boom)
    monkeypatch.setattr(eager_kernels, "run", boom)
    w13, w2 = _weights(torch.float32)
    x = torch.randn(5, H)
    tw, ids = _routing(5)
    out = moe_ops.fused_experts(x, w13, w2, tw, ids)
    assert relative_error(out, moe_float64(x, w13, w2, tw, ids)) <= tolerance(torch.float32)
    assert moe_ops.fused_experts(*(t.to("meta") for t in (x, w13, w2, tw, ids))).shape == (5, H)


def test_warn_once_per_reason(monkeypatch):
    monkeypatch.setattr(eager_kernels, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            eager_kernels.warn_once("reason A", torch.device("cuda", 0))
        eager_kernels.warn_once("reason B", torch.device("cuda", 0))
    assert [str(w.message) for w in caught] == [
        "moe_ops.fused_experts runs the reference ops on cuda:0: reason A",
        "moe_ops.fused_experts runs the reference ops on cuda:0: reason B",
    ]


# ---- on a Hopper GPU ------------------------------------------------------------------------------


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need a Hopper (sm_90) GPU")
    pytest.importorskip("cute_kernels.interface")


CASES = {
    "silu": dict(act=Activation()),
    "swigluoai_interleaved_bias": dict(act=Activation("swigluoai", interleaved=True), bias=True),
    # DeepSeek-V4's clamps, with a limit that binds on most gate and up sums here (~N(0, 1))
    "silu_clamped": dict(act=Activation("silu_clamped", limit=0.5)),
    # Inkling-2's softcaps, small enough to bend most sums here
    "swiglu_softcapped": dict(act=Activation("swiglu_softcapped", alpha=0.5, limit=0.75, interleaved=True)),
    # MuseSpark's post-expert norm (in the token sum), its weight in bf16 and in float32
    "post_expert_norm": dict(act=Activation(), norm=torch.bfloat16),
    "post_expert_norm_f32": dict(act=Activation(), norm=torch.float32, bias=True),
    "relu2": dict(act=Activation("relu2")),
    "expert_map": dict(act=Activation(), expert_map=True),
}


def _case(name, m, seed=0):
    c = CASES[name]
    act = c["act"]
    w13, w2 = _weights(device="cuda", seed=seed)
    if not act.gated:
        w13 = w13[:, :I].contiguous()
    tw, ids = _routing(m, "cuda", seed + 1)
    kw = dict(activation=act)
    if c.get("bias"):
        kw.update(w13_bias=torch.randn(E, w13.shape[1], device="cuda") / 4, w2_bias=torch.randn(E, H, device="cuda") / 4)
    if c.get("norm"):
        kw["post_expert_norm"] = moe_ops.PostExpertNorm((torch.randn(H, device="cuda") * 0.3).to(c["norm"]), eps=1e-6)
    if c.get("expert_map"):
        # Global ids 0..E-1, of which expert 1 lives on another rank; the local experts in another order.
        kw["expert_map"] = torch.tensor([2, -1, 0, 1], device="cuda", dtype=torch.int32)[:E]
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    return x, w13, w2, tw, ids, kw


def _float64(x, w13, w2, tw, ids, kw):
    return moe_float64(x, w13, w2, tw, ids, intermediate_dtype=torch.bfloat16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 37, 300))
@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_call_runs_the_kernels(name, m):
    """Four launches (the routing plan, GEMM1, GEMM2, the token sum), no warning, the float64 result,
    and bit for bit the output of the same call compiled with the lowering (the same kernels)."""
    _hopper()
    import lowering
    from moe_ops.bench import kernel_launches

    x, w13, w2, tw, ids, kw = _case(name, m)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = moe_ops.fused_experts(x, w13, w2, tw, ids, **kw)
        with moe_ops.value_checks(False):  # the eager id check's own kernels and host sync
            names = kernel_launches(lambda: moe_ops.fused_experts(x, w13, w2, tw, ids, **kw))
    assert not [w for w in caught if "runs the reference" in str(w.message)], "a fallback warned"
    assert len(names) == 4 and "routing_plan" in names[0], names
    assert not any("grouped_mm" in n or "Cijk" in n for n in names), names
    assert relative_error(out, _float64(x, w13, w2, tw, ids, kw)) <= tolerance(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), lowering.enabled(require_kernels=True):
        compiled = torch.compile(moe_ops.fused_experts, fullgraph=True)(x, w13, w2, tw, ids, **kw)
    assert torch.equal(out, compiled)


@pytest.mark.gpu
def test_eager_call_in_grad_mode_runs_the_chain_and_warns(monkeypatch):
    """Weights that require grad, outside no_grad: the op chain (the float64 result), one warning
    naming the reason, and a backward that raises instead of a silently missing gradient."""
    _hopper()
    monkeypatch.setattr(eager_kernels, "_WARNED", set())
    x, w13, w2, tw, ids, kw = _case("silu", 9)
    w13.requires_grad_(True)
    with pytest.warns(UserWarning, match="requires grad"):
        out = moe_ops.fused_experts(x, w13, w2, tw, ids, **kw)
    assert out.requires_grad
    assert relative_error(out.detach(), _float64(x, w13, w2, tw, ids, kw)) <= tolerance(torch.bfloat16)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


@pytest.mark.gpu
def test_eager_call_the_kernels_cannot_serve_warns_once(monkeypatch):
    """Column-major weights (a transposed checkpoint's view) on CUDA: the chain, with one warning that
    names the fix, for any number of calls."""
    _hopper()
    monkeypatch.setattr(eager_kernels, "_WARNED", set())
    x, w13, w2, tw, ids, kw = _case("silu", 9)
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [moe_ops.fused_experts(x, w13, w2, tw, ids, **kw) for _ in range(3)]
    messages = [str(w.message) for w in caught if "fused_experts runs the reference" in str(w.message)]
    assert len(messages) == 1 and "row_major_experts" in messages[0], messages
    for out in outs:
        assert relative_error(out, _float64(x, w13, w2, tw, ids, kw)) <= tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_eager_call_captures_in_a_cuda_graph():
    """The kernel path captured in a CUDA graph: each replay reads the routing copied into the captured
    tensors, and equals an eager call with that routing."""
    _hopper()
    x, w13, w2, tw, ids, kw = _case("silu", 16)
    routings = [_routing(16, "cuda", seed) for seed in (5, 6)]
    with torch.no_grad():
        moe_ops.fused_experts(x, w13, w2, tw, ids, **kw)  # compile the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with moe_ops.value_checks(False), torch.cuda.graph(graph):
            out = moe_ops.fused_experts(x, w13, w2, tw, ids, **kw)
        for new_weights, new_ids in routings:
            tw.copy_(new_weights)
            ids.copy_(new_ids)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe_ops.fused_experts(x, w13, w2, new_weights, new_ids, **kw))


@pytest.mark.gpu
def test_eager_fused_moe_layer_runs_the_kernels():
    """A FusedMoE called eagerly under no_grad: its routing, then the kernels (no torch grouped_mm), and
    the float64 result of its own routing."""
    _hopper()
    from moe_ops.bench import kernel_launches

    layer = moe_ops.FusedMoE(16, 4, 256, 128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(24, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
        names = kernel_launches(lambda: layer(x))
        tw, ids = layer.routing_for(x)
        w13, w2 = layer.float_weights()
        ref = moe_float64(x, w13, w2, tw, ids, activation=layer.activation, intermediate_dtype=torch.bfloat16)
    assert sum("routing_plan" in n for n in names) == 1 and not any("grouped_mm" in n for n in names), names
    assert relative_error(out, ref) <= tolerance(torch.bfloat16)


def _counting_route_op(monkeypatch):
    from moe_ops import routing

    calls = []
    op = routing.route_op

    def counted(*args):
        calls.append(args)
        return op(*args)

    monkeypatch.setattr(routing, "route_op", counted)
    return calls


def test_route_on_the_cpu_goes_through_the_op(monkeypatch):
    calls = _counting_route_op(monkeypatch)
    moe_ops.route(torch.randn(3, 8), 2)
    assert len(calls) == 1


@pytest.mark.gpu
def test_eager_route_on_cuda_skips_the_dispatcher_unless_autograd_needs_the_op(monkeypatch):
    """Eager CUDA routing without autograd calls the op's CUDA impl directly (the same outputs as the
    op); with logits that require grad in grad mode it goes through the op, whose backward raises."""
    _hopper()
    calls = _counting_route_op(monkeypatch)
    logits = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
    kw = dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
              e_score_correction_bias=torch.randn(64, device="cuda"), routed_scaling_factor=2.5)  # fmt: skip
    with torch.no_grad():
        weights, ids = moe_ops.route(logits, 6, **kw)
    assert calls == []
    op_weights, op_ids = torch.ops.moe_ops.route(logits, 6, "sigmoid", True, 8, 4, kw["e_score_correction_bias"], 2.5)
    assert torch.equal(ids, op_ids) and torch.equal(weights, op_weights)
    logits.requires_grad_(True)
    weights, _ = moe_ops.route(logits, 6, **kw)
    assert len(calls) == 1 and weights.requires_grad
    with pytest.raises(RuntimeError, match="no backward"):
        weights.sum().backward()


@pytest.mark.gpu
def test_eager_call_with_no_tokens():
    """M = 0 through the kernel path: an empty [0, H] output in x's dtype, and no fallback."""
    _hopper()
    x, w13, w2, tw, ids, kw = _case("silu", 0)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = moe_ops.fused_experts(x, w13, w2, tw, ids, **kw)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16 and out.device == x.device
    assert not [w for w in caught if "runs the reference" in str(w.message)]


@pytest.mark.gpu
def test_jit_trace_records_the_op_chain():
    """torch.jit.trace records ops: under it fused_experts keeps the chain (the kernels' launches would
    be missing from the trace), so the traced function replays new inputs correctly."""
    _hopper()
    x, w13, w2, tw, ids, kw = _case("silu", 8)
    f = lambda x_, tw_, ids_: moe_ops.fused_experts(x_, w13, w2, tw_, ids_)  # noqa: E731
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings (python values in the trace)
        traced = torch.jit.trace(f, (x, tw, ids), check_trace=False)
    x2, (tw2, ids2) = torch.randn_like(x), _routing(8, "cuda", 9)
    with torch.no_grad():
        out = traced(x2, tw2, ids2)
    assert relative_error(out, _float64(x2, w13, w2, tw2, ids2, {})) <= tolerance(torch.bfloat16)
