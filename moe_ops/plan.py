"""The routing plan: how the M*k (token, expert) pairs are grouped by expert for the grouped GEMMs.

Pair p = m * k + j is token m's j-th choice. The plan sorts pairs by local expert id (stable, so within
an expert the rows keep token order) into P = M*k "grouped rows":
- expert_offsets int32 [E+1]: rows of local expert e are [offsets[e], offsets[e+1]); offsets[E] counts the
  rows that do any work. Rows from offsets[E] to P belong to dropped pairs.
- gather_idx int32 [P]: the token each grouped row reads.
- inverse int32 [P]: the grouped row of each pair.
A pair is dropped (sorted to the end, contributing nothing) when its expert lives on another rank
(expert_map[id] == -1) or when its id is outside [0, E_global): eager calls reject such ids with an
error, but compiled and captured calls cannot check without a host sync, so they drop them instead.
Every size is static (P = M*k), so the plan compiles with dynamic M and captures in CUDA graphs.
On CUDA the op runs plan_kernel.py's single Triton kernel.
"""
from __future__ import annotations

import torch

from . import _checks


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int64 [P]: the local expert of each pair, or num_experts for a dropped pair."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        num_global = expert_map.shape[0]
        in_range = (ids >= 0) & (ids < num_global)
        # An empty map (E_global = 0) has no entry to clamp to: every pair is dropped.
        mapped = expert_map.long()[ids.clamp(0, num_global - 1)] if num_global else ids
        ids = torch.where(in_range, mapped, -1)
    valid = (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids, num_experts)


def check_plan_args(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> None:
    """The op's arguments (shapes, dtypes and devices only, no values: safe under compile)."""
    _checks.expect_ndim("topk_ids", topk_ids, 2, "[M, k]")
    _checks.expect_dtype("topk_ids", topk_ids, _checks.INDEX_DTYPES)
    if num_experts < 0:
        raise ValueError(f"num_experts: got {num_experts}; allowed: an int >= 0")
    if expert_map is not None:
        _checks.expect_ndim("expert_map", expert_map, 1, "[E_global]")
        _checks.expect_dtype("expert_map", expert_map, _checks.INDEX_DTYPES)
        _checks.expect_same_device({"topk_ids": topk_ids, "expert_map": expert_map})


@torch.library.custom_op("moe_ops::routing_plan", mutates_args=())
def routing_plan(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] int32/int64 -> (expert_offsets int32 [E+1], gather_idx int32 [M*k], inverse int32 [M*k])."""
    check_plan_args(topk_ids, num_experts, expert_map)
    k = topk_ids.shape[1]
    key = local_expert_ids(topk_ids, num_experts, expert_map)
    num_pairs = key.numel()
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync on CUDA).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    order = torch.sort(key, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_pairs, device=key.device)
    return offsets, (order // k).to(torch.int32), inverse.to(torch.int32)


@routing_plan.register_kernel("cuda")
def _routing_plan_cuda(topk_ids, num_experts, expert_map):
    # One Triton launch instead of the reference's dozen small kernels; the same outputs bit for bit.
    check_plan_args(topk_ids, num_experts, expert_map)
    from .plan_kernel import routing_plan_triton

    return routing_plan_triton(topk_ids, num_experts, expert_map)


@routing_plan.register_fake
def _routing_plan_fake(topk_ids, num_experts, expert_map):
    check_plan_args(topk_ids, num_experts, expert_map)
    num_pairs = topk_ids.shape[0] * topk_ids.shape[1]
    return (
        topk_ids.new_empty((num_experts + 1,), dtype=torch.int32),
        topk_ids.new_empty((num_pairs,), dtype=torch.int32),
        topk_ids.new_empty((num_pairs,), dtype=torch.int32),
    )
