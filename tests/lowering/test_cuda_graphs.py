"""CUDA graphs with the MoE pass: torch.compile(mode="reduce-overhead") of a two-layer MoE model in
bf16 replays with new routing on every replay and matches float64, compiles once per captured size and
replays without recompiling, and neither the replays nor the fused ops synchronise with the host.
(Eager calls on sm_90 run the same kernels, eager_kernels.py: the references here are float64.)"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.cudagraph_trees import get_manager

import lowering
import moe_ops
from moe_ops.reference import moe_float64, relative_error, tolerance

from .cases import layer_float64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPE = torch.bfloat16
SIZES = (1, 16, 128)
TOP_K = 2
WARMUP_CALLS = 3  # compile + cudagraph-trees warm-up, recording, a first replay
REPLAYS = 4


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.register_buffer("w13", torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5)
        self.register_buffer("w2", torch.randn(num_experts, hidden, intermediate) / intermediate**0.5)

    def forward(self, x, topk_weights, topk_ids):
        return moe_ops.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


class TwoLayers(nn.Module):
    """Two MoE layers built from fused_experts, with residual connections."""

    def __init__(self, num_experts: int = 8, hidden: int = 256, intermediate: int = 128):
        super().__init__()
        self.layers = nn.ModuleList(Experts(num_experts, hidden, intermediate) for _ in range(2))

    def forward(self, x, topk_weights, topk_ids):
        for layer in self.layers:
            x = x + layer(x, topk_weights, topk_ids)
        return x

    def float64(self, x, topk_weights, topk_ids):
        """forward in float64 (moe_float64 per layer), each layer's output rounded to x's dtype as the
        model stores it."""
        for layer in self.layers:
            out = moe_float64(x, layer.w13, layer.w2, topk_weights, topk_ids, intermediate_dtype=x.dtype)
            x = x + out.to(x.dtype).to(x.device)
        return x.double().cpu()


@pytest.fixture(autouse=True)
def restore_state():
    saved = inductor_config.post_grad_custom_post_pass
    yield
    torch.cuda.set_sync_debug_mode("default")
    lowering.uninstall()
    inductor_config.post_grad_custom_post_pass = saved
    torch._dynamo.reset()  # also drops the cudagraph trees


def sync_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


def recorded_cuda_graphs() -> int:
    """How many CUDA graphs the cudagraph trees of the current device have recorded (as roots)."""
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())


def new_routings(m: int, num_experts: int, count: int):
    """`count` different routings for m tokens, made on the GPU before any replay."""
    return [moe_ops.route(torch.randn(m, num_experts, device="cuda"), TOP_K) for _ in range(count)]


@pytest.mark.gpu
def test_sync_debug_mode_reports_a_sync():
    """Positive control for the no-sync check below: a host sync is recorded by the same filter."""
    t = torch.ones(4, device="cuda")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.sum()  # no sync
            assert not sync_warnings(caught)
            t.sum().item()  # a device-to-host copy: a sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert any("called a synchronizing CUDA operation" in w for w in sync_warnings(caught))


@pytest.mark.gpu
def test_reduce_overhead_replays_match_eager_without_recompiles_or_syncs():
    torch._dynamo.reset()
    model = TwoLayers().to(device="cuda", dtype=DTYPE).eval()
    hidden = model.layers[0].w13.shape[2]
    num_experts = model.layers[0].w13.shape[0]
    reports: list = []
    skips_before = counters["inductor"]["cudagraph_skips"]
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), lowering.enabled() as moe_pass:
        moe_pass.listeners.append(reports)  # the FX graph cache is off, so the pass runs for each size
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
        graphs_before = counters["stats"]["unique_graphs"]
        for i, m in enumerate(SIZES):
            x = torch.randn(m, hidden, device="cuda", dtype=DTYPE)
            routings = new_routings(m, num_experts, 1 + REPLAYS)
            topk_weights, topk_ids = (t.clone() for t in routings[0])
            for _ in range(WARMUP_CALLS):
                torch.compiler.cudagraph_mark_step_begin()
                first = compiled(x, topk_weights, topk_ids).clone()
            assert counters["stats"]["unique_graphs"] - graphs_before == i + 1, f"size {m}: not exactly one compile"
            assert recorded_cuda_graphs() == i + 1, f"size {m}: not captured in one CUDA graph"
            ref = model.float64(x, topk_weights, topk_ids)
            assert relative_error(first, ref) <= tolerance(DTYPE)
            torch.cuda.synchronize()

            outs = []
            # Set outside the recording block: turning the mode on warns once that it is a prototype.
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for new_weights, new_ids in routings[1:]:
                        topk_weights.copy_(new_weights)  # new routing, same tensors and shapes
                        topk_ids.copy_(new_ids)
                        torch.compiler.cudagraph_mark_step_begin()
                        outs.append(compiled(x, topk_weights, topk_ids).clone())
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            assert not sync_warnings(caught), f"size {m}: host syncs during replays: {sync_warnings(caught)}"
            assert counters["stats"]["unique_graphs"] - graphs_before == i + 1, f"size {m}: replays recompiled"
            assert recorded_cuda_graphs() == i + 1, f"size {m}: replays re-recorded instead of replaying"

            for j, ((new_weights, new_ids), out) in enumerate(zip(routings[1:], outs)):
                ref = model.float64(x, new_weights, new_ids)
                err = relative_error(out, ref)
                assert err <= tolerance(DTYPE), f"size {m}, replay {j}: relative error {err}"
            # Each replay read its own routing (not the captured one).
            assert not torch.equal(outs[0], outs[1])
            assert not torch.equal(outs[0], first)

    assert counters["inductor"]["cudagraph_skips"] == skips_before, "Inductor did not use CUDA graphs"
    # One graph per captured size, each with both MoE layers fused.
    assert len(reports) == len(SIZES)
    for _, report in reports:
        assert len(report.fused) == 2 and report.unfused == []


@pytest.mark.gpu
def test_explain_reports_cute_backend_and_kernels_run(monkeypatch):
    """On Hopper with the CuTe DSL available, explain() names the cute backend for both fused ops,
    and the compiled model really calls the kernels (counted through the interface)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need sm_90")
    interface = pytest.importorskip("cute_kernels.interface")
    calls = {"gate_up": 0, "down_reduce": 0}
    for name in calls:
        original = getattr(interface, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(interface, name, counted)
    model = TwoLayers().to(device="cuda", dtype=DTYPE)
    x = torch.randn(16, 256, device="cuda", dtype=DTYPE)
    topk_weights, topk_ids = moe_ops.route(torch.randn(16, 8, device="cuda"), TOP_K)
    explained = lowering.explain(model, x, topk_weights, topk_ids)
    assert len(explained.layers) == 2
    for row in explained.layers:
        assert "gate_up: cute" in row.backend and "down_reduce: cute" in row.backend, row.backend
    assert calls == {"gate_up": 2, "down_reduce": 2}
    with torch.no_grad(), lowering.enabled():
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)(x, topk_weights, topk_ids)
    assert relative_error(compiled, model.float64(x, topk_weights, topk_ids)) <= tolerance(DTYPE)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
