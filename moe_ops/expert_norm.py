"""A norm of each expert's output row before the router weights it: PostExpertNorm and moe_ops::post_expert_norm.

MuseSpark's input-scaled RMS norm (transformers' MuseSparkTextInputScaledRMSNorm), per row y of GEMM2:

    s = round(y * (1 + weight))                  1 + weight in weight's dtype, the product in float32,
                                                 rounded to y's dtype
    out = round(s / sqrt(mean(s^2) + eps))       in float32, rounded to y's dtype

so the chain becomes ... -> grouped_gemm (GEMM2) -> post_expert_norm -> weighted_reduce, which the
lowering fuses into down_reduce with the norm (cute_kernels/norm_token_sum.py on sm_90), as eager CUDA
calls run it. Rows past expert_offsets[E] are zero from GEMM2 and stay zero (eps > 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from . import _checks, forward_only


def check_eps(eps) -> None:
    """eps is a finite real > 0 (a zero-row would divide 0 by 0 without it)."""
    if not isinstance(eps, Real) or isinstance(eps, bool):
        raise TypeError(f"post_expert_norm.eps: expected a real number, got {type(eps).__name__} {eps!r}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"post_expert_norm.eps: got {eps}; allowed: a finite number > 0")


@dataclass(frozen=True, eq=False)
class PostExpertNorm:
    """The input-scaled RMS norm of each expert's output row (the module docstring): weight [H] (the
    output is scaled by 1 + weight before the norm), eps > 0."""

    weight: torch.Tensor
    eps: float = 1e-6

    def __post_init__(self):
        _checks.expect_tensor("post_expert_norm.weight", self.weight)
        _checks.expect_ndim("post_expert_norm.weight", self.weight, 1, "[H]")
        _checks.expect_dtype("post_expert_norm.weight", self.weight, _checks.FLOAT_DTYPES)
        check_eps(self.eps)


def check_norm_args(y: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The op's arguments (shapes, dtypes and devices; eps's value: a float, not a tensor's)."""
    _checks.expect_ndim("y", y, 2, "[R, H]")
    _checks.expect_dtype("y", y, _checks.FLOAT_DTYPES)
    _checks.expect_shape("weight", weight, (y.shape[1],), f"[H] for y {tuple(y.shape)}")
    _checks.expect_dtype("weight", weight, _checks.FLOAT_DTYPES)
    _checks.expect_same_device({"y": y, "weight": weight})
    if not eps > 0:
        raise ValueError(f"eps: got {eps}; allowed: > 0")


@torch.library.custom_op("moe_ops::post_expert_norm", mutates_args=())
def post_expert_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y [R, H] -> [R, H] in y's dtype, contiguous: each row scaled by 1 + weight [H] (in weight's dtype),
    rounded to y's dtype, then divided by its root mean square (+ eps), in float32 (the module docstring)."""
    check_norm_args(y, weight, eps)
    s = (y.float() * (1.0 + weight).float()).to(y.dtype).float()
    return (s * torch.rsqrt(s.square().mean(dim=1, keepdim=True) + eps)).to(y.dtype).contiguous()


@post_expert_norm.register_fake
def _post_expert_norm_fake(y, weight, eps):
    check_norm_args(y, weight, eps)
    return y.new_empty(y.shape)


forward_only.register(post_expert_norm)
