"""The routing plan in one Triton kernel: the CUDA implementation of moe_ops::routing_plan.

Same outputs as the reference in plan.py, bit for bit (a stable sort of the pairs by local expert), in
a single launch with no host synchronisation and no zeroed counters between CUDA-graph replays (no
program waits on another). A pair p with key e (its local expert, E for a dropped pair) gets the row

    row(p) = #pairs with a key below e  +  #pairs before p with key e

Two kernels compute it, chosen by the number of pairs P = M*k (launch_config):
- by keys (P <= 4096): one program per key e in 0..E scans all P keys twice, once summing key < e (the
  offset of e) and once numbering its own pairs with a running prefix sum. Only comparisons, sums and
  one scan per chunk: 1.3-3.4 µs up to P = 1024 on an H200, where the blocks kernel took 2.1-13 µs.
- by blocks (larger P): programs split the pairs into blocks; each histograms the experts' keys of all
  P pairs (the first term, and the second for pairs before its block) and ranks its block's pairs by
  sorting them. From P = 8192 that costs less than each key's two scans of all P keys (bench/NOTES.md,
  v17, v26).

On CUDA from sm_90 either kernel launches as a programmatic dependent (PDL) of the kernel before it
and waits for it (griddepcontrol.wait) before reading topk_ids, so its launch overlaps that kernel's
end: with back-to-back layers in a CUDA graph the next call starts ~0.5 µs sooner (bench/NOTES.md,
v22). Small plans also let the GEMM after them launch at their start. Older GPUs have no
griddepcontrol: there the kernels run in plain stream order (uses_grid_dependency).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import devices
from .launch_ints import cdiv, next_power_of_2


@triton.jit
def _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP: tl.constexpr):
    """The local expert of each pair, num_experts for a dropped pair (see plan.local_expert_ids).

    Ids and map entries are range-checked at their own width and narrowed to int32 only after: narrowing
    first would turn the int64 id 2**32 + 3 into expert 3 instead of dropping it."""
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    if HAS_MAP:
        in_range = (ids >= 0) & (ids < num_global)
        ids = tl.load(map_ptr + ids, mask=mask & in_range, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    return tl.where(valid, ids.to(tl.int32), num_experts)


# Sizes vary with M: specialising on their divisibility would compile a new kernel for some token counts.
@triton.jit(do_not_specialize=["num_pairs", "k", "num_experts", "num_global"])
def _routing_plan_by_blocks_kernel(
    ids_ptr, map_ptr, offsets_ptr, gather_ptr, inverse_ptr, scratch_ptr,
    num_pairs, k, num_experts, num_global,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, SCAN: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if EARLY_LAUNCH:
        # The GEMM after the plan is a programmatic dependent launch: letting it launch now starts its
        # CTAs (barrier setup, descriptor prefetch) on the SMs the plan leaves free; they wait for the
        # plan's completion before reading anything it writes (griddepcontrol.wait), so this promises
        # nothing. Small plans only (EARLY_MAX_PAIRS).
        gdc_launch_dependents()
    if PDL:
        # Launched as a programmatic dependent of the kernel before it (see routing_plan_triton):
        # nothing global is read or written before that kernel is complete.
        gdc_wait()
    block = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)
    # The histograms of all pairs and of the pairs before this block, SCAN (a multiple of BLOCK) pairs
    # at a time; only the chunk holding this block needs a second, masked histogram. They count the
    # experts' pairs only: the dropped pairs' counts follow from the sums, so BINS need not hold the
    # key E (a histogram's cost grows with its bins: E = 128 takes 128 instead of 256).
    block_start = block * BLOCK
    for start in range(0, num_pairs, SCAN):
        offs = start + tl.arange(0, SCAN)
        mask = offs < num_pairs
        key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
        hist = tl.histogram(key, BINS, mask=mask & (key < num_experts))
        total += hist
        if start + SCAN <= block_start:
            before += hist
        elif start <= block_start:
            before += tl.histogram(key, BINS, mask=mask & (key < num_experts) & (offs < block_start))
    starts = tl.cumsum(total, 0) - total  # exclusive: the first row of each key
    routed = tl.sum(total, 0)  # the first row of the dropped pairs
    bins = tl.arange(0, BINS)
    if block == 0:
        tl.store(offsets_ptr + bins, starts, mask=bins < num_experts)
        tl.store(offsets_ptr + num_experts, routed)

    offs = block * BLOCK + lanes
    mask = offs < num_pairs
    key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
    mine = tl.histogram(key, BINS, mask=mask & (key < num_experts))
    mine_starts = tl.cumsum(mine, 0) - mine
    # Padding lanes get key BINS + 1: they sort after every real pair, the dropped ones (key E <= BINS)
    # included.
    order = tl.sort(tl.where(mask, key, BINS + 1) * BLOCK + lanes)
    sorted_key = order // BLOCK
    pair = block * BLOCK + order % BLOCK
    valid = sorted_key <= BINS
    # row = starts[key] + before[key] + (j - mine_starts[key]) for the j-th sorted lane; for the key E
    # that is routed + (dropped pairs before this block) - (routed pairs in it), the dropped sorting
    # after them. Indexing a register vector by a per-lane key goes through this program's BINS + 1
    # entries of global scratch: entry E holds the dropped pairs' term (E < BINS: a bin no pair has).
    dropped = routed + (block_start - tl.sum(before, 0)) - tl.sum(mine, 0)
    base = scratch_ptr + block * (BINS + 1)
    tl.store(base + bins, tl.where(bins == num_experts, dropped, starts + before - mine_starts))
    tl.store(base + BINS, dropped)
    tl.debug_barrier()
    row = tl.load(base + sorted_key, mask=valid, other=0) + lanes
    tl.store(inverse_ptr + pair, row, mask=valid)
    tl.store(gather_ptr + row, pair // k, mask=valid)



@triton.jit(do_not_specialize=["num_pairs", "k", "num_experts", "num_global"])
def _routing_plan_by_keys_kernel(
    ids_ptr, map_ptr, offsets_ptr, gather_ptr, inverse_ptr,
    num_pairs, k, num_experts, num_global,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, EARLY_LAUNCH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if EARLY_LAUNCH:
        # As in the blocks kernel: the GEMM after the plan sets up while it runs and waits for it to
        # finish before reading. Small plans only (EARLY_MAX_PAIRS).
        gdc_launch_dependents()
    if PDL:
        # As in the blocks kernel: the wait for the kernel before the plan.
        gdc_wait()
    key_of_program = tl.program_id(0)  # an expert, or num_experts for the dropped pairs
    below = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
        below += tl.sum((mask & (key < key_of_program)).to(tl.int32))
    tl.store(offsets_ptr + key_of_program, below)
    taken = below  # rows given to this key's pairs so far, plus its first row
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        key = _keys(ids_ptr, map_ptr, offs, mask, num_experts, num_global, HAS_MAP)
        mine = (mask & (key == key_of_program)).to(tl.int32)
        row = taken + tl.cumsum(mine, 0) - 1
        tl.store(inverse_ptr + offs, row, mask=mine != 0)
        tl.store(gather_ptr + row, offs // k, mask=mine != 0)
        taken += tl.sum(mine)


# Plans up to this many pairs run by keys; larger ones by blocks (measured crossover, bench/NOTES.md v26,
# H200, µs, keys / blocks: P = 4096 4.9 / 6.4, P = 8192 8.8 / 8.4 (E = 128) and 13.0 / 12.2 (E = 256),
# P = 16384 16.5 / 10.8, P = 32768 32.1 / 21.7, P = 65536 64.4 / 39.3 (E = 128) and 125.9 / 61.7).
KEYS_MAX_PAIRS = 4096
# Plans up to this many pairs let the GEMM after them launch at their start (v16, v17): in the layer
# 0.5-5 µs faster up to P = 1024, and up to 3% slower at P = 8192-65536 with E = 256.
EARLY_MAX_PAIRS = 1024


@dataclass(frozen=True)
class PlanLaunch:
    """How the plan launches: by "keys" (one program per key, `chunk` pairs per scan step) or by "blocks"
    (`block` pairs per program, histograms `scan` pairs at a time); num_warps per program."""

    method: str
    num_warps: int
    chunk: int = 0
    block: int = 0
    scan: int = 0

    def __post_init__(self):
        sizes = {"keys": ("chunk",), "blocks": ("block", "scan")}
        if self.method not in sizes:
            raise ValueError(f"PlanLaunch: method must be one of {sorted(sizes)}, got {self.method!r}")
        for name in ("num_warps", *sizes[self.method]):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"PlanLaunch: {name} must be a power of two for method {self.method!r}, got {value}")
        if self.method == "blocks" and self.scan < self.block:
            raise ValueError(f"PlanLaunch: scan ({self.scan}) must be at least block ({self.block})")


# The blocks kernel's launch at every P and E it serves: the best of eleven block / scan / warps
# settings at each of the eight points from P = 2048 to 65536 (or within 0.5 µs of it; v26).
BLOCKS_LAUNCH = PlanLaunch("blocks", 8, block=512, scan=2048)


def _bins(num_experts: int) -> int:
    """The blocks kernel's histogram bins: one per expert, rounded up to a power of two, at least 16 (the
    fewest timed on a GPU: mixtral's E = 8 under the old rule of next_power_of_2(E + 1))."""
    return max(16, next_power_of_2(num_experts))