def test_compiled_layer_is_four_launches_without_host_sync(m):
    """fused_experts compiled with the lowering on sm_90: the routing plan (one Triton kernel), GEMM1,
    GEMM2 and the per-token sum, and no device-to-host synchronisation while it runs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need sm_90")
    from moe_ops.bench import kernel_launches

    e, k, h, i = 16, 4, 512, 256
    w13 = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).to(DTYPE)
    w2 = (torch.randn(e, h, i, device="cuda") / i**0.5).to(DTYPE)
    x = torch.randn(m, h, device="cuda", dtype=DTYPE)
    topk_weights, topk_ids = moe_ops.route(torch.randn(m, e, device="cuda"), k)
    lowering.install(require_kernels=True)
    layer = torch.compile(moe_ops.fused_experts, fullgraph=True)
    layer(x, w13, w2, topk_weights, topk_ids)  # compile outside the checked call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    out = layer(x, w13, w2, topk_weights, topk_ids)
    torch.cuda.set_sync_debug_mode("default")
    names = kernel_launches(lambda: layer(x, w13, w2, topk_weights, topk_ids))
    assert len(names) == 4, names
    assert "routing_plan" in names[0], names
    ref = moe_float64(x, w13, w2, topk_weights, topk_ids, intermediate_dtype=DTYPE)
    assert relative_error(out, ref) <= tolerance(DTYPE)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_fused_layer_under_inference_mode(mode):
    """A FusedMoE compiled with the pass and run under torch.inference_mode (how inference servers
    call a model), without and with CUDA graphs: the kernels run (require_kernels) and every call,
    each with new tokens, matches float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need sm_90")
    torch.manual_seed(0)
    layer = moe_ops.FusedMoE(16, 4, 512, 256, dtype=DTYPE, device="cuda")
    lowering.install(require_kernels=True)
    compiled = torch.compile(layer, mode=mode, fullgraph=True, dynamic=False)
    for _ in range(WARMUP_CALLS + REPLAYS):
        x = torch.randn(8, 512, device="cuda", dtype=DTYPE)
        with torch.inference_mode():
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
        assert out.is_inference()
        with torch.no_grad():
            assert relative_error(out, layer_float64(layer, x)) <= tolerance(DTYPE)
