"""Inputs and references for the GPU tests of the kernels: fresh random data, never zeros."""
from __future__ import annotations

import torch

from moe_ops.activation import activation as activation_op
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.reduce import weighted_reduce

NONE = [-1, -1]


def weights(e, h, i, dtype=torch.bfloat16, device="cuda", gated=True):
    w13 = torch.randn(e, (2 if gated else 1) * i, h, device=device, dtype=dtype) / h**0.5
    w2 = torch.randn(e, h, i, device=device, dtype=dtype) / i**0.5
    return w13, w2


def routing(m, e, k, device="cuda", skew: float = 0.0):
    """Random top-k routing (k distinct ids per token, weights summing to 1); with skew, that fraction of
    the tokens has expert 0 among its ids. The skew moves ids, not weights: every pair keeps a weight of
    above 0.09 / k, so each grouped GEMM2 row shows in the output (a logit of 1e4 gave the other k - 1
    pairs of a skewed token weight 0, hiding their rows)."""
    logits = torch.randn(m, e, device=device)
    topk_ids = logits.topk(k, dim=-1).indices
    skewed = (torch.rand(m, device=device) < skew) & (topk_ids != 0).all(dim=-1)
    topk_ids[skewed, -1] = 0  # expert 0 replaces the token's last pick: the ids stay distinct
    topk_weights = torch.rand(m, k, device=device) + 0.1
    return (topk_weights / topk_weights.sum(-1, keepdim=True)).float().contiguous(), topk_ids.to(torch.int32).contiguous()


def reference(x, w13, w2, topk_weights, topk_ids, activation="silu", alpha=1.702, limit=7.0, interleaved=False, b13=None, b2=None,
              expert_map=None):  # fmt: skip
    """moe_ops' reference ops on the same device: (intermediate [P, I], output [M, H], the plan)."""
    e = w13.shape[0]
    offsets, gather, inverse = routing_plan(topk_ids, e, expert_map)
    h = grouped_gemm(x, None, None, "none", NONE, w13, None, None, None, "none", NONE, b13, offsets, gather, x.dtype)
    inter = activation_op(h, activation, alpha, limit, interleaved)
    y = grouped_gemm(inter, None, None, "none", NONE, w2, None, None, None, "none", NONE, b2, offsets, None, x.dtype)
    return inter, weighted_reduce(y, topk_weights, inverse, offsets), (offsets, gather, inverse)


def rel_err(out, ref) -> float:
    if ref.numel() == 0:
        return 0.0
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
