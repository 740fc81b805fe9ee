"""explain()'s per-layer table for chains a fused_experts layer cannot write (its two GEMMs quantized
differently: one weight quantized and the other not, only GEMM2's input quantized, GEMM1 writing
another dtype), its backend column under require_kernels and for the layer's device, and explain()
itself beside another listener of the pass, past a warm FX graph cache and with dynamic=False."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowering
import moe_ops
from moe_ops import Activation
from moe_ops import quant as Q
from moe_ops.activation import activation as activation_op
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant.quantize import quantize
from moe_ops.reduce import weighted_reduce

from . import cases
from .test_pass import _meta_down_reduce_args, _meta_gate_up_args, _one_layer_verdict, inputs

NONE = [-1, -1]


class MixedRecipes(nn.Module):
    """A chain written with the primitive ops (H=128, E=4, as _one_layer_verdict's inputs) whose GEMMs
    differ: `w13_int4` quantizes GEMM1's weights only (int4 1x64 with zero points, GEMM2's stay
    float32), `act_fp8` quantizes GEMM2's input only (fp8 per row, so gate_up re-quantizes its output
    while x stays unquantized), `inter_bf16` has GEMM1 write bf16 (so the activation and GEMM2 read
    bf16) while GEMM2 writes x's float32."""

    def __init__(self, w13_int4: bool, act_fp8: bool, inter_bf16: bool = False):
        super().__init__()
        w13, w2 = cases.float_weights(4, 128, 64)
        self.w13_int4, self.act_fp8, self.inter_bf16 = w13_int4, act_fp8, inter_bf16
        scale = zero = None
        if w13_int4:
            scheme = Q.QuantScheme(None, Q.WeightQuant("int4", Q.GroupShape(1, 64), zero_point=True))
            w13, _, config = Q.quantize_weights(scheme, w13, w2)
            scale, zero = config.gemm("13")["w_scale"], config.gemm("13")["w_zero"]
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", scale)
        self.register_buffer("w13_zero", zero)
        self.register_buffer("w2", w2)

    def forward(self, x, topk_weights, topk_ids):
        if x.shape[1] != self.w2.shape[1]:
            raise ValueError(f"x: expected [M, {self.w2.shape[1]}], got {tuple(x.shape)}")
        offsets, gather_idx, inverse = routing_plan(topk_ids, 4, None)
        w_dtype, w_group = ("int4", [1, 64]) if self.w13_int4 else ("none", NONE)
        h = grouped_gemm(x, None, None, "none", NONE, self.w13, self.w13_scale, None, self.w13_zero, w_dtype, w_group,
                         None, offsets, gather_idx, torch.bfloat16 if self.inter_bf16 else x.dtype)  # fmt: skip
        a = activation_op(h, "silu", 1.702, 7.0, False)
        s, a_dtype, a_group = None, "none", NONE
        if self.act_fp8:
            a_dtype, a_group = "fp8", [1, -1]
            a, s = quantize(a, a_dtype, a_group, None, None)
        y = grouped_gemm(a, s, None, a_dtype, a_group, self.w2, None, None, None, "none", NONE, None, offsets, None, x.dtype)
        return weighted_reduce(y, topk_weights, inverse, offsets)


@pytest.mark.parametrize(
    "w13_int4, act_fp8, inter_bf16, recipe, dtypes",
    [
        # Each GEMM's weight quantization: showing w13's alone read as if w2 were int4 too. The dtypes'
        # w is GEMM1's weights' storage (int4 packed two to a byte).
        (True, False, False, "act=silu; a-quant=none; w-quant=int4 1x64 zero-point (w13), none (w2); re-quant=none; bias=no",
         "x f32, w u8, out f32"),
        # The re-quantization is gate_up's out_quant_* (GEMM2's input), not its a-quant (GEMM1's input).
        (False, True, False, "act=silu; a-quant=none; w-quant=none; re-quant=fp8 per-row; bias=no", "x f32, w f32, out f32"),
        # out is the layer's output, down_reduce's out_dtype: gate_up's (the intermediate's) read bf16.
        # The pass must give gate_up GEMM1's out_dtype and down_reduce GEMM2's: with GEMM2's for both, the
        # intermediate stayed float32 and compiled differed from eager by bf16's rounding.
        (False, False, True, "act=silu; a-quant=none; w-quant=none; re-quant=none; bias=no", "x f32, w f32, out f32"),
    ],
    ids=["w13_int4_only", "gemm2_input_fp8_only", "intermediate_bf16"],
)  # fmt: skip
def test_explain_recipe_of_gemms_quantized_differently(w13_int4, act_fp8, inter_bf16, recipe, dtypes):
    """The fused layer's recipe and dtypes text read each GEMM's own arguments; the layer is fused and
    compiled equals eager."""
    model = MixedRecipes(w13_int4, act_fp8, inter_bf16)
    _one_layer_verdict(model, fusable=True)
    (row,) = lowering.explain(model, *inputs(128, 4, torch.float32)).layers
    assert (row.recipe, row.dtypes) == (recipe, dtypes)


