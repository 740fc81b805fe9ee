"""The routing plan in one Triton kernel: the CUDA implementation of moe_ops::routing_plan.

Same outputs as the reference in plan.py, bit for bit (a stable sort of the pairs by local expert), in
a single launch with no host synchronisation. Programs split the P = M*k pairs into blocks of BLOCK; a
pair's grouped row is

    row(p) = #pairs with a smaller key  +  #pairs before p's block with p's key  +  p's rank in its block

The first two terms are histograms: every program reads all P keys (P <= 131072 int32 in the benchmark,
L2-resident) instead of waiting on other programs, which needs no grid-wide synchronisation and so no
zeroed counters between CUDA-graph replays. The rank inside the block comes from sorting the block's
(key, position) pairs: a key's pairs are then contiguous, in position order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP: tl.constexpr):
    """The local expert of each pair, num_experts for a dropped pair (see plan.local_expert_ids)."""
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    if HAS_MAP:
        in_range = (ids >= 0) & (ids < num_global)
        mapped = tl.load(map_ptr + ids, mask=mask & in_range, other=-1).to(tl.int32)
        ids = tl.where(in_range, mapped, -1)
    valid = (ids >= 0) & (ids < num_experts)
    return tl.where(valid, ids, num_experts)


# Sizes vary with M: specialising on their divisibility would compile a new kernel for some token counts.
@triton.jit(do_not_specialize=["num_pairs", "k", "num_experts", "num_global"])
def _routing_plan_kernel(
    ids_ptr, map_ptr, offsets_ptr, gather_ptr, inverse_ptr, scratch_ptr,
    num_pairs, k, num_experts, num_global,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, SCAN: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
):  # fmt: skip
    if EARLY_LAUNCH:
        # The GEMM after the plan is a programmatic dependent launch: letting it launch now starts its
        # CTAs (barrier setup, descriptor prefetch) on the SMs this one program leaves free; they wait
        # for the plan's completion before reading anything it writes (griddepcontrol.wait), so this
        # promises nothing. Small M only: 0.5-1.8 µs off the layer at M = 1 (bench/NOTES.md, v16);
        # with a grid of many programs nothing was gained and deepseek M = 8192 read 2-3% slower.
        gdc_launch_dependents()
    block = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)
    # The histograms of all pairs and of the pairs before this block, SCAN (a multiple of BLOCK) pairs
    # at a time; only the chunk holding this block needs a second, masked histogram.
    block_start = block * BLOCK
    for start in range(0, num_pairs, SCAN):
        offs = start + tl.arange(0, SCAN)
        mask = offs < num_pairs
        key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
        hist = tl.histogram(key, BINS, mask=mask)
        total += hist
        if start + SCAN <= block_start:
            before += hist
        elif start <= block_start:
            before += tl.histogram(key, BINS, mask=mask & (offs < block_start))
    starts = tl.cumsum(total, 0) - total  # exclusive: the first row of each key
    bins = tl.arange(0, BINS)
    if block == 0:
        tl.store(offsets_ptr + bins, starts, mask=bins <= num_experts)

    offs = block * BLOCK + lanes
    mask = offs < num_pairs
    key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
    mine = tl.histogram(key, BINS, mask=mask)
    mine_starts = tl.cumsum(mine, 0) - mine
    # Padding lanes get key BINS: they sort after every real pair.
    order = tl.sort(tl.where(mask, key, BINS) * BLOCK + lanes)
    sorted_key = order // BLOCK
    pair = block * BLOCK + order % BLOCK
    valid = sorted_key < BINS
    # row = starts[key] + before[key] + (j - mine_starts[key]) for the j-th sorted lane. Indexing a
    # register vector by a per-lane key goes through this program's slice of global scratch.
    base = scratch_ptr + block * BINS
    tl.store(base + bins, starts + before - mine_starts)
    tl.debug_barrier()
    row = tl.load(base + sorted_key, mask=valid, other=0) + lanes
    tl.store(inverse_ptr + pair, row, mask=valid)
    tl.store(gather_ptr + row, pair // k, mask=valid)


def launch_config(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK, SCAN, num_warps) for P pairs over E experts, from timings of the kernel alone on an
    H200. Up to 1024 pairs, or with few experts (bins <= 64), one block per 1-2K pairs and 8-16K-pair
    scan steps (bench/NOTES.md, v5). With many experts the histograms' cost grows with the bins, and
    smaller blocks and scan steps with 8 warps halve the plan (v10): P = 8192, E = 128 39.2 -> 17.6 µs,
    E = 256 53.3 -> 25.3; P = 65536, E = 128 91.4 -> 62.7; E = 256 134.7 -> 96.3 with 16 warps."""
    p2 = max(128, triton.next_power_of_2(num_pairs))
    bins = triton.next_power_of_2(num_experts + 1)
    if p2 <= 1024 or bins <= 64:
        return (min(1024, p2), p2, 4) if p2 <= 8192 else (2048, 16384, 8)
    if p2 <= 8192:
        return 512, 2048, 8
    return (512, 4096, 8) if bins <= 256 else (1024, 8192, 16)


def routing_plan_triton(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, block: int | None = None,
    scan: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """topk_ids [M, k] -> (expert_offsets int32 [E+1], gather_idx int32 [M*k], inverse int32 [M*k]).

    block, scan, num_warps (powers of two; scan >= block) override launch_config(M*k, E); the tests use
    them to get many programs and scan steps from few pairs.
    """
    m, k = topk_ids.shape
    num_pairs = m * k
    device = topk_ids.device
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    gather = torch.empty(num_pairs, dtype=torch.int32, device=device)
    inverse = torch.empty(num_pairs, dtype=torch.int32, device=device)
    default_block, default_scan, default_warps = launch_config(num_pairs, num_experts)
    block = block or default_block
    bins = triton.next_power_of_2(num_experts + 1)
    grid = max(1, triton.cdiv(num_pairs, block))
    scratch = torch.empty(grid * bins, dtype=torch.int32, device=device)
    ids = topk_ids.contiguous()
    emap = expert_map.contiguous() if expert_map is not None else ids
    _routing_plan_kernel[(grid,)](
        ids, emap, offsets, gather, inverse, scratch,
        num_pairs, k, num_experts, emap.shape[0] if expert_map is not None else 0,
        HAS_MAP=expert_map is not None, BLOCK=block, BINS=bins, SCAN=max(scan or default_scan, block),
        # Grid dependency control is a GPU feature: Triton's interpreter (CPU tensors) has none.
        EARLY_LAUNCH=grid == 1 and ids.is_cuda, num_warps=num_warps or default_warps,
    )  # fmt: skip
    return offsets, gather, inverse