def launch_config(num_pairs: int, num_experts: int) -> PlanLaunch:
    """The launch for P pairs over E experts, from timings of both kernels alone at the benchmark's
    points on an H200 (v17, v26). By keys: the whole plan in one chunk, 8 warps from 512 pairs."""
    if num_pairs > KEYS_MAX_PAIRS:
        return BLOCKS_LAUNCH
    p2 = max(16, next_power_of_2(num_pairs))
    return PlanLaunch("keys", 8 if num_pairs >= 512 else 4, chunk=p2)


# Grid dependency control (griddepcontrol, launch_pdl) needs sm_90 or newer; ptxas rejects it below.
PDL_MIN_CAPABILITY = (9, 0)


def uses_grid_dependency(device: torch.device) -> bool:
    """Whether the plan on `device` launches as a programmatic dependent and lets the GEMM after it
    launch early: on CUDA devices of compute capability 9.0 or newer only (Triton's interpreter and
    older GPUs run the kernels without griddepcontrol, in plain stream order)."""
    return device.type == "cuda" and devices.capability(device) >= PDL_MIN_CAPABILITY


def compile_options(grid_dependency: bool) -> dict:
    """Triton's compile options for either plan kernel and the route kernel (route_kernel.py):
    launch_pdl when it launches as a programmatic dependent. FP fusion off: the plan does integer work
    only, and the route kernel's float operations then round one by one, as torch's separate ops do;
    saying so also keeps Triton 3.9 from warning that its default flips in 3.10."""
    return {"launch_pdl": grid_dependency, "enable_fp_fusion": False}


