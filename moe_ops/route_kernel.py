"""Routing in one Triton kernel: the CUDA implementation of moe_ops::route, every method (softmax,
sigmoid or sqrt-softplus scores, with or without a correction bias, renormalized or not, scaled or
not, grouped top-k or not) for up to MAX_POSITIONS positions (E, rounded up to a power of two per
group and group count).

Why: the reference is a dozen small tensor ops (two dozen with expert groups); inside a compiled graph
the op runs them one by one. At M = 1 on an H100 the routing (with the router's linear) took 30-31 µs
of a FusedMoE's 60 µs in a CUDA graph, 8 µs with this kernel; DeepSeek-V3's grouped routing 81 µs,
11 with it (bench/NOTES.md v39, v40).

Same results as the reference: the ids exactly (the k largest selection scores, best first, an exact
tie to the lower expert id, NaN ranked last), the weights to float32 rounding (the scores' exp and
the sums are computed in another order). Without a correction bias the logits themselves rank, so the
ids never depend on rounding; with one they rank by computed scores, and two candidates (experts, or
groups by their two best scores) whose scores tie in the reals but not in float32 are ordered by
rounding, here as between torch's own CPU and GPU kernels.

Each program takes BLOCK_M tokens and all E experts: the top k come from k passes of an argmax over
integer keys that order like the scores (ties to the left), each pass removing its pick. With expert
groups the experts sit in a [G_P2, S_P2] grid of (group, place) positions, the groups' scores come
from a reduction over the places, and topk_group passes of the same argmax over the groups' keys
choose the groups whose experts stay in the race.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch_ints import cdiv, next_power_of_2
from .plan_kernel import compile_options, on_device, uses_grid_dependency

# A row of experts lives in registers: up to this many positions (E, or with expert groups the groups
# times the group size, each rounded up to a power of two), else the reference.
MAX_POSITIONS = 1024
_TILE = 4096  # at most BLOCK_M x positions elements per program


@triton.jit
def _finite(x):
    """x as torch.nan_to_num(x, nan=-inf) leaves it: +-inf become the largest finite values and NaN -inf."""
    x = tl.where(x == float("inf"), 3.4028234663852886e38, x)
    x = tl.where(x == float("-inf"), -3.4028234663852886e38, x)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _sqrt_softplus(x):
    """sqrt(torch.nn.functional.softplus(x)): x itself above 20, else log1p(exp(x)). log1p(y) as
    y * log(1 + y) / ((1 + y) - 1), which keeps y's relative precision where 1 + y rounds (and is y
    where 1 + y rounds to 1): log(1 + exp(x)) alone loses it below x = -15, where the weights of
    renormalized low scores come from it. NaN stays NaN (ranked last, as in the reference), +inf +inf."""
    y = tl.exp(tl.where(x > 20.0, 0.0, x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.sqrt(tl.where(x > 20.0, x, log1p))


# route()'s scoring -> the kernel's SCORE
SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _order_key(x):
    """int32 keys that order as routing._rank orders the float32 values x: as torch.nan_to_num(x,
    nan=-inf) does, +-inf become the largest finite values and NaN -inf, below them; -0.0 ties +0.0.
    For a non-negative float the bits order as the values; for a negative one, flipping all but the sign
    bit reverses them."""
    bits = (_finite(x) + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _kept_groups(
    selection, ok, num_groups, BLOCK_M: tl.constexpr, G_P2: tl.constexpr, S_P2: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr,
):  # fmt: skip
    """selection [BLOCK_M, G_P2 * S_P2] (position g * S_P2 + s holds group g's expert s) -> bool, True
    at the experts of each row's TOPK_GROUP best groups, as routing._group_mask: a group scores the sum
    of its two best selection scores (TOP2) or its best one, after nan_to_num; ties to the lower group."""
    grouped = tl.reshape(tl.where(ok, _finite(selection), float("-inf")), [BLOCK_M, G_P2, S_P2])
    best = tl.max(grouped, axis=2)
    if TOP2:
        # The second best counts a repeat of the best (topk's values keep duplicates).
        is_best = grouped == best[:, :, None]
        repeats = tl.sum(is_best.to(tl.int32), axis=2)
        second = tl.max(tl.where(is_best, float("-inf"), grouped), axis=2)
        score = best + tl.where(repeats > 1, best, second)
    else:
        score = best
    groups = tl.arange(0, G_P2)
    lowest = -2147483648
    keys = tl.where(groups[None, :] < num_groups, _order_key(score), lowest)
    kept = tl.zeros([BLOCK_M, G_P2], dtype=tl.int1)
    for _ in range(TOPK_GROUP):
        pick = tl.argmax(keys, axis=1, tie_break_left=True).to(tl.int32)
        chosen = groups[None, :] == pick[:, None]
        kept = kept | chosen
        keys = tl.where(chosen, lowest, keys)
    kept = tl.broadcast_to(kept[:, :, None], [BLOCK_M, G_P2, S_P2])
    return tl.reshape(kept, [BLOCK_M, G_P2 * S_P2])


# Sizes vary with M: specialising on their divisibility would compile a new kernel for some token counts.
@triton.jit(do_not_specialize=["m", "num_groups", "group_size", "stride_m", "stride_e", "scale"])
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, m, num_groups, group_size, stride_m, stride_e, scale,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, G_P2: tl.constexpr,
    S_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        # The routing plan after this kernel is a programmatic dependent that waits for this kernel's
        # completion (griddepcontrol.wait) before reading: letting it launch now hides its launch under
        # this kernel and promises nothing. This kernel is likewise a dependent of the router's matmul.
        gdc_launch_dependents()
        gdc_wait()
    # Without expert groups: one group of all E experts (G_P2 = 1, S_P2 = E to a power of two, TOPK_GROUP = 0).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = tl.arange(0, G_P2 * S_P2)
    group = positions // S_P2
    place = positions % S_P2
    cols = group * group_size + place  # the expert id at each position
    row_ok = rows < m
    col_ok = (group < num_groups) & (place < group_size)
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :] * stride_e, mask=ok, other=0.0)
    x = x.to(tl.float32)
    if SCORE == 0:
        top = tl.max(tl.where(ok, x, float("-inf")), axis=1)
        e = tl.where(ok, tl.exp(x - top[:, None]), 0.0)
        scores = e / tl.sum(e, axis=1)[:, None]
    elif SCORE == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = _sqrt_softplus(x)
    # A row with a NaN logit (or any row, with a NaN bias) has no defined routing: NaN weights.
    undefined = tl.max(tl.where(ok & (x != x), 1, 0), axis=1) > 0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        selection = scores + bias[None, :]
        undefined = undefined | (tl.max(tl.where(col_ok & (bias != bias), 1, 0), axis=0) > 0)
    else:
        # Every scoring increases with the logit: the logits rank as the exact scores do (routing.py).
        selection = x
    if TOPK_GROUP > 0:
        kept = _kept_groups(selection, ok, num_groups, BLOCK_M, G_P2, S_P2, TOPK_GROUP, TOP2)
        selection = tl.where(kept, selection, float("-inf"))
    lowest = -2147483648
    # Valid positions order as their expert ids, so ties to the lower position are ties to the lower id.
    keys = tl.where(ok, _order_key(selection), lowest)
    slots = tl.arange(0, K_P2)
    weights = tl.zeros([BLOCK_M, K_P2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, K_P2], dtype=tl.int32)
    # A loop, not unrolled: unrolling k passes made the compile grow with k (k = 64: minutes).
    for j in range(TOP_K):
        pick = tl.argmax(keys, axis=1, tie_break_left=True).to(tl.int32)
        chosen = positions[None, :] == pick[:, None]
        w = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        weights = tl.where(slots[None, :] == j, w[:, None], weights)
        expert = (pick // S_P2) * group_size + pick % S_P2
        ids = tl.where(slots[None, :] == j, expert[:, None], ids)
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


def _grid(num_experts: int, num_expert_group: int) -> tuple[int, int, int, int]:
    """(groups, group size, G_P2, S_P2): E experts in num_expert_group groups (no groups: one group of
    E) and the power-of-two grid of (group, place) positions that holds them."""
    groups = max(num_expert_group, 1)
    size = num_experts // groups
    return groups, size, next_power_of_2(groups), next_power_of_2(size)


def why_not(num_experts: int, num_expert_group: int) -> str | None:
    """Why route_triton cannot serve a call (too many positions, _grid), or None: it serves every method."""
    _, _, g_p2, s_p2 = _grid(num_experts, num_expert_group)
    if g_p2 * s_p2 <= MAX_POSITIONS:
        return None
    groups = f" in {num_expert_group} groups ({g_p2} x {s_p2} positions)" if num_expert_group else ""
    return f"{num_experts} experts{groups}: the route kernel holds at most {MAX_POSITIONS} positions in registers"


# Programs the launch aims for: about one per SM, so that a few tokens spread over many SMs instead of
# queueing in one program's passes.
_PROGRAMS = 128


def _launch_shape(m: int, positions: int, grouped: bool) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for M tokens over this many positions: the fewest tokens per program that
    still give about _PROGRAMS programs (at most _TILE elements each), and a warp per 128 elements, 1
    to 8; with expert groups, whose group stage has more to do, a warp per 64 elements, 1 to 4
    (bench/NOTES.md v40 item 8)."""
    block_m = max(1, min(next_power_of_2(cdiv(m, _PROGRAMS)), _TILE // positions))
    per_warp, most = (64, 4) if grouped else (128, 8)
    return block_m, max(1, min(most, block_m * positions // per_warp))


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]), contiguous;
    the op's arguments (num_expert_group == 0: no groups), checked by the caller
    (routing.check_route_args), for a call the kernel serves (why_not is None)."""
    m, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(m, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=device)
    if m == 0:
        return weights, ids
    num_groups, group_size, g_p2, s_p2 = _grid(num_experts, num_expert_group)
    block_m, num_warps = _launch_shape(m, g_p2 * s_p2, num_expert_group > 0)
    bias = e_score_correction_bias.contiguous() if e_score_correction_bias is not None else router_logits
    # A programmatic dependent launch on sm_90+, as the plan's (plan_kernel.py): the kernel's wait
    # covers all older work on the stream, since the kernel before it completes after its predecessors.
    grid_dependency = uses_grid_dependency(device)
    with on_device(device):
        _route_kernel[(cdiv(m, block_m),)](
            router_logits, bias, weights, ids, m, num_groups, group_size,
            router_logits.stride(0), router_logits.stride(1), float(routed_scaling_factor),
            TOP_K=top_k, K_P2=next_power_of_2(top_k), SCORE=SCORES[scoring],
            HAS_BIAS=e_score_correction_bias is not None, RENORMALIZE=bool(renormalize),
            SCALED=float(routed_scaling_factor) != 1.0, BLOCK_M=block_m, G_P2=g_p2, S_P2=s_p2,
            TOPK_GROUP=topk_group if num_expert_group else 0,
            # routing.GROUP_SCORE: the two best with a correction bias (one if a group holds one expert).
            TOP2=e_score_correction_bias is not None and group_size > 1, PDL=grid_dependency, num_warps=num_warps,
            **compile_options(grid_dependency),
        )  # fmt: skip
    return weights, ids
