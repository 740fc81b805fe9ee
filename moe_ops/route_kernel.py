"""Routing in one Triton kernel: the CUDA implementation of moe_ops::route for the methods without
expert groups (softmax or sigmoid scores, with or without a correction bias, renormalized or not,
scaled or not). Grouped top-k (num_expert_group > 0) runs routing.py's reference ops on CUDA too.

Why: the reference is a dozen small tensor ops; inside a compiled graph the op runs them one by one.
At M = 1 on an H100 the routing (with the router's linear) took 30-31 µs of a FusedMoE's 60 µs in a
CUDA graph, 9 µs with this kernel; without a graph the reference function costs ~136 µs of host time
(bench/NOTES.md v39).

Same results as the reference: the ids exactly (the k largest selection scores, best first, an exact
tie to the lower expert id, NaN ranked last), the weights to float32 rounding (the scores' exp and
the sums are computed in another order). Each program takes BLOCK_M tokens and all E experts: the top k
come from k passes of an argmax over integer keys that order like the scores (ties to the left), each
pass removing its pick.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan_kernel import on_device

# A row of experts lives in registers: E up to this many (next power of two), else the reference.
MAX_EXPERTS = 1024
_TILE = 4096  # BLOCK_M x BLOCK_E elements per program


@triton.jit
def _order_key(x):
    """int32 keys that order as routing._rank orders the float32 values x: as torch.nan_to_num(x,
    nan=-inf) does, +-inf become the largest finite values and NaN -inf, below them; -0.0 ties +0.0.
    For a non-negative float the bits order as the values; for a negative one, flipping all but the sign
    bit reverses them."""
    x = tl.where(x == float("inf"), 3.4028234663852886e38, x)
    x = tl.where(x == float("-inf"), -3.4028234663852886e38, x)
    x = tl.where(x != x, float("-inf"), x) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# Sizes vary with M: specialising on their divisibility would compile a new kernel for some token counts.
@triton.jit(do_not_specialize=["m", "num_experts", "stride_m", "stride_e", "scale"])
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, m, num_experts, stride_m, stride_e, scale,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < m
    col_ok = cols < num_experts
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_e, mask=ok, other=0.0)
    x = x.to(tl.float32)
    if SOFTMAX:
        top = tl.max(tl.where(ok, x, float("-inf")), axis=1)
        e = tl.where(ok, tl.exp(x - top[:, None]), 0.0)
        scores = e / tl.sum(e, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    # A row with a NaN logit (or any row, with a NaN bias) has no defined routing: NaN weights.
    undefined = tl.max(tl.where(ok & (x != x), 1, 0), axis=1) > 0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        selection = scores + bias[None, :]
        undefined = undefined | (tl.max(tl.where(col_ok & (bias != bias), 1, 0), axis=0) > 0)
    else:
        # Both scorings increase with the logit: the logits rank as the exact scores do (routing.py).
        selection = x
    lowest = -2147483648
    keys = tl.where(ok, _order_key(selection), lowest)
    slots = tl.arange(0, K_P2)
    weights = tl.zeros([BLOCK_M, K_P2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(keys, axis=1, tie_break_left=True).to(tl.int32)
        chosen = cols[None, :] == pick[:, None]
        w = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        weights = tl.where(slots[None, :] == j, w[:, None], weights)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        keys = tl.where(chosen, lowest, keys)
    used = slots[None, :] < TOP_K
    weights = tl.where(undefined[:, None], float("nan"), weights)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(used, weights, 0.0), axis=1)[:, None]
    if SCALED:
        weights = weights * scale
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    keep = row_ok[:, None] & used
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def serves(num_experts: int, num_expert_group: int) -> bool:
    """Whether route_triton serves a call: no expert groups, E up to MAX_EXPERTS."""
    return num_expert_group == 0 and 0 < num_experts <= MAX_EXPERTS


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]), contiguous;
    the arguments checked by the caller (routing.check_route_args), no expert groups (serves)."""
    m, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(m, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=device)
    if m == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_m = max(1, min(triton.next_power_of_2(m), _TILE // block_e))
    bias = e_score_correction_bias.contiguous() if e_score_correction_bias is not None else router_logits
    with on_device(device):
        _route_kernel[(triton.cdiv(m, block_m),)](
            router_logits, bias, weights, ids, m, num_experts, router_logits.stride(0), router_logits.stride(1),
            float(routed_scaling_factor),
            TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax",
            HAS_BIAS=e_score_correction_bias is not None, RENORMALIZE=bool(renormalize),
            SCALED=float(routed_scaling_factor) != 1.0, BLOCK_M=block_m, BLOCK_E=block_e, num_warps=4,
        )  # fmt: skip
    return weights, ids