def test_explain_backend_column_under_require_kernels(monkeypatch):
    """With require_kernels set, a CUDA layer no kernel serves would raise when it runs; explain(), which
    only reports, must write that in the backend column ('none (...)') rather than raise itself. (On a
    CPU machine: the device check is stubbed to a Hopper GPU, fake tensors need no memory.)"""
    from cute_kernels import interface
    from lowering import backend
    from lowering.explain import _backend_text

    monkeypatch.setattr(interface, "device_support", lambda device: (True, "a Hopper GPU"))
    monkeypatch.setitem(backend.REQUIRE_KERNELS, "value", True)
    cuda = torch.device("cuda")
    assert _backend_text("gate_up", _meta_gate_up_args(), cuda).startswith("gate_up: cute (")
    text = _backend_text("gate_up", _meta_gate_up_args(out_dtype=torch.float32), cuda)
    assert text.startswith("gate_up: none (moe_ops::gate_up: no CuTe DSL kernel serves this recipe (output in torch.float32")
    assert text.endswith("and require_kernels is set)")


def _fused_layer_on(device: str):
    """A PassReport of one fused layer whose tensors live on `device`: gate_up and down_reduce nodes
    over placeholders holding fake tensors of _meta_gate_up_args' and _meta_down_reduce_args' shapes
    (a fake tensor may claim a CUDA device on a machine without one)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from lowering.graph_pass import Fused, PassReport

    graph, mode = torch.fx.Graph(), FakeTensorMode()

    def node(op, args: dict):
        values = []
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                value, fake = graph.placeholder(f"{op.__name__}_{name}"), FakeTensor(mode, value, torch.device(device))
                value.meta["val"] = fake
            values.append(value)
        return graph.call_function(op, tuple(values))

    ops = torch.ops.moe_ops
    fused = Fused(node(ops.gate_up.default, _meta_gate_up_args()), node(ops.down_reduce.default, _meta_down_reduce_args()),
                  SimpleNamespace(position=0))  # fmt: skip
    return PassReport([fused], [])


def test_explain_names_the_backend_of_the_layers_device(monkeypatch):
    """The backend column is chosen for the device the layer's tensors are on: a CUDA layer of a recipe
    the kernels serve names them, the same layer on the CPU the reference. (On a CPU machine: the device
    check is stubbed to a Hopper GPU, fake tensors need no memory.)"""
    from cute_kernels import interface
    from lowering.explain import _rows

    monkeypatch.setattr(interface, "device_support", lambda device: (True, "a Hopper GPU"))
    (cuda,) = _rows(_fused_layer_on("cuda"), 0)
    gate_up, down_reduce = cuda.backend.split("; ")
    assert gate_up.startswith("gate_up: cute (") and down_reduce.startswith("down_reduce: cute (")
    (cpu,) = _rows(_fused_layer_on("cpu"), 0)
    assert cpu.backend.startswith("gate_up: reference (cpu: ") and "down_reduce: reference (cpu: " in cpu.backend
    assert cuda.dtypes == cpu.dtypes == "x bf16, w bf16, out bf16"


@pytest.fixture
def bf16_layer():
    """The bf16_swiglu case and inputs of 7 tokens: (model, inputs)."""
    model, h, e, dtype = cases.CASES["bf16_swiglu"]()
    return model, inputs(h, e, dtype)


def _fused_rows(explained: lowering.Explanation) -> list[str]:
    return [row.fused for row in explained.layers]


def test_explain_beside_another_listener_of_the_installed_pass(bf16_layer):
    """explain() listens on the installed pass beside a listener already there (the user's own): both get
    the layer's report, and afterwards only the user's remains (one left behind would keep every later
    compile's graphs alive in its list). With reports sent to the first listener only, explain() saw no
    layer at all."""
    model, args = bf16_layer
    moe_pass, mine = lowering.install(), []
    moe_pass.listeners.append(mine)
    try:
        assert _fused_rows(lowering.explain(model, *args)) == ["gate_up + down_reduce"]
        assert lowering.installed() is moe_pass and moe_pass.listeners == [mine]
        assert [len(report.fused) for _, report in mine] == [1]
    finally:
        lowering.uninstall()


def test_explain_runs_the_pass_past_a_warm_fx_graph_cache(bf16_layer, tmp_path, monkeypatch):
    """With Inductor's FX graph cache on (its default), a second explain() of the same layer would find the
    first one's fused graph in the cache, skip the pass and report no layer at all; explain() turns the
    cache off for its own compile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a fresh, empty FX graph cache
    model, args = bf16_layer
    with torch._inductor.config.patch(fx_graph_cache=True):
        first, second = lowering.explain(model, *args), lowering.explain(model, *args)
    assert _fused_rows(first) == _fused_rows(second) == ["gate_up + down_reduce"]
    assert second.graph == first.graph and "moe_ops.gate_up(" in second.graph


def test_explain_passes_dynamic_on(bf16_layer):
    """explain(dynamic=False) compiles for the example's sizes: its graph shows 7 tokens where the default
    (dynamic=True) shows a symbol."""
    model, args = bf16_layer
    static, dynamic = lowering.explain(model, *args, dynamic=False).graph, lowering.explain(model, *args).graph
    assert "bf16[7, 128]" in static and "S0" not in static
    assert "bf16[S0, 128]" in dynamic and "bf16[7, 128]" not in dynamic


def test_recording_reports_what_compiles_inside_the_block(bf16_layer, tmp_path, monkeypatch):
    """recording() sees every graph compiled inside it, also past a warm FX graph cache, and nothing
    compiled after it; the pass is uninstalled again at its end. Its rows are explain()'s. (Dynamo's
    own cache is reset before each compile: a frame Dynamo already compiled is not compiled again.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a fresh, empty FX graph cache

    def compile_and_run():
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, fullgraph=True, dynamic=True)(*args)

    model, args = bf16_layer
    with torch._inductor.config.patch(fx_graph_cache=True):
        with lowering.enabled():
            compile_and_run()  # warms the FX graph cache with this very graph
        with lowering.recording() as fused:
            assert lowering.installed() is not None
            compile_and_run()
            assert fused.layers == []  # filled when the block ends
        assert lowering.installed() is None
        compile_and_run()
    expected = lowering.explain(model, *args)
    assert fused.layers == expected.layers and fused.graph == expected.graph
    assert len(fused.graphs) == 1 and fused.code_lines == []


@pytest.mark.parametrize(
    "activation, text",
    [
        (Activation("silu"), "act=silu;"),
        (Activation("swigluoai", alpha=1.25, limit=3.5, interleaved=True), "act=swigluoai(alpha=1.25, limit=3.5), interleaved;"),
        (Activation("silu_clamped", limit=0.5), "act=silu_clamped(limit=0.5);"),
        (Activation("swiglu_softcapped"), "act=swiglu_softcapped(alpha=4.0, limit=25.0);"),
    ],
    ids=["silu", "swigluoai", "silu_clamped", "swiglu_softcapped"],
)  # fmt: skip
def test_explain_names_the_parameters_each_activation_reads(activation, text):
    """The recipe shows the activation's alpha and limit where the kind reads them (moe_ops.activation.
    PARAMETERS) and neither where it does not: silu_clamped's limit, without swigluoai's alpha."""
    torch.manual_seed(0)
    layer = moe_ops.FusedMoE(4, 2, 128, 64, activation=activation, dtype=torch.float32)
    (row,) = lowering.explain(layer, torch.randn(5, 128)).layers
    assert row.recipe.startswith(text + " a-quant=none"), row.recipe


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (("model",), {}, TypeError, r"fn_or_module: expected a function or an nn.Module, got str"),
        ((lambda x: x, torch.ones(2)), {"dynamic": "yes"}, TypeError, r"dynamic: expected a bool or None, got str 'yes'"),
    ],
    ids=["not_callable", "dynamic_str"],
)
def test_explain_rejects_what_torch_compile_asserts_on(args, kwargs, exc, match):
    # torch.compile refused both with a bare AssertionError.
    with pytest.raises(exc, match=match):
        lowering.explain(*args, **kwargs)
