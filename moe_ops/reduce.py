"""moe_ops::weighted_reduce: each token's k expert outputs, weighted by the router and summed.

out[m] = sum over j = 0..k-1 of topk_weights[m, j] * y[inverse[m*k + j]], in float32, in the order
j = 0, 1, ..., k-1 (deterministic: no atomics), returned in y's dtype. A pair whose row is a dropped
row (at or past expert_offsets[E]) contributes nothing, even if that row holds NaN.
"""
from __future__ import annotations

import torch

from . import _checks, forward_only


def check_reduce_rows(rows_name: str, rows: int, topk_weights, inverse, expert_offsets) -> None:
    """The reduction's index arguments for `rows` grouped rows (named rows_name), shapes and dtypes only."""
    _checks.expect_ndim("topk_weights", topk_weights, 2, "[M, k]")
    _checks.expect_dtype("topk_weights", topk_weights, _checks.FLOAT_DTYPES)
    m, k = topk_weights.shape
    _checks.expect_shape("inverse", inverse, (m * k,), f"[M*k] for topk_weights {tuple(topk_weights.shape)}")
    _checks.expect_dtype("inverse", inverse, _checks.INDEX_DTYPES)
    if rows != m * k:
        raise ValueError(f"{rows_name}: expected M*k={m * k} rows for topk_weights {tuple(topk_weights.shape)}, got {rows}")
    _checks.expect_ndim("expert_offsets", expert_offsets, 1, "[E+1]")
    if expert_offsets.shape[0] < 1:
        raise ValueError(f"expert_offsets: expected [E+1] with E >= 0, got shape {tuple(expert_offsets.shape)}")
    _checks.expect_dtype("expert_offsets", expert_offsets, _checks.INDEX_DTYPES)


def check_reduce_args(y, topk_weights, inverse, expert_offsets) -> None:
    """The op's arguments (shapes, dtypes and devices only, no values: safe under compile)."""
    _checks.expect_ndim("y", y, 2, "[M*k, H]")
    _checks.expect_dtype("y", y, _checks.FLOAT_DTYPES)
    check_reduce_rows(f"y {tuple(y.shape)}", y.shape[0], topk_weights, inverse, expert_offsets)
    _checks.expect_same_device({"y": y, "topk_weights": topk_weights, "inverse": inverse, "expert_offsets": expert_offsets})


@torch.library.custom_op("moe_ops::weighted_reduce", mutates_args=())
def weighted_reduce(
    y: torch.Tensor, topk_weights: torch.Tensor, inverse: torch.Tensor, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """y [M*k, H] grouped rows, topk_weights [M, k] float32, inverse int32 [M*k] -> [M, H]."""
    check_reduce_args(y, topk_weights, inverse, expert_offsets)
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
    check_reduce_args(y, topk_weights, inverse, expert_offsets)
    return y.new_empty((topk_weights.shape[0], y.shape[1]))


forward_only.register(weighted_reduce)
