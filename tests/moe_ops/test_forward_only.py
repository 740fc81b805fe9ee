"""Grad mode: the ops are forward-only (moe_ops/forward_only.py). In grad mode they compute what they
compute under no_grad, eagerly and compiled (fullgraph, dynamic), and a backward through them raises a
RuntimeError naming the op, never a wrong gradient."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops.activation import activation as activation_op
from moe_ops.expert_norm import post_expert_norm
from moe_ops.forward_only import no_backward
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant.quantize import quantize
from moe_ops.reduce import weighted_reduce
from moe_ops.reference import moe_float64, relative_error, tolerance
from moe_ops.router import router_linear_op
from moe_ops.routing import route_op

M, K, E, H, I = 5, 2, 4, 32, 16


def _plan(ids):
    return routing_plan(ids, E, None)


def _route_args():
    return (torch.randn(M, E, requires_grad=True), K, "softmax", True, 0, 0, None, 1.0), 0


def _router_linear_args():
    return (torch.randn(M, H, requires_grad=True), torch.randn(E, H, requires_grad=True), torch.randn(E, requires_grad=True)), 0


def _quantize_args():
    return (torch.randn(M, H, requires_grad=True), "fp8", [1, -1], None, None), 0


def _grouped_gemm_args():
    offsets, gather, _ = _plan(torch.randint(0, E, (M, K), dtype=torch.int32))
    a = torch.randn(M, H, requires_grad=True)
    w = torch.randn(E, 2 * I, H, requires_grad=True)
    return (a, None, None, "none", [-1, -1], w, None, None, None, "none", [-1, -1], None, offsets, gather, torch.float32), 0


def _activation_args():
    return (torch.randn(M * K, 2 * I, requires_grad=True), "silu", 1.702, 7.0, False), 0


def _weighted_reduce_args():
    offsets, _, inverse = _plan(torch.randint(0, E, (M, K), dtype=torch.int32))
    topk_weights = torch.rand(M, K, requires_grad=True)
    return (torch.randn(M * K, H, requires_grad=True), topk_weights, inverse, offsets), 0


def _post_expert_norm_args():
    return (torch.randn(M * K, H, requires_grad=True), torch.randn(H, requires_grad=True), 1e-6), 0


# op -> (its args with float inputs requiring grad, the output the test sums for backward)
OPS = {
    "route": (route_op, _route_args),
    "router_linear": (router_linear_op, _router_linear_args),
    "quantize": (quantize, _quantize_args),
    "grouped_gemm": (grouped_gemm, _grouped_gemm_args),
    "activation": (activation_op, _activation_args),
    "weighted_reduce": (weighted_reduce, _weighted_reduce_args),
    "post_expert_norm": (post_expert_norm, _post_expert_norm_args),
}


def _first(out, index):
    return out[index] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_in_grad_mode_computes_as_under_no_grad_and_backward_raises(name):
    op, make = OPS[name]
    args, index = make()
    with torch.no_grad():
        want = _first(op(*args), index)
    got = _first(op(*args), index)
    assert torch.equal(got.float(), want.float())
    if not got.requires_grad:  # quantize's fp8 output is not differentiable; its scale is
        got = op(*args)[1]
    assert got.requires_grad
    with pytest.raises(RuntimeError, match=rf"moe_ops::{name}: no backward; the moe_ops ops are forward-only"):
        got.float().sum().backward()


def test_no_backward_opcheck_where_it_can_run():
    """opcheck's other tests run the op for real, and its real impl is the raise: they fail with the op's own
    message and nothing else (its fake impl is checked below, its use in the other ops' backward above)."""
    args = (torch.randn(3, 4), "moe_ops::x", [7, 2], torch.bfloat16)
    torch.library.opcheck(no_backward, args, test_utils=("test_autograd_registration",))
    for test in ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"):
        with pytest.raises(Exception, match=rf"{test} failed with moe_ops::x: no backward; the moe_ops ops are forward-only"):
            torch.library.opcheck(no_backward, args, test_utils=(test,))


def test_no_backward_fake_has_the_input_shape_and_dtype():
    with FakeTensorMode() as mode:
        grad = mode.from_tensor(torch.randn(3, 4))
        out = no_backward(grad, "moe_ops::x", [7, 2], torch.bfloat16)
    assert tuple(out.shape) == (7, 2) and out.dtype == torch.bfloat16


def test_compiled_layer_in_grad_mode_matches_float64_and_backward_raises():
    """A router weight that requires grad (nn.Linear's default) and an input that does: the layer compiles
    fullgraph in grad mode and computes what it computes under no_grad."""
    layer = moe_ops.FusedMoE(E, K, H, I, dtype=torch.float32, device="cpu")
    assert layer.router.weight.requires_grad
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (3, 9):
        x = torch.randn(tokens, H, requires_grad=True)
        with torch.no_grad():
            want = layer(x)
        out = compiled(x)
        assert out.requires_grad
        torch.testing.assert_close(out, want)
        with torch.no_grad():
            w13, w2 = layer.float_weights()
            topk_weights, topk_ids = layer.routing_for(x)
            ref = moe_float64(x.detach(), w13, w2, topk_weights, topk_ids)
        assert relative_error(out.detach(), ref) <= tolerance(torch.float32)
        with pytest.raises(RuntimeError, match="no backward; the moe_ops ops are forward-only"):
            out.sum().backward()


def test_layer_under_inference_mode_computes_as_under_no_grad():
    """torch.inference_mode, as inference servers run a model: dispatch skips the ops' autograd kernels
    (about 40% of a custom op's host time, bench/NOTES.md v38); eager and compiled (fullgraph,
    dynamic), the layer computes what it computes under no_grad, and its output is an inference tensor."""
    layer = moe_ops.FusedMoE(E, K, H, I, dtype=torch.float32, device="cpu")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (3, 9):
        x = torch.randn(tokens, H)
        with torch.no_grad():
            want = layer(x)
            w13, w2 = layer.float_weights()
            topk_weights, topk_ids = layer.routing_for(x)
            ref = moe_float64(x, w13, w2, topk_weights, topk_ids)
        with torch.inference_mode():
            eager = layer(x)
            out = compiled(x)
        assert eager.is_inference() and out.is_inference()
        assert torch.equal(eager, want)
        torch.testing.assert_close(out, want)
        assert relative_error(out, ref) <= tolerance(torch.float32)
