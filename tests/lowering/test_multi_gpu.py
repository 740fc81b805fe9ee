"""The layer on a GPU that is not the current device. A model spread over GPUs in one process
(transformers' device_map="auto", a pipeline of stages) calls each MoE layer with the current device
left where it was; the routing plan (Triton) and the CuTe DSL kernels must still launch on the
tensors' GPU and its current stream. Needs two Hopper GPUs:
python -m pytest -m gpu tests/lowering/test_multi_gpu.py"""
from __future__ import annotations

import warnings

import pytest
import torch

import lowering
import moe_ops
from lowering.fused_ops import down_reduce, gate_up
from moe_ops.plan import routing_plan
from moe_ops.routing import _route, route_op
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..decoders import decode_weight
from .cases import layer_float64, on
from .test_pass import E, build_layer

pytestmark = pytest.mark.gpu
OTHER = torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def _two_hoppers():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; {torch.cuda.device_count()} visible")
    if any(torch.cuda.get_device_capability(i) != (9, 0) for i in range(2)):
        pytest.skip("the CuTe DSL kernels need Hopper (sm_90) GPUs")
    with torch.cuda.device(0):
        yield


@pytest.mark.parametrize("m", (1, 300, 5000))  # both plan kernels: by keys (P <= 4096), by blocks
def test_plan_on_the_other_gpu(m):
    """routing_plan of ids made on cuda:1 just before (so a plan launched on cuda:0's stream could
    read them unwritten), called with cuda:0 current: the CPU reference's plan, bit for bit."""
    ids = torch.randint(0, E, (m, 2), device=OTHER)
    got = routing_plan(ids, E, None)
    want = routing_plan(ids.cpu(), E, None)
    assert all(g.device == OTHER for g in got)
    for name, g, w in zip(("expert_offsets", "gather_idx", "inverse"), got, want):
        assert torch.equal(g.cpu(), w), f"{name} differs from the CPU plan"


@pytest.mark.parametrize("groups", (0, 8), ids=("softmax", "grouped"))
def test_route_on_the_other_gpu(groups):
    """The route op's kernel on logits made on cuda:1 just before, cuda:0 current: the reference ops'
    routing on cuda:1 (ids exactly, weights to float32 rounding)."""
    logits = torch.randn(300, 64, device=OTHER) * 2
    bias = torch.randn(64, device=OTHER) * 0.1 if groups else None
    args = (logits, 6, "sigmoid" if groups else "softmax", True, groups, 3 if groups else 0, bias, 2.5 if groups else 1.0)
    weights, ids = route_op(*args)
    want_weights, want_ids = _route(*args)
    assert weights.device == ids.device == OTHER
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


@pytest.mark.parametrize("m", (1, 300))
def test_kernel_ops_on_the_other_gpu(m):
    """gate_up and down_reduce on cuda:1 with cuda:0 current, require_kernels set (a reference
    fallback would raise): the layer they compute against moe_float64."""
    gu, dr, c = build_layer("bf16", m)
    gu = on(gu, OTHER)
    with lowering.enabled(require_kernels=True):
        inter, _ = gate_up(*gu)
        out = down_reduce(*on([inter, *dr[1:]], OTHER))
    assert out.device == OTHER
    ref = moe_float64(c["x"], decode_weight(c["q13"], None), decode_weight(c["q2"], None), c["topk_weights"], c["topk_ids"], activation=c["act"])
    err = relative_error(out.cpu(), ref)
    assert err <= tolerance(c["dtype"]), f"relative error {err} against moe_float64"


class _TwoStages(torch.nn.Module):
    """One MoE layer per GPU, the activations moved between them, as a model split over two GPUs;
    returns both layers' outputs."""

    def __init__(self, **shape):
        super().__init__()
        self.first = moe_ops.FusedMoE(**shape, dtype=torch.bfloat16, device="cuda:0")
        self.second = moe_ops.FusedMoE(**shape, dtype=torch.bfloat16, device=OTHER)

    def forward(self, x):
        h = self.first(x)
        return h, self.second(h.to(OTHER))


SHAPE = dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128)


