"""moe_ops::router_linear: the router's logits, x [M, H] @ weight [E, H]^T (+ bias [E]) -> [M, E] in x's
dtype, as torch.nn.functional.linear computes them; and `Router`, the nn.Linear that FusedMoE routes with.

Why an op of its own: at decode sizes (router_kernel.serves: up to 8 tokens, fewer for wide routers) a
CUDA call runs one Triton kernel (router_kernel.py) where cuBLAS runs a split-K GEMM and a reduce: 3-4
µs less per layer in a CUDA graph at M = 1-4 for Qwen3-MoE and gpt-oss shapes (bench/NOTES.md v62);
elsewhere it calls cuBLAS (F.linear), whose tiles win there. Every other device runs F.linear. The
kernel sums in float32 and rounds once, as cuBLAS does, in another order: logits may differ from
F.linear's in the last bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from . import _checks, eager_kernels, forward_only


def check_router_args(x, weight, bias) -> None:
    """The op's arguments (shapes, dtypes and devices only, no values: safe under compile)."""
    _checks.expect_tensor("x", x)
    _checks.expect_tensor("weight", weight)
    _checks.expect_ndim("x", x, 2, "[M, H]")
    _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.expect_ndim("weight", weight, 2, "[E, H]")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: expected [E, H={x.shape[1]}] for x {tuple(x.shape)}, got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from x's {x.dtype}; allowed: {x.dtype}")
    if bias is not None:
        _checks.expect_tensor("bias", bias)
        _checks.expect_shape("bias", bias, (weight.shape[0],), "[E]")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from x's {x.dtype}; allowed: {x.dtype}")
    _checks.expect_same_device({"x": x, "weight": weight, "bias": bias})


@torch.library.custom_op("moe_ops::router_linear", mutates_args=())
def router_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, H], weight [E, H], bias [E] or None -> logits [M, E] in x's dtype, contiguous."""
    check_router_args(x, weight, bias)
    return F.linear(x, weight, bias).contiguous()


def _run_cuda(x, weight, bias):
    """One Triton kernel at decode sizes, cuBLAS elsewhere (the module docstring); arguments checked."""
    from .router_kernel import router_linear_triton, serves

    if serves(x.shape[0], x.shape[1], weight.shape[0]):
        return router_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias).contiguous()


@router_linear_op.register_kernel("cuda")
def _router_linear_cuda(x, weight, bias):
    check_router_args(x, weight, bias)
    return _run_cuda(x, weight, bias)


@router_linear_op.register_fake
def _router_linear_fake(x, weight, bias):
    check_router_args(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


forward_only.register(router_linear_op)


def router_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits: x [M, H] @ weight [E, H]^T (+ bias [E]) -> [M, E] in x's dtype (see the module
    docstring for what runs where)."""
    check_router_args(x, weight, bias)
    if eager_kernels.applies(x) and not eager_kernels.needs_grad(x, weight, bias):
        # An eager CUDA call that autograd does not need: the op's CUDA impl without the dispatcher's
        # host time (as routing.route does). The same logits.
        return _run_cuda(x, weight, bias)
    return router_linear_op(x, weight, bias)


# Tensors the kernel reads as they are; FakeTensor stands for a plain one while torch.export traces
# without Dynamo (its default, non-strict mode).
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


class Router(torch.nn.Linear):
    """nn.Linear(H, E) whose forward is router_linear: x [..., H] -> [..., E], with nn.Linear's
    parameters, state-dict names and hooks. It runs nn.Linear's own forward under autocast, which casts
    F.linear but not custom ops, and where a parameter is a tensor subclass (a quantization library's
    weight swapped into this nn.Linear, say), which F.linear dispatches and the kernel cannot read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = all(type(p) in _PLAIN for p in (x, self.weight, self.bias) if p is not None)
        # Meta tensors have no autocast (asking raises); they run the op's fake impl.
        if not plain or x.dim() < 1 or (x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)):
            return super().forward(x)
        logits = router_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return logits.reshape(*x.shape[:-1], logits.shape[-1])
