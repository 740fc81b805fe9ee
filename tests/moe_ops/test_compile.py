"""torch.compile(fullgraph=True, dynamic=True) of models using moe_ops.FusedMoE: one graph for every
token count, the moe_ops op chain in the captured graph, and outputs equal to eager (fullgraph=True
also means no graph breaks: a break would raise)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_ops
from moe_ops.quant import PER_CHANNEL, PER_TENSOR, PER_TOKEN, ActivationQuant, GroupShape, QuantScheme, WeightQuant
from moe_ops.reference import moe_float64, relative_error, tolerance

H, I, E, TOP_K = 64, 32, 8, 2
TOKENS = (1, 7, 64, 300)


class Model(nn.Module):
    """Linear -> FusedMoE -> Linear."""

    def __init__(self, quant_config=None):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = moe_ops.FusedMoE(E, TOP_K, H, I, quant_config=quant_config, dtype=torch.float32)
        self.out = nn.Linear(H, H)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _reset():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counters alone


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _compiled_entries(model: nn.Module) -> int:
    """How many compiled versions of model.forward dynamo holds (1 + recompilations)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(type(model).forward.__code__))


class Recorder:
    """A backend that records every graph dynamo hands it, then runs it with `inner`. Dynamo may hand
    over a graph and then restart the analysis (its scalar-tensorify pass specialises the float
    arguments), so one compilation can record more than one graph: count compilations with
    _unique_graphs / _compiled_entries, and read the op chain from the last graph."""

    def __init__(self, inner="eager"):
        self.inner = inner
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        if self.inner == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)
        return gm.forward


def _moe_ops_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The moe_ops op names called by gm's graph, in graph order."""
    names = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            qualified = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
            ns, _, name = qualified.partition("::")
            if ns == "moe_ops":
                names.append(name.split(".")[0])
    return names


def _float64_model(model: Model, x: torch.Tensor) -> torch.Tensor:
    """The whole model recomputed in float64 (the MoE by moe_float64, routing taken from the layer)."""
    with torch.no_grad():
        h = model.inp(x)
        tw, ti = model.moe.routing_for(h)
        w13, w2 = model.moe.float_weights()
        y = moe_float64(h, w13, w2, tw, ti)
        return y @ model.out.weight.double().T + model.out.bias.double()


@torch.no_grad()
def test_dynamic_one_graph_for_all_token_counts():
    _reset()
    model = Model().eval()
    backend = Recorder("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    tol = tolerance(torch.float32)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for i, m in enumerate(TOKENS):
            x = torch.randn(m, H)
            if i == 1:
                torch.compiler.set_stance("fail_on_recompile")  # any recompile from here on raises
            try:
                out = compiled(x)
            finally:
                torch.compiler.set_stance("default")
            eager = model(x)
            assert out.shape == (m, H)
            assert relative_error(out, eager) <= tol, m
            assert relative_error(out, _float64_model(model, x)) <= tol, m
    assert _unique_graphs() == 1
    assert _compiled_entries(model) == 1


@torch.no_grad()
def test_unbacked_token_count_one_graph():
    """The README's other way to one graph for every token count: mark the token dimension unbacked.
    It failed for every M ("Could not guard on data-dependent expression 64*u0 > 0"): argument checks
    asked numel() > 0 before anything else."""
    _reset()
    model = Model().eval()
    backend = Recorder("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    tol = tolerance(torch.float32)
    for i, m in enumerate(TOKENS):
        x = torch.randn(m, H)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(x)
        finally:
            torch.compiler.set_stance("default")
        assert out.shape == (m, H)
        assert relative_error(out, model(x)) <= tol, m
    assert _unique_graphs() == 1


@torch.no_grad()
def test_dynamic_default_specialisation_starting_at_seven_tokens():
    """Without backed_size_oblivious, dynamic=True still gives one graph for 7, 64, 300 tokens; a
    single token then specialises (as the README says), with a correct result."""
    _reset()
    model = Model().eval()
    backend = Recorder("eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    tol = tolerance(torch.float32)
    for m in (7, 64, 300):
        x = torch.randn(m, H)
        assert relative_error(compiled(x), model(x)) <= tol
    assert _unique_graphs() == 1
    assert _compiled_entries(model) == 1
    x = torch.randn(1, H)
    assert relative_error(compiled(x), model(x)) <= tol
    assert _unique_graphs() == 2  # size 1 is specialised by default
    assert _compiled_entries(model) == 2


@torch.no_grad()
def test_zero_tokens_compiled():
    _reset()
    model = Model().eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        assert compiled(torch.randn(5, H)).shape == (5, H)
        out = compiled(torch.randn(0, H))
    assert out.shape == (0, H)


FP8_PER_TOKEN = QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL))


@pytest.mark.parametrize(
    "scheme, expected",
    [
        (None, ["router_linear", "route", "routing_plan", "grouped_gemm", "activation", "grouped_gemm", "weighted_reduce"]),
        (
            FP8_PER_TOKEN,
            ["router_linear", "route", "routing_plan", "quantize", "grouped_gemm", "activation", "quantize", "grouped_gemm", "weighted_reduce"],
        ),
        (
            QuantScheme(None, WeightQuant("int4", GroupShape(1, 32))),  # weight-only: no activation quantization
            ["router_linear", "route", "routing_plan", "grouped_gemm", "activation", "grouped_gemm", "weighted_reduce"],
        ),
    ],
    ids=["unquantized", "fp8_w8a8_per_token", "int4_w4a16"],
)
@torch.no_grad()
def test_graph_holds_the_op_chain(scheme, expected):
    _reset()
    model = Model(quant_config=scheme).eval()
    backend = Recorder("eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    x = torch.randn(9, H)
    out = compiled(x)
    assert _unique_graphs() == 1
    assert _moe_ops_calls(backend.graphs[-1]) == expected
    # the graph computes what eager does (the recorded graph is what ran)
    assert relative_error(out, model(x)) <= tolerance(torch.float32)


@torch.no_grad()
def test_aot_graph_keeps_the_ops_opaque():
    """After AOT autograd (what inductor lowers), the moe_ops ops are still single nodes."""
    _reset()
    model = Model(quant_config=FP8_PER_TOKEN).eval()
    aot_graphs = []

    def fw_compiler(gm, example_inputs):
        aot_graphs.append(gm)
        return gm.forward

    from torch._dynamo.backends.common import aot_autograd

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=aot_autograd(fw_compiler=fw_compiler))
    x = torch.randn(5, H)
    out = compiled(x)
    assert _unique_graphs() == 1
    assert _moe_ops_calls(aot_graphs[-1]) == [
        "router_linear", "route", "routing_plan", "quantize", "grouped_gemm", "activation", "quantize", "grouped_gemm", "weighted_reduce",
    ]  # fmt: skip
    assert relative_error(out, model(x)) <= tolerance(torch.float32, "fp8", fake_quant=True)


SCHEMES = {
    "fp8_w8a8_per_tensor_static": QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR)),
    "fp8_w8a8_per_token": FP8_PER_TOKEN,
    "fp8_w8a8_block": QuantScheme(ActivationQuant("fp8", GroupShape(1, 32)), WeightQuant("fp8", GroupShape(32, 32))),
    "int8_w8a8": QuantScheme(ActivationQuant("int8", PER_TOKEN), WeightQuant("int8", PER_CHANNEL)),
    "int4_w4a16_zp": QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True)),
    "nvfp4_w4a4": QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16))),
    "mxfp4_w4a8": QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("mxfp4", GroupShape(1, 32))),
}
# Two schemes go through inductor (the default backend); the rest through aot_eager, which traces the
# same fake impls and functionalization at a fraction of the compile time.
INDUCTOR = {"fp8_w8a8_block", "nvfp4_w4a4"}