def on_device(device: torch.device):
    """A context with `device` current while a Triton kernel launches on it: Triton launches on the
    current device's stream, so with another GPU current than the tensors' (a model spread over GPUs
    in one process) the launch fails. A switch costs 2-4 µs of host time, so only when needed. CPU
    tensors: the Triton interpreter, nothing to switch."""
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    return torch.cuda.device(device) if switch else contextlib.nullcontext()


def routing_plan_triton(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, launch: PlanLaunch | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] -> (expert_offsets int32 [E+1], gather_idx int32 [M*k], inverse int32 [M*k]).

    launch overrides launch_config(M*k, E); the tests use it to run either kernel with many programs,
    chunks and scan steps from few pairs.
    """
    m, k = topk_ids.shape
    num_pairs = m * k
    device = topk_ids.device
    launch = launch or launch_config(num_pairs, num_experts)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    gather = torch.empty(num_pairs, dtype=torch.int32, device=device)
    inverse = torch.empty(num_pairs, dtype=torch.int32, device=device)
    ids = topk_ids.contiguous()
    emap = expert_map.contiguous() if expert_map is not None else ids
    sizes = (num_pairs, k, num_experts, emap.shape[0] if expert_map is not None else 0)
    grid_dependency = uses_grid_dependency(device)
    early = num_pairs <= EARLY_MAX_PAIRS and grid_dependency
    # The plan itself launches as a programmatic dependent (PDL) of the kernel before it on the stream
    # (the route op's kernel or the previous MoE layer's token sum, which both let it launch early, or a
    # model's own routing): its launch overlaps that kernel's end, and it waits for it before reading
    # (bench/NOTES.md, v22). That wait covers all older work on the stream, as the kernel before it
    # completes only after its own predecessors (a normal launch starts after them; a programmatic
    # dependent waits for them). The token sum's early reads of topk_weights rely on the same chain
    # (token_sum.py).
    options = {"PDL": grid_dependency, **compile_options(grid_dependency)}
    with on_device(device):
        if launch.method == "keys":
            _routing_plan_by_keys_kernel[(num_experts + 1,)](
                ids, emap, offsets, gather, inverse, *sizes,
                HAS_MAP=expert_map is not None, CHUNK=launch.chunk, EARLY_LAUNCH=early, num_warps=launch.num_warps, **options,
            )  # fmt: skip
            return offsets, gather, inverse
        bins = _bins(num_experts)
        grid = max(1, cdiv(num_pairs, launch.block))
        scratch = torch.empty(grid * (bins + 1), dtype=torch.int32, device=device)
        _routing_plan_by_blocks_kernel[(grid,)](
            ids, emap, offsets, gather, inverse, scratch, *sizes,
            HAS_MAP=expert_map is not None, BLOCK=launch.block, BINS=bins, SCAN=launch.scan,
            EARLY_LAUNCH=early, num_warps=launch.num_warps, **options,
        )  # fmt: skip
    return offsets, gather, inverse
