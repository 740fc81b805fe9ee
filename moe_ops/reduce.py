"""moe_ops::weighted_reduce: each token's k expert outputs, weighted by the router and summed.

out[m] = sum over j = 0..k-1 of topk_weights[m, j] * y[inverse[m*k + j]], in float32, in the order
j = 0, 1, ..., k-1 (deterministic: no atomics), returned in y's dtype. A pair whose row is a dropped
row (at or past expert_offsets[E]) contributes nothing, even if that row holds NaN.
"""
from __future__ import annotations

import torch

from . import forward_only


@torch.library.custom_op("moe_ops::weighted_reduce", mutates_args=())
def weighted_reduce(
    y: torch.Tensor, topk_weights: torch.Tensor, inverse: torch.Tensor, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """y [M*k, H] grouped rows, topk_weights [M, k] float32, inverse int32 [M*k] -> [M, H]."""
    m, k = topk_weights.shape
    rows = inverse.long()
    valid = ((rows >= 0) & (rows < expert_offsets[-1].long())).view(m, k, 1)
    picked = y[rows.clamp(0, max(y.shape[0] - 1, 0))].float().view(m, k, y.shape[1])
    weighted = torch.where(valid, picked * topk_weights.float().unsqueeze(2), 0.0)
    out = weighted[:, 0] if k else y.new_zeros((m, y.shape[1]), dtype=torch.float32)
    for j in range(1, k):
        out = out + weighted[:, j]
    return out.to(y.dtype).contiguous()


@weighted_reduce.register_fake
def _weighted_reduce_fake(y, topk_weights, inverse, expert_offsets):
    torch._check(inverse.shape[0] == topk_weights.shape[0] * topk_weights.shape[1])
    return y.new_empty((topk_weights.shape[0], y.shape[1]))


forward_only.register(weighted_reduce)