@pytest.mark.parametrize("name", list(SCHEMES))
@torch.no_grad()
def test_quantized_schemes_compile_and_match_eager(name):
    _reset()
    scheme = SCHEMES[name]
    assert scheme.name == name.removesuffix("_static").removesuffix("_zp")
    model = Model(quant_config=scheme).eval()
    backend = Recorder("inductor" if name in INDUCTOR else "aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    aq = scheme.activation.dtype if scheme.activation is not None else None
    # Eager and compiled quantize the same activations; an element may round differently at a tie.
    tol = tolerance(torch.float32, aq, fake_quant=True)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for m in (1, 33):
            x = torch.randn(m, H)
            out = compiled(x)
            assert out.shape == (m, H)
            assert torch.isfinite(out).all()
            assert relative_error(out, model(x)) <= tol, m
    assert _unique_graphs() == 1
    assert _compiled_entries(model) == 1
    quantizes = _moe_ops_calls(backend.graphs[-1]).count("quantize")
    assert quantizes == (0 if aq is None else 2)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_bad_input_under_compile_keeps_its_message(fullgraph):
    """The argument checks run while Dynamo traces. Without fullgraph the TypeError itself comes
    through; with fullgraph Dynamo reports it as Unsupported ("Observed exception"), whose text still
    names the argument, the value and what is allowed (README, Errors)."""
    _reset()
    layer = moe_ops.FusedMoE(E, TOP_K, H, I, dtype=torch.float32)
    compiled = torch.compile(layer, fullgraph=fullgraph, dynamic=True)
    x = torch.randn(5, H, dtype=torch.float64)
    expected = TypeError if not fullgraph else torch._dynamo.exc.Unsupported
    message = "hidden_states: dtype torch.float64 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16"
    with torch.no_grad(), pytest.raises(expected) as info:
        compiled(x)
    assert message in str(info.value)


EXPORT_CHAINS = {
    "unquantized": (None, ["router_linear", "route", "routing_plan", "grouped_gemm", "activation", "grouped_gemm", "weighted_reduce"]),
    "fp8_w8a8_per_token": (FP8_PER_TOKEN, [
        "router_linear", "route", "routing_plan", "quantize", "grouped_gemm", "activation", "quantize", "grouped_gemm", "weighted_reduce",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXPORT_CHAINS))
@torch.no_grad()
def test_torch_export_with_dynamic_tokens(name):
    """torch.export of a model with FusedMoE and a dynamic token count: the exported program holds the
    op chain as single nodes and, run at other token counts (1 and 300, exported at 9), computes what
    eager does."""
    scheme, chain = EXPORT_CHAINS[name]
    model = Model(quant_config=scheme).eval()
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    program = torch.export.export(model, (torch.randn(9, H),), dynamic_shapes=({0: tokens},))
    assert _moe_ops_calls(program.graph_module) == chain
    for m in (1, 300):
        x = torch.randn(m, H)
        err = relative_error(program.module()(x), model(x))
        assert err <= tolerance(torch.float32, "fp8" if scheme else None, fake_quant=scheme is not None), (m, err)