def _check(layer: moe_ops.FusedMoE, x: torch.Tensor, out: torch.Tensor) -> None:
    """out, the layer's output for x, on the layer's GPU and within bf16's tolerance of moe_float64."""
    assert out.device == x.device == layer.w13.device
    err = relative_error(out, layer_float64(layer, x))
    assert err <= tolerance(torch.bfloat16), f"relative error {err} against moe_float64 on {x.device}"


@pytest.mark.parametrize("m", (1, 64))
@pytest.mark.parametrize("mode", ("eager", "compiled per layer", "compiled whole"))
def test_model_over_two_gpus(mode, m):
    """A model with a layer on each GPU, cuda:0 current, eager (the kernels through fused_experts,
    eager_kernels.py: no fallback warning) or compiled with the lowering (kernels required): each
    layer's output against moe_float64 of its own input."""
    model = _TwoStages(**SHAPE)
    first, second = model.first, model.second
    if mode == "compiled per layer":
        model.first = torch.compile(model.first, fullgraph=True, dynamic=True)
        model.second = torch.compile(model.second, fullgraph=True, dynamic=True)
    run = torch.compile(model, fullgraph=True, dynamic=True) if mode == "compiled whole" else model
    x = torch.randn(m, SHAPE["hidden_size"], device="cuda:0", dtype=torch.bfloat16)
    with torch.no_grad(), lowering.enabled(require_kernels=mode != "eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h, out = run(x)
        _check(first, x, h)
        _check(second, h.to(OTHER), out)
    assert not [str(w.message) for w in caught if "runs the reference" in str(w.message)]


def test_cuda_graphs_per_layer_over_two_gpus():
    """Each layer compiled with mode="reduce-overhead" (CUDA graphs recorded and replayed on its own
    GPU's capture stream), cuda:0 current: four calls with fresh inputs (warm-up, recording, replays),
    each layer's output against moe_float64 every time."""
    model = _TwoStages(**SHAPE)
    first, second = model.first, model.second
    model.first = torch.compile(first, mode="reduce-overhead", fullgraph=True)
    model.second = torch.compile(second, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), lowering.enabled(require_kernels=True):
        for _ in range(4):
            x = torch.randn(64, SHAPE["hidden_size"], device="cuda:0", dtype=torch.bfloat16)
            h, out = model(x)
            h, out = h.clone(), out.clone()  # the next replay overwrites the graphs' outputs
            _check(first, x, h)
            _check(second, h.to(OTHER), out)


QUANT_SCHEMES = {
    "fp8_w8a8_block": ("fp8", (1, 128), "fp8", (128, 128)),
    "mxfp4_w4a16": (None, None, "mxfp4", (1, 32)),
    # On the fp8 codes (fp8_kernels.py): the per-tensor amax, the quantizing and the fp8 kernels.
    "fp8_w8a8_per_tensor": ("fp8", (-1, -1), "fp8", (-1, -1)),
}


@pytest.mark.parametrize("scheme", list(QUANT_SCHEMES))
def test_quantized_layer_on_the_other_gpu(scheme):
    """A quantized FusedMoE on cuda:1 with cuda:0 current: the dequantizing path's Triton launches (the
    activations' quantizing, the slots, the decoding), the fp8 path's (the per-tensor amax) and the
    kernels all run on cuda:1, and the output equals the same layer's on cuda:1 made current."""
    from moe_ops.quant import ActivationQuant, GroupShape, QuantScheme, WeightQuant

    a_dtype, a_group, w_dtype, w_group = QUANT_SCHEMES[scheme]
    activation = ActivationQuant(a_dtype, GroupShape(*a_group)) if a_dtype else None
    quant = QuantScheme(activation, WeightQuant(w_dtype, GroupShape(*w_group)))
    layer = moe_ops.FusedMoE(16, 2, 256, 128, dtype=torch.bfloat16, device=OTHER, quant_config=quant)
    x = torch.randn(37, 256, device=OTHER, dtype=torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = layer(x)
        with torch.cuda.device(OTHER):
            want = layer(x)
    assert not [w for w in caught if "runs the reference" in str(w.message)], "a fallback warned"
    assert got.device == OTHER and torch.isfinite(got).all()
    assert torch.equal(got, want)
