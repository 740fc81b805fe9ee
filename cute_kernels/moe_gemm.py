"""The MoE grouped GEMM for Hopper (sm_90a) in the CuTe DSL: one kernel, specialised per recipe.

    C[r, :] = epilogue(A[src(r), :] @ B[e(r)].T)   for every grouped row r of every expert e,

where the rows of expert e are [offsets[e], offsets[e+1]) (device memory; the kernel reads them, the
host never does) and src(r) = gather[r] (GEMM1 reads tokens) or r (GEMM2 reads its own rows). GEMM2's
rows stay in grouped-row order; the router weights are applied by the per-token sum that follows
(token_sum.py), which finds each pair's row through inverse.

Structure (warp-specialised, persistent):
- warpgroup 0 produces, into a ring of `stages` shared-memory buffers; one thread loads B (the
  expert's weights) with TMA. GEMM1 gathers A: the warpgroup's 128 threads copy A rows with cp.async
  (16-byte chunks, any row order, no gathered copy of the activations in memory), on a pipeline of
  their own (completion arrives through cp.async.mbarrier.arrive, B's through TMA transaction
  bytes; the two advance in lockstep), and rows past the expert's end are zero-filled rather than
  loaded: the tile multiplies them anyway, and zeros cost the tensor cores less energy where the GPU
  runs power-capped (M = 8192: deepseek 8% faster; bench/NOTES.md, v9). GEMM2's A rows are
  contiguous: with 128-row tiles the same thread loads them with TMA too, on B's barrier; at M = 8192
  that GEMM2 ran 5-8% faster than with cp.async and zero-filled rows (bench/NOTES.md, v15). Rows past
  the expert then arrive as the next expert's (or TMA's zeros past the end), multiplied and never
  stored; with 256-row B tiles the consumers zero them in shared memory before their WGMMAs, for the
  same energy reason (MoeGemmSm90.zero_pad). With 64-row tiles (weight streaming) GEMM2 keeps the
  gather path with src(r) = r.
- warpgroups 1 and 2 consume: with 128-row tiles each multiplies 64 of the rows, with 64-row tiles
  (experts with few rows) each takes half of the columns, with 16-row tiles (swapped: the weights
  on WGMMA's M side, see MoeGemmSm90) each takes 64 weight rows of 128, or half of every stage's
  k-blocks of 64 (split-K), with WGMMA (fp32 accumulators); then they
  run the epilogue and store their elements, masked to the rows of the current expert, so partial
  tiles never write into the next expert's rows. GEMM2's 128-row tiles without biases store a tile's
  outputs while the next tile's first WGMMAs run (MoeGemmSm90.defer).
- Every warpgroup walks the same sequence of work tiles: tile t = blockIdx.x, then + gridDim.x, ...;
  tiles are numbered expert by expert, and within an expert M-tile fastest, so CTAs running at the
  same time share the expert's weight tile in L2. The walk reads the offsets from a copy in shared
  memory (loaded once per CTA, after the wait below), so experts with no rows (and pairs dropped by
  expert_map, sorted past offsets[E]) cost nothing.

Launch: programmatic dependent launch (PDL). The CTAs start, initialise their barriers and prefetch
the TMA descriptors while the previous kernel (the routing plan, or GEMM1) finishes, then wait for it
(griddepcontrol.wait) before reading any global memory; in a CUDA graph of the layer this hides most
of the gap between kernels, which weighs at small M (bench/NOTES.md, v8). With early_weights (GEMM2
right after GEMM1) it reads the offsets and starts the TMA of its first tile's weights before the
wait, as GEMM1 writes neither: at small M, where that tile is a CTA's whole job, its weights then
stream while GEMM1 finishes (qwen3 M=1 layer 34.0 -> 32.4 µs, bench/NOTES.md v16).
GEMM1 cannot know its experts before the routing plan completes, but at M = 1 they are the token's k
expert ids (hint_ptr, the plan's own input): warp 0 reads them before the wait, guesses its first
tile's expert from them and asks L2 for that tile's first HINT_K_TILES k-tiles of weights (TMA
prefetch), so HBM works while the plan runs. Only a hint: the loads after the wait use the plan's
offsets, and a wrong guess (stale or duplicate ids) costs only the prefetched bytes (M = 1 in graph
0.2-0.9 µs faster on every benchmarked shape, bench/NOTES.md v28).

L2: a 64-row kernel loads the weights of an expert with one m-tile as evict-first (read once, they
would only push the rows and outputs that are read again out of L2); see _weight_policy.

fp8 operands (Epilogue.scales "fp8", the quantized path's fp8 schemes): A and B in e4m3 with 128-element
k-tiles (the same 128-byte rows as 16-bit operands' 64), WGMMA m64nNk32 into the same fp32
accumulators, which the epilogue first multiplies by their A row's scale and their weight row's (per
row or per tensor, per channel or per expert: SCALES, MoeGemmSm90._scale).

B parts: a gated activation with w13 = [gate; up] loads the gate rows and the up rows of the same
output columns as two parts with two accumulators, so the epilogue combines act(gate) * up within
each thread; interleaved gate/up (gpt-oss) is one part whose adjacent columns pair up in the same
thread's registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

SMEM_CAPACITY = 232448  # sm_90: 227 KB per block
_LOG2E = 1.4426950408889634
_SQRT_2_OVER_PI = 0.7978845608028654
# Epilogue staging: 64 output columns at a time per warp, rows padded to 72 elements (144 bytes) so the
# 16 rows of a warp's 32-bit writes fall in different banks.
EPI_COLS = 64
EPI_STRIDE = 72
EPI_WARPS = 8
EPI_BYTES = EPI_WARPS * 16 * (EPI_STRIDE * 2 + 4)
# The expert offsets live in shared memory for the tile walk (one round of loads per CTA instead of one
# dependent round per 32 experts); the interface declines more local experts than this.
MAX_EXPERTS = 1024
# L2 cache policies for TMA loads (createpolicy.fractional with fraction 1.0, CUTLASS's CacheHintSm90).
L2_EVICT_NORMAL = 0x1000000000000000
L2_EVICT_FIRST = 0x12F0000000000000
OFFSETS_BYTES = 4 * (MAX_EXPERTS + 4)
# B rows per part of a tile (tile_n / parts): each consumer warpgroup's WGMMA takes half of them.
PART_ROWS = (48, 64, 96, 128, 256)
# k-tiles of weights GEMM1's first tile asks L2 for before its wait at M = 1 (see the module docstring):
# more delays the plan and the loads after the wait (M = 1 in graph: 2-4 best on every shape, 16
# slower than none; bench/NOTES.md v28).
HINT_K_TILES = 4
# Expert ids a hint may read: one per lane of warp 0.
HINT_MAX_PAIRS = 32
# Accumulators per thread of a swapped tile (64 weight rows x 16 tokens over 128 threads), handed from
# the up warpgroup to the gate one.
XCHG_ELEMS = 64 * 16 // 128


# The gated activations the epilogue computes (_gated); relu2 is the one without a gate.
GATED = ("silu", "gelu", "gelu_tanh", "swigluoai", "silu_clamped", "swiglu_softcapped")
# The parameters each kind reads in _gated; the others ignore alpha and limit.
READS = {"swigluoai": ("alpha", "limit"), "silu_clamped": ("limit",), "swiglu_softcapped": ("alpha", "limit")}
# Scales of quantized (fp8) operands, applied to the accumulators before anything else in the epilogue:
# acc[r, n] *= a_scale[src(r) * a_scale_stride] * w_scale[e, min(b(n), w_scale_cols - 1)], b(n) the B
# (weight) row of accumulator column n. a_scale: one float32 per A row, read at the tile's source rows
# (the token's for GEMM1, which gathers; the grouped row's for GEMM2), or with a stride of 0 one
# per-tensor value. w_scale: [E, w_scale_cols] float32, one per weight row (per channel) or, with one
# column, one per expert. One kernel for all four: the strides and columns are arguments.
# "fp8_block": block scales that change along K (DeepSeek-V3's and Qwen3-FP8's: 1x128 groups of A rows,
# 128x128 blocks of weights): a_scale [rows_a, kb], w_scale [E, cdiv(N, 128), kb] with kb = cdiv(K, 128),
# one k-tile per K block, scaled by their row's and their weight block's scales for that k-tile.
# Promotion (both e4m3 kinds): each k-tile's products go to temporary accumulators, which the consumers
# add to the tile's fp32 ones (with "fp8_block" scaled first). Hopper's fp8 WGMMA keeps fewer bits than
# fp32 when it adds into its accumulator, so summing all of K there ("fast accumulation") lost 2.3% of
# the result at K = 4096 and 9.8% at K = 14336 on same-sign data (bench/fp8_accuracy.py, NOTES v48);
# 128 products per WGMMA chain keep the error at bf16's rounding. The WGMMAs of one k-tile then wait for
# the previous one's promotion (swapped per-tensor/per-row tiles instead promote one k-tile behind, from
# two sets of temporaries: MoeGemmSm90.lag), and the temporaries double the accumulators, so the widest
# tiles (128 x 256) are refused (PROMOTE_MAX_ACC).
SCALES = ("none", "fp8", "fp8_block")
SCALE_BLOCK = 128
# fp32 accumulator elements per consumer thread a promoting (e4m3) tile may hold, temporaries included.
PROMOTE_MAX_ACC = 128


@dataclass(frozen=True)
class Epilogue:
    """What the epilogue does to each accumulator row before storing it.
    activation: "none" (store), or a GATED kind, or relu2.
    gate_layout: "concat" ([gate; up] as two B parts), "interleaved" (pairs of columns) or "none".
    scales: "none" (bf16/fp16 operands), "fp8" (e4m3 operands, the accumulators scaled first) or
    "fp8_block" (e4m3 operands, each k-tile's products scaled in the main loop): SCALES. Both e4m3
    kinds add each k-tile's products to fp32 accumulators in the main loop (promotion)."""

    activation: str = "none"
    gate_layout: str = "none"
    alpha: float = 1.702
    limit: float = 7.0
    has_bias: bool = False
    scales: str = "none"

    def __post_init__(self):
        if self.scales not in SCALES:
            raise ValueError(f"Epilogue.scales: got {self.scales!r}; allowed: {', '.join(map(repr, SCALES))}")
        gated = self.activation in GATED
        if gated != (self.gate_layout in ("concat", "interleaved")):
            raise ValueError(f"Epilogue: activation {self.activation!r} does not go with gate_layout {self.gate_layout!r}")
        # A parameter the kind does not read takes its default, so that it names no kernel variant of
        # its own: the compile key is the epilogue's repr.
        for name in ("alpha", "limit"):
            if name not in READS.get(self.activation, ()):
                object.__setattr__(self, name, type(self).__dataclass_fields__[name].default)


def _sigmoid(x):
    # rcp.approx (one MUFU op) rather than an IEEE division: its error is far below bf16's, and the
    # division's Newton steps and slow-path branch per element cost GEMM1 2-6% at M = 8192
    # (bench/NOTES.md, v6).
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * _LOG2E, fastmath=True))


def _gated(kind: str, g, u, alpha: float, limit: float):
    """act(gate) * up in float32 (trace-time dispatch on kind)."""
    if const_expr(kind == "silu"):
        return g * _sigmoid(g) * u
    if const_expr(kind == "gelu"):
        return 0.5 * g * (1.0 + cute.math.erf(g * 0.7071067811865476)) * u
    if const_expr(kind == "gelu_tanh"):
        return 0.5 * g * (1.0 + cute.math.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g))) * u
    if const_expr(kind == "swiglu_softcapped"):
        # alpha * tanh(g / alpha) * sigmoid(g) * limit * tanh(u / limit): the caps are compile-time
        # constants, so each division is a multiply by a folded reciprocal.
        gs = Float32(alpha) * cute.math.tanh(g * Float32(1.0 / alpha))
        us = Float32(limit) * cute.math.tanh(u * Float32(1.0 / limit))
        return gs * _sigmoid(g) * us
    # swigluoai and silu_clamped: gate clamped from above, up on both sides; swigluoai then scales the
    # sigmoid's argument by alpha and adds one to up.
    gc = cute.arch.fmin(g, Float32(limit))
    uc = cute.arch.fmax(cute.arch.fmin(u, Float32(limit)), Float32(-limit))
    if const_expr(kind == "silu_clamped"):
        return gc * _sigmoid(gc) * uc
    return gc * _sigmoid(gc * alpha) * (uc + 1.0)


@cute.jit
def _quad_transpose(v, kind):
    """A 4x4 transpose across each quad of lanes: lane t's v[i] (i = 0..3, 32-bit values of type kind)
    goes to lane i, which returns them as out[t], t = 0..3. Two butterfly rounds of two shuffles:
    lanes t and t ^ 2 swap the pair meant for the other's half, then lanes t and t ^ 1 the value meant
    for the other."""
    quad_lane = cute.arch.lane_idx() % 4
    lo, hi = quad_lane % 2 == 1, quad_lane // 2 == 1
    keep0, keep1 = kind(cutlass.select_(hi, v[2], v[0])), kind(cutlass.select_(hi, v[3], v[1]))
    send0, send1 = kind(cutlass.select_(hi, v[0], v[2])), kind(cutlass.select_(hi, v[1], v[3]))
    got0 = cute.arch.shuffle_sync_bfly(send0, 2)
    got1 = cute.arch.shuffle_sync_bfly(send1, 2)
    # keep_d: this lane's value for lane 2h + d (h its own half); got_d: lane t ^ 2's for the same lane.
    a_own, b_own = kind(cutlass.select_(lo, keep1, keep0)), kind(cutlass.select_(lo, got1, got0))
    a_send, b_send = kind(cutlass.select_(lo, keep0, keep1)), kind(cutlass.select_(lo, got0, got1))
    a_got = cute.arch.shuffle_sync_bfly(a_send, 1)
    b_got = cute.arch.shuffle_sync_bfly(b_send, 1)
    # out[j] came from lane j: j = t (a_own), t ^ 2 (b_own), t ^ 1 (a_got), t ^ 3 (b_got).
    out = []
    for j in cutlass.range_constexpr(4):
        x = quad_lane ^ j
        low = kind(cutlass.select_(x & 2 != 0, b_own, a_own))
        high = kind(cutlass.select_(x & 2 != 0, b_got, a_got))
        out.append(kind(cutlass.select_(x & 1 != 0, high, low)))
    return out


@cute.jit
def _store_piece(piece, store, mC, tCcC, base, block_col, row0, rows_left, n_out):
    """Store a quad lane's piece after _quad_transpose: lane 2h + d holds row half h (fragment element
    base's row, or base + 2's, 8 below) and the piece's width of columns from block_col (the
    quad's first column, lane 0's) plus d widths; masked to rows < rows_left and columns < n_out."""
    quad_lane = cute.arch.lane_idx() % 4
    width = cute.size(piece)
    row = Int32(cutlass.select_(quad_lane // 2 == 1, tCcC[base + 2][0], tCcC[base][0]))
    first = block_col + Int32(cutlass.select_(quad_lane % 2 == 1, width, 0))
    # n_out is a multiple of 64 and first of the width (4 or 8): first < n_out covers the whole piece.
    if row < rows_left and first < n_out:
        cute.copy(store, piece, cute.local_tile(mC[row0 + row, None], (width,), (first // width,)))


class MoeGemmSm90:
    """See the module docstring. tile_n: B rows per tile over all parts (64 to 256). tile_m: 128 rows
    (the two consumer warpgroups take 64 rows each) or 64 (they split the tile's columns instead:
    for experts with few rows, half the A tile per stage, so more stages of weights in flight), or
    16: swapped operands, the weights as WGMMA's A (64 rows per consumer warpgroup, its M) and the
    16 token rows as its B (N = 16). A 64-row tile with one live row still has each WGMMA read its
    whole A tile from shared memory, which caps what one CTA streams (bench/NOTES.md v20: a CTA
    without WGMMAs streamed 1.7-2.9x faster); swapped, the weights are read once and the tokens are
    256 bytes per WGMMA. tile_n is then 128: [gate; up] as two 64-row parts, one per warpgroup (the
    up warpgroup hands its accumulators to the gate one through shared memory), or 128 rows split
    between the two (interleaved gate/up pairs would land in different threads: refused); or 64
    (k_split): both warpgroups multiply the same 64 rows, each half of every stage's k-blocks, and the
    second hands its partial sums to the first; with a gate those rows are 32 columns' gate and up
    rows paired by a 5-d TMA view (see __init__), for either gate layout."""

    # K elements per k-tile: 128 bytes (one 128-byte swizzled row of shared memory) of the operands.
    ROW_BYTES = 128
    num_consumer_wgs = 2
    threads = 128 * (1 + num_consumer_wgs)
    # After setmaxnreg the warpgroups must fit the 64K-register file together:
    # 128 * 56 + 256 * 224 = 64512 (an increase that does not fit blocks forever).
    producer_regs = 56
    consumer_regs = 224

    def __init__(
        self, epilogue: Epilogue, *, tile_n: int = 256, tile_m: int = 128, gather: bool, num_sms: int = 132, stages: int | None = None,
        early_weights: bool = False,
    ):  # fmt: skip
        # Epilogue stores staged through shared memory (16-byte, row-contiguous) for GEMM2 (no gather)
        # only. Same-run A/B on an H200 (bench/NOTES.md, v2): GEMM2 at M = 8192 10-18% faster; GEMM1
        # mixed (-8% to +10%).
        # tile_m 16: A and B swapped (see the class docstring); its stores are direct.
        self.swap = tile_m == 16
        # e4m3 operands (Epilogue.scales "fp8") take 128 K elements per k-tile, 16-bit ones 64: the same
        # 128-byte rows, so the stages, swizzles and 16-byte chunks are the same bytes.
        self.operand_bytes = 2 if epilogue.scales == "none" else 1
        self.block = epilogue.scales == "fp8_block"
        self.promote = epilogue.scales != "none"
        self.tile_k = self.ROW_BYTES // self.operand_bytes
        self.staged = not gather and not self.swap
        self.epi = epilogue
        self.gather = gather
        # A by TMA: GEMM2 (contiguous rows) with 128-row tiles, see the module docstring. 64-row tiles
        # (weight streaming) keep cp.async and zero-filled rows: there TMA measured no faster, and at
        # qwen3 M = 1 2 µs slower (bench/NOTES.md, v15).
        self.tma_a = not gather and tile_m == 128
        # Rows past the expert then arrive as the next expert's data; with 256-row B tiles the consumers
        # zero them in shared memory before their WGMMAs (at the power cap zeros cost less energy:
        # deepseek and gpt-oss at M = 8192 0.7-0.9% faster, bench/NOTES.md v27). Not with fewer B rows:
        # a 128x128 k-tile is bound by shared memory's bandwidth, which the zero stores take from the
        # WGMMAs (mixtral M = 1024 5-11% slower, v27).
        self.zero_pad = self.tma_a and tile_n == 256
        # defer: GEMM2's 128-row tiles keep their output values (packed in the output dtype) and store
        # them one 64-column chunk under each of the next tile's first k-tiles of WGMMAs, instead of
        # leaving the tensor cores idle while they store (bench/NOTES.md v36: deepseek M = 8192 2-2.5%
        # faster). Not with biases: their loads would then wait before the next tile's first WGMMAs
        # (gpt-oss's recipe 2-3% slower).
        self.defer = self.tma_a and not epilogue.has_bias and not self.promote
        if self.defer:
            # The packed outputs live beside the next tile's accumulators; the producer is one TMA
            # thread, which needs fewer registers than the gathering producers of other variants.
            self.producer_regs, self.consumer_regs = 40, 232
        if 128 * (self.producer_regs + self.num_consumer_wgs * self.consumer_regs) > 65536:
            raise ValueError("producer and consumer register budgets exceed the 64K-register file")
        # early_weights: the producer starts loading the first tile's weights (and every thread reads the
        # offsets) before waiting for the previous kernel, which must then have written neither (GEMM2
        # after GEMM1; see kernel()). Only without gather: GEMM1's previous kernel is the routing plan.
        if early_weights and gather:
            raise ValueError("early_weights=True with gather=True: GEMM1 needs the routing plan's offsets before loading weights")
        self.early_b = early_weights
        self.num_sms = num_sms
        if tile_m not in (16, 64, 128):
            raise ValueError(f"tile_m={tile_m}; allowed: 16, 64, 128")
        self.tile_m = tile_m
        gated = epilogue.gate_layout != "none"
        # Swapped with 64 weight rows (k_split): both consumer warpgroups multiply the same 64 rows, each
        # half of every stage's k-blocks, and the second hands its partial sums to the first. With a
        # gate the 64 rows are 32 output columns, loaded in blocks of 8 gate rows then their 8 up rows
        # (one TMA box over a 5-dimensional view of the weights), so each thread's two accumulator
        # rows (8 apart) are the gate and the up of one column, for either gate layout.
        self.k_split = self.swap and tile_n == 64
        self.paired = self.k_split and gated
        self.num_parts = 2 if epilogue.gate_layout == "concat" and not self.paired else 1
        self.part_n = tile_n // self.num_parts
        if self.part_n not in PART_ROWS:
            raise ValueError(f"tile_n={tile_n} gives {self.part_n} rows per B part; allowed: {', '.join(map(str, PART_ROWS))}")
        # Swapped with [gate; up] in 128 rows: each consumer warpgroup multiplies one 64-row B part
        # (wg_part), and the up warpgroup hands its accumulators to the gate one for the epilogue.
        self.wg_part = self.swap and self.num_parts == 2
        # Both swapped 64-row kinds: the warpgroups share one warpgroup's MMA slicing, and the second
        # hands its accumulators to the first (the up part, or the other k-blocks' partial sums).
        self.hand_over = self.wg_part or self.k_split
        if self.swap and not self.k_split and (self.part_n != (64 if self.wg_part else 128) or epilogue.gate_layout == "interleaved"):
            raise ValueError(
                f"tile_m=16 (swapped operands) with tile_n={tile_n} and gate_layout {epilogue.gate_layout!r}: it needs "
                "tile_n 64 (any gate layout), or 128 with concat or without a gate (not interleaved)"
            )
        # Consumer warpgroups along (M, N) of the MMA: with 128-row tiles 64 token rows each, with 64-row
        # tiles half of the weight rows each (as WGMMA's N), swapped 64 weight rows each (as its M), or
        # the same 64 (wg_part, k_split: the grid is one warpgroup's, each slices it by its own index).
        self.wg_grid = (1, 2) if tile_m == 64 else ((1, 1) if self.hand_over else (2, 1))
        # Output columns per tile, and per consumer warpgroup.
        self.out_n = self.part_n // 2 if gated and self.num_parts == 1 else self.part_n
        self.wg_out_n = self.out_n // self.wg_grid[1]
        if self.staged and self.wg_out_n % 32:
            # _store_staged writes whole 32-column pieces of an n_out that is a multiple of 64.
            raise ValueError(
                f"tile_n={tile_n} with tile_m={tile_m} gives each warpgroup {self.wg_out_n} columns; without gather "
                "(staged stores) that must be a multiple of 32"
            )
        # lag: per-tensor/per-row e4m3 tiles promote each k-tile's products one k-tile later, from two
        # alternating sets of temporaries, so the tensor cores run the next k-tile's WGMMAs meanwhile
        # (see the main loop). Block scales keep the wait: their scales would be held twice as long.
        # Swapped tiles only (small M: a tile's k-tiles are all a CTA does, and its accumulators are
        # few): GEMMs alone 3-8% faster there at M = 1-128 (bench/NOTES.md v51), while a 64 x 64 tile
        # (mixtral M = 1 GEMM2) was 12% slower and the widest tiles lack the registers.
        # The same tiles also load their fp8 scales before the main loop (_scale_factors).
        self.lag = epilogue.scales == "fp8" and self.swap
        if self.promote:
            # Per consumer thread: a 64-row slice of each part (swapped: 64 weight rows x 16 tokens), doubled.
            per_part = 64 * (self.tile_m if self.swap else self.part_n // self.wg_grid[1]) // 128
            acc = 2 * per_part * (self.num_parts if not self.wg_part else 1)
            if acc > PROMOTE_MAX_ACC:
                raise ValueError(
                    f"tile_m={tile_m}, tile_n={tile_n} with e4m3 operands: {acc} fp32 accumulators per thread with the "
                    f"promotion's temporaries; at most {PROMOTE_MAX_ACC} fit beside the rest (tile_n 128 for 128-row tiles)"
                )
        # A tile + B parts per stage, 128-byte rows; the rest of shared memory is the epilogue's
        # staging buffers and barriers.
        stage_bytes = (self.tile_m + self.num_parts * self.part_n) * self.ROW_BYTES
        epi_bytes = EPI_BYTES if self.staged else 0
        free = SMEM_CAPACITY - 4096 - OFFSETS_BYTES - epi_bytes
        self.num_stages = stages if stages is not None else min(12, free // stage_bytes)

    # ---- host side -------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,  # A (rows_a, K), row-major
        b0_ptr: cute.Pointer,  # B part 0 (N_part, K) per expert, row-major, experts b_stride apart
        b1_ptr: cute.Pointer,  # B part 1 (the up rows), or b0_ptr again with one part
        c_ptr: cute.Pointer,  # C (P, N_out), row-major
        offsets_ptr: cute.Pointer,  # (E + 1,) int32
        gather_ptr: cute.Pointer,  # (P,) int32; read only when gather
        hint_ptr: cute.Pointer,  # (hint_pairs,) int32 expert ids, hint_stride apart (GEMM1 at M = 1)
        bias_ptr: cute.Pointer,  # (E, N) bias rows; read only with has_bias
        a_scale_ptr: cute.Pointer,  # (rows_a, scale_k) float32 A scales, rows a_scale_stride apart (fp8 only)
        w_scale_ptr: cute.Pointer,  # (E, w_scale_cols, scale_k) float32 weight scales (fp8 only)
        rows_a: Int32,
        k: Int32,
        n_part: Int32,
        num_experts: Int32,
        b_stride: Int32,  # elements between experts in B
        rows_c: Int32,
        n_out: Int32,
        bias_stride: Int32,
        hint_pairs: Int32,  # 0: no hint; else the token's k <= HINT_MAX_PAIRS expert ids (M = 1, gather only)
        hint_stride: Int32,  # elements between the ids (2: the low words of int64 ids)
        a_scale_stride: Int32,  # elements between A rows' scales (0: one per-tensor scale)
        w_scale_cols: Int32,  # N: one scale per weight row; 1: one per expert; fp8_block: cdiv(N, 128)
        scale_k: Int32,  # fp8_block: the K blocks, cdiv(K, 128), per A row and per weight block row; else 1
        stream: cuda.CUstream,
    ):
        # Shapes the kernel relies on (checked by the caller): K and the B/C rows are multiples of
        # 64 elements, so every 16-byte chunk and TMA box is aligned.
        k = cute.assume(k, divby=64)
        b_stride = cute.assume(b_stride, divby=64)
        n_out = cute.assume(n_out, divby=64)
        # Bias rows are N = 2I, I or H long (multiples of 64; 0 without a bias): its pair loads are aligned.
        bias_stride = cute.assume(bias_stride, divby=64)
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows_a, k), stride=(k, 1)))
        mB0 = cute.make_tensor(b0_ptr, cute.make_layout((n_part, k, num_experts), stride=(k, 1, b_stride)))
        if const_expr(self.paired):
            # Rows as (8 of a block, gate/up, block): tile row r is output column r % 8 + 8 (r // 16),
            # the gate's when (r // 8) % 2 == 0. [gate; up] has the up rows n_part rows after the gate
            # rows; interleaved has them one row after, in n_part = 2 x columns rows.
            n_part = cute.assume(n_part, divby=64)
            if const_expr(self.epi.gate_layout == "concat"):
                rows = cute.make_layout((8, 2, n_part // 8), stride=(k, n_part * k, 8 * k))
            else:
                rows = cute.make_layout((8, 2, n_part // 16), stride=(2 * k, k, 16 * k))
            mB0 = cute.make_tensor(b0_ptr, cute.make_layout((rows.shape, k, num_experts), stride=(rows.stride, 1, b_stride)))
        mB1 = cute.make_tensor(b1_ptr, cute.make_layout((n_part, k, num_experts), stride=(k, 1, b_stride)))
        mC = cute.make_tensor(c_ptr, cute.make_layout((rows_c, n_out), stride=(n_out, 1)))
        mOffsets = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
        mGather = cute.make_tensor(gather_ptr, cute.make_layout((rows_c,)))
        mHint = cute.make_tensor(hint_ptr, cute.make_layout((hint_pairs,), stride=(hint_stride,)))
        mBias = cute.make_tensor(bias_ptr, cute.make_layout((num_experts, bias_stride), stride=(bias_stride, 1)))
        if const_expr(self.block):
            mAScale = cute.make_tensor(a_scale_ptr, cute.make_layout((rows_a, scale_k), stride=(a_scale_stride, 1)))
            mWScale = cute.make_tensor(
                w_scale_ptr, cute.make_layout((num_experts, w_scale_cols, scale_k), stride=(w_scale_cols * scale_k, scale_k, 1))
            )
        else:
            # One K block (scale_k = 1), static: a dynamic stride per index costs the epilogue registers
            # (the 128 x 256 tiles spilled).
            mAScale = cute.make_tensor(a_scale_ptr, cute.make_layout((rows_a, 1), stride=(a_scale_stride, 0)))
            mWScale = cute.make_tensor(w_scale_ptr, cute.make_layout((num_experts, w_scale_cols, 1), stride=(w_scale_cols, 1, 0)))
        dtype = mA.element_type
        if const_expr(dtype.width != 8 * self.operand_bytes):
            raise TypeError(f"MoeGemmSm90 with Epilogue.scales {self.epi.scales!r} takes {8 * self.operand_bytes}-bit operands, got {dtype}")
        stages = self.num_stages
        # Swapped: the MMA's M is 64 weight rows per warpgroup, its N the tile's 16 tokens.
        mma_n = self.tile_m if self.swap else self.part_n // self.wg_grid[1]
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (*self.wg_grid, 1), tiler_mn=(64, mma_n),
        )  # fmt: skip
        a_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, self.tile_k), dtype
        )
        b_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, self.tile_k), dtype
        )
        sA_layout = cute.tile_to_shape(a_atom, (self.tile_m, self.tile_k, stages), order=(0, 1, 2))
        sB_layout = cute.tile_to_shape(b_atom, (self.part_n, self.tile_k, stages), order=(0, 1, 2))
        sB_one = cute.slice_(sB_layout, (None, None, 0))
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_b0, gB0 = cpasync.make_tiled_tma_atom(tma_op, mB0, sB_one, (self.part_n, self.tile_k))
        tma_b1, gB1 = cpasync.make_tiled_tma_atom(tma_op, mB1, sB_one, (self.part_n, self.tile_k))
        self.b_bytes = self.num_parts * cute.size_in_bytes(dtype, sB_one)
        # A (rows row0.. of GEMM2's own input) by TMA; the atom is built for every variant, used with tma_a.
        sA_one = cute.slice_(sA_layout, (None, None, 0))
        tma_a, gA = cpasync.make_tiled_tma_atom(tma_op, mA, sA_one, (self.tile_m, self.tile_k))
        self.tma_bytes = self.b_bytes + (cute.size_in_bytes(dtype, sA_one) if self.tma_a else 0)

        # B rings (one per part): wg_part keeps both in sB0, one after the other (a consumer warpgroup finds
        # its part by offset); otherwise part 1 has sB1.
        rings0 = self.num_parts if self.wg_part else 1
        rings1 = self.num_parts - rings0

        @cute.struct
        class Storage:
            bar_a: cute.struct.MemRange[cutlass.Int64, stages * 2]
            bar_b: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sA_layout)], 1024]
            sB0: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sB_layout) * rings0], 1024]
            sB1: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sB_layout) * rings1 + 8], 1024]
            sXchg: cute.struct.Align[cute.struct.MemRange[Float32, XCHG_ELEMS * 128 if self.hand_over else 4], 16]
            sEpi: cute.struct.Align[cute.struct.MemRange[mC.element_type, EPI_WARPS * 16 * EPI_STRIDE if self.staged else 8], 128]
            sDest: cute.struct.Align[cute.struct.MemRange[Int32, EPI_WARPS * 16 if self.staged else 4], 16]
            sOffsets: cute.struct.Align[cute.struct.MemRange[Int32, MAX_EXPERTS + 4], 16]

        self.storage = Storage
        self.kernel(
            self.tiled_mma, tma_a, gA, tma_b0, gB0, tma_b1, gB1, mA, mC, mOffsets, mGather, mHint, mBias, mAScale, mWScale,
            sA_layout, sB_layout,
        ).launch(grid=[self.num_sms, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream, use_pdl=True)  # fmt: skip

    # ---- device side -----------------------------------------------------------------------------

    @cute.jit
    def _load_offsets(self, mOffsets: cute.Tensor, sOff: cute.Tensor, num_experts: Int32):
        """sOff[i] = mOffsets[i] for i <= num_experts (<= MAX_EXPERTS), by all threads of the CTA: every
        load is issued before the first store, so the table costs one round trip to L2."""
        tidx, _, _ = cute.arch.thread_idx()
        rounds = (MAX_EXPERTS + 1 + self.threads - 1) // self.threads
        vals = cute.make_rmem_tensor(rounds, Int32)
        for j in cutlass.range_constexpr(rounds):
            i = tidx + j * self.threads
            if i <= num_experts:
                vals[j] = cute.arch.load(mOffsets.iterator + i, Int32, cop="cg")
        for j in cutlass.range_constexpr(rounds):
            i = tidx + j * self.threads
            if i <= num_experts:
                sOff[i] = vals[j]

    @cute.jit
    def _load_weights(self, tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, n_tile, kt, e, index, bar, policy):
        """TMA of k-tile kt of expert e's weight tile n_tile (every B part) into stage `index`; with
        64-row and swapped tiles under L2 policy `policy` (_weight_policy), with 128-row tiles with none."""
        for tma, tBgB, tBsB in ((tma_b0, tBgB0, tBsB0), (tma_b1, tBgB1, tBsB1))[: self.num_parts]:
            if const_expr(self.tile_m <= 64):
                cute.copy(tma, tBgB[(None, n_tile, kt, e)], tBsB[(None, index)], tma_bar_ptr=bar, cache_policy=policy)
            else:
                cute.copy(tma, tBgB[(None, n_tile, kt, e)], tBsB[(None, index)], tma_bar_ptr=bar)

    @cute.jit
    def _weight_policy(self, e_tiles: Int32, n_tiles: Int32) -> Int64:
        """The L2 policy for the weights of an expert with e_tiles tiles, in a 64-row (weight streaming)
        kernel: evict first when the expert has one m-tile, as no other tile reads these bytes and
        keeping them only pushes out of L2 the rows this GEMM re-reads and the output the next kernel
        reads (qwen3 M = 16 and 128 2.4% and 3.0% faster, mixtral M = 128 1.4%; bench/NOTES.md v17);
        normal when its other m-tiles read them from L2 (evict first for every expert cost mixtral
        M = 1024 4%). 128-row kernels load without a policy: experts of several m-tiles are their
        common case, and with these policies qwen3 M = 1024 and deepseek M = 8192 read 1% slower."""
        policy = Int64(L2_EVICT_NORMAL)
        if e_tiles == n_tiles:
            policy = Int64(L2_EVICT_FIRST)
        return policy

    @cute.jit
    def _early_weights(self, pipe_b, tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, sOff, num_experts, n_tiles, k_tiles) -> Int32:
        """Start the TMA of the weights of this CTA's first tile into the ring's first stages, before
        the wait for the previous kernel (GEMM2, early_b): at small M a CTA's whole job is one tile,
        and its weights then stream while GEMM1 finishes. Returns how many k-tiles were started (the
        producer loop skips their weights; their barriers still count A's bytes). Warp 0 only."""
        tile, e, base, e_tiles = self._walk_start(sOff, num_experts, n_tiles)
        early = Int32(0)
        if e < num_experts:
            n_tile, _, _ = self._tile_coords(sOff, e, tile - base, e_tiles, n_tiles)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            early = cutlass.min(k_tiles, self.num_stages)
            for kt in range(early):
                pipe_b.producer_acquire(state)
                self._load_weights(
                    tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, n_tile, kt, e, state.index,
                    pipe_b.producer_get_barrier(state), self._weight_policy(e_tiles, n_tiles),
                )  # fmt: skip
                state.advance()
        return early

    @cute.jit
    def _weight_partitions(self, tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1):
        """(tBsB0, tBgB0, tBsB1, tBgB1): each B part's TMA partitions of the (part_n, tile_k) tiles of
        every (n, k, expert), indexed (None, n_tile, kt, e) in global memory and (None, stage) in the
        ring, for the loads (_load_weights) and the hint's prefetches alike."""
        gB0 = cute.local_tile(gB0_full, (self.part_n, self.tile_k), (None, None, None))
        tBsB0, tBgB0 = cpasync.tma_partition(tma_b0, 0, cute.make_layout(1), cute.group_modes(sB0, 0, 2), cute.group_modes(gB0, 0, 2))
        gB1 = cute.local_tile(gB1_full, (self.part_n, self.tile_k), (None, None, None))
        tBsB1, tBgB1 = cpasync.tma_partition(tma_b1, 0, cute.make_layout(1), cute.group_modes(sB1, 0, 2), cute.group_modes(gB1, 0, 2))
        return tBsB0, tBgB0, tBsB1, tBgB1

    @cute.jit
    def _hint_weights(self, tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1, mHint, num_experts, n_tiles, k_tiles):
        """GEMM1 at M = 1, before its wait (the module docstring): the plan will give each of the
        token's k distinct experts one m-tile, in ascending id order, so this CTA's first tile t is
        n-tile t % n_tiles of the expert with the (t // n_tiles)-th smallest id. Ask L2 for that tile's
        first HINT_K_TILES k-tiles of weights. Lane j reads id j and ranks it by the ids below it; a
        duplicate or out-of-range id only makes the guess wrong. Warp 0, uniformly."""
        lane = cute.arch.lane_idx()
        pairs = mHint.shape[0]
        tile = cute.arch.block_idx()[0]
        mine = Int32(-1)
        if lane < pairs:
            mine = mHint[lane]
        rank = Int32(0)
        for j in range(pairs):
            if cute.arch.shuffle_sync(mine, j) < mine:
                rank = rank + 1
        wanted = Int32(0)
        if lane < pairs:
            if rank == tile // n_tiles:
                wanted = Int32(1)
        holders = cute.arch.vote_ballot_sync(wanted == 1)
        # The lowest lane holding the wanted rank (popc of the bits below it).
        e = cute.arch.shuffle_sync(mine, Int32(cute.arch.popc((holders & (0 - holders)) - 1)) % 32)
        if holders != 0:
            if lane == 0:
                if e >= 0:
                    if e < num_experts:
                        self._prefetch_weights(tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1, tile % n_tiles, e, k_tiles)

    @cute.jit
    def _prefetch_weights(self, tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1, n_tile, e, k_tiles):
        """Ask L2 (TMA prefetch) for the first HINT_K_TILES k-tiles of expert e's weight tile n_tile."""
        _, tBgB0, _, tBgB1 = self._weight_partitions(tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1)
        for kt in cutlass.range_constexpr(HINT_K_TILES):
            if kt < k_tiles:
                for tma, tBgB in ((tma_b0, tBgB0), (tma_b1, tBgB1))[: self.num_parts]:
                    cute.prefetch(tma, tBgB[(None, n_tile, kt, e)])

    @cute.jit
    def _expert_tiles(self, offs: cute.Tensor, e: Int32, n_tiles: Int32) -> Int32:
        rows = offs[e + 1] - offs[e]
        return (rows + self.tile_m - 1) // self.tile_m * n_tiles

    @cute.jit
    def _walk_start(self, offs: cute.Tensor, num_experts: Int32, n_tiles: Int32):
        """(tile, e, base, e_tiles) where every warpgroup starts the walk (module docstring): this
        CTA's first work tile and the expert e that holds it, whose e_tiles tiles start at base."""
        tile = cute.arch.block_idx()[0]
        e, base, e_tiles = self._next_expert(offs, num_experts, tile, Int32(-1), Int32(0), Int32(0), n_tiles)
        return tile, e, base, e_tiles

    @cute.jit
    def _next_expert(self, offs: cute.Tensor, num_experts: Int32, tile: Int32, e: Int32, base: Int32, e_tiles: Int32, n_tiles: Int32):
        """(e, base, e_tiles) of the expert after e that holds `tile` (e >= E when none does), once
        tile lies past expert e's tiles. The 32 lanes of the warp count the tiles of 32 experts at once
        and find the expert by a prefix sum and a ballot: with many experts and few tokens most experts
        are empty, and stepping through them one at a time cost every CTA microseconds per GEMM before
        its first tile (bench/NOTES.md, v6). Every lane of the warp must call this with the same
        arguments (the walk is uniform over the CTA). offs: the offsets (shared memory)."""
        lane = cute.arch.lane_idx()
        base = base + e_tiles
        e = e + 1
        searching = e < num_experts
        while searching:
            mine = e + lane
            count = Int32(0)
            if mine < num_experts:
                count = self._expert_tiles(offs, mine, n_tiles)
            ends = count  # inclusive prefix sum of count over the lanes
            for s in cutlass.range_constexpr(5):
                below = cute.arch.shuffle_sync_up(ends, 1 << s)
                if lane >= (1 << s):
                    ends = ends + below
            # Prefix sums never decrease, so the lanes whose experts end at or before `tile` are the
            # first `skip`; lane `skip` (if < 32) holds the tile.
            skip = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(base + ends <= tile)))
            before = cute.arch.shuffle_sync(ends, (skip + 31) % 32)
            e_tiles = cute.arch.shuffle_sync(count, skip % 32)
            if skip > 0:
                base = base + before
            e = e + skip
            searching = skip == 32 and e < num_experts
        return e, base, e_tiles

    @cute.jit
    def _tile_coords(self, offs: cute.Tensor, e: Int32, local: Int32, e_tiles: Int32, n_tiles: Int32):
        """(n_tile, first row, rows left in the expert) of expert e's local-th work tile. M-tiles vary
        fastest, so the CTAs working at the same time share the expert's weight tile in L2."""
        m_tiles = e_tiles // n_tiles
        row0 = offs[e] + local % m_tiles * self.tile_m
        return local // m_tiles, row0, offs[e + 1] - row0

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        gA_full: cute.Tensor,
        tma_b0: cute.CopyAtom,
        gB0_full: cute.Tensor,
        tma_b1: cute.CopyAtom,
        gB1_full: cute.Tensor,
        mA: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mGather: cute.Tensor,
        mHint: cute.Tensor,
        mBias: cute.Tensor,
        mAScale: cute.Tensor,
        mWScale: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            if const_expr(self.tma_a):
                cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b0)
            if const_expr(self.num_parts == 2):
                cpasync.prefetch_descriptor(tma_b1)

        storage = SmemAllocator().allocate(self.storage)
        stages = self.num_stages
        # B's pipeline; GEMM2's A tiles arrive on the same barriers.
        pipe_b = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_b.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * 4),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipe_a = None
        if const_expr(not self.tma_a):
            pipe_a = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.bar_a.data_ptr(),
                num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_consumer_wgs),
                defer_sync=True,
            )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB0 = storage.sB0.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sB1 = sB0
        if const_expr(self.wg_part):
            sB1 = cute.make_tensor(sB0.iterator + cute.cosize(sB_layout), sB0.layout)
        elif const_expr(self.num_parts == 2):
            sB1 = storage.sB1.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sOff = storage.sOffsets.get_tensor(cute.make_layout((MAX_EXPERTS + 1,)))

        num_experts = mOffsets.shape[0] - 1
        k_dim = mA.shape[1]
        n_out = mC.shape[1]
        k_tiles = (k_dim + self.tile_k - 1) // self.tile_k
        if const_expr(self.lag):
            # The main loop takes k-tiles in pairs (one per set of temporaries); an odd count gets one
            # more, past K, which TMA and the zero-filled gather make all zeros.
            k_tiles = k_tiles + k_tiles % 2
        n_tiles = (n_out + self.out_n - 1) // self.out_n
        grid = cute.arch.grid_dim()[0]
        # GEMM1's weight hint (the module docstring) reads the expert ids before the wait: the kernel
        # before the plan writes them and may still be running (a kernel that lets the plan launch at
        # its start), so they may be stale; only prefetches depend on them.
        if const_expr(self.gather):
            if warp_idx == 0:
                if mHint.shape[0] > 0:
                    self._hint_weights(tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1, mHint, num_experts, n_tiles, k_tiles)
        # Programmatic dependent launch (the module docstring): nothing above reads global memory but the
        # hint's ids; after griddepcontrol.wait the previous kernel's outputs are complete. Letting the
        # next kernel launch then only queues its CTAs for the SMs this one frees.
        # With early_b (GEMM2 after GEMM1) the offsets are read before the wait: the routing plan wrote
        # them, and it completed before GEMM1 passed its own wait, which precedes GEMM1's launch of this
        # kernel. The loads bypass L1, which may hold the offsets of an earlier launch.
        if const_expr(not self.early_b):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        self._load_offsets(mOffsets, sOff, num_experts)
        cute.arch.sync_threads()

        if wg_idx == 0:
            # ------------------------------- producer ---------------------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            tBsB0, tBgB0, tBsB1, tBgB1 = self._weight_partitions(tma_b0, gB0_full, sB0, tma_b1, gB1_full, sB1)
            state_b = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            # k-tiles of the first tile whose weights are already loading (early_b).
            early = Int32(0)
            if const_expr(self.early_b):
                if warp_idx == 0:
                    early = self._early_weights(pipe_b, tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, sOff, num_experts, n_tiles, k_tiles)
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            if const_expr(self.tma_a):
                if warp_idx == 0:
                    tile, e, base, e_tiles = self._walk_start(sOff, num_experts, n_tiles)
                    while e < num_experts:
                        if tile < base + e_tiles:
                            n_tile, row0, rows_left = self._tile_coords(sOff, e, tile - base, e_tiles, n_tiles)
                            policy = self._weight_policy(e_tiles, n_tiles)
                            # The tile's A rows start at row0, which need not be a multiple of tile_m.
                            gA = cute.local_tile(cute.domain_offset((row0, 0), gA_full), (self.tile_m, self.tile_k), (0, None))
                            tAsA, tAgA = cpasync.tma_partition(
                                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                            )
                            for kt in range(k_tiles):
                                bar = pipe_b.producer_get_barrier(state_b)
                                if kt >= early:
                                    pipe_b.producer_acquire(state_b)
                                    self._load_weights(tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, n_tile, kt, e, state_b.index, bar, policy)
                                # An early k-tile's barrier already expects A's bytes too.
                                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state_b.index)], tma_bar_ptr=bar)
                                state_b.advance()
                            early = Int32(0)
                            tile += grid
                        else:
                            e, base, e_tiles = self._next_expert(sOff, num_experts, tile, e, base, e_tiles, n_tiles)
                    pipe_b.producer_tail(state_b)
            else:
                # A: each thread copies 16-byte chunk (tidx % 8) of rows tidx // 8 + 16 i, i < 8.
                copy_atom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), mA.element_type, num_bits_per_copy=128
                )
                chunk_elems = 16 // self.operand_bytes
                tiled_copy = cute.make_tiled_copy_tv(
                    copy_atom, cute.make_layout((16, 8), stride=(8, 1)), cute.make_layout((1, chunk_elems))
                )
                thr_copy = tiled_copy.get_slice(tidx)
                tAsA = thr_copy.partition_D(sA)  # ((8), 8, 1, stages)
                chunk = tidx % 8
                row_in = tidx // 8
                rows_per_thread = self.tile_m // 16
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                src = cute.make_rmem_tensor(rows_per_thread, Int32)
                # One predicate for the elements of a 16-byte chunk (stride 0).
                live = cute.make_rmem_tensor(cute.make_layout(((chunk_elems,), 1), stride=((0,), 0)), cutlass.Boolean)
                # 16-byte chunks of K: with 128-element k-tiles (fp8) a K that is a multiple of 64 only
                # leaves the last k-tile half full, and its chunks past K are zero-filled like dead rows.
                k_chunks = k_dim // chunk_elems

                tile, e, base, e_tiles = self._walk_start(sOff, num_experts, n_tiles)
                while e < num_experts:
                    if tile < base + e_tiles:
                        n_tile, row0, rows_left = self._tile_coords(sOff, e, tile - base, e_tiles, n_tiles)
                        policy = self._weight_policy(e_tiles, n_tiles)
                        dead = Int32(0)  # bit i: row i of this thread is past the expert (source row 0, zero-filled)
                        for i in cutlass.range_constexpr(rows_per_thread):
                            r = row_in + 16 * i
                            src[i] = 0
                            if r >= rows_left:
                                dead = dead | (1 << i)
                            else:
                                if const_expr(self.gather):
                                    src[i] = mGather[row0 + r]
                                else:
                                    src[i] = row0 + r
                        for kt in range(k_tiles):
                            pipe_a.producer_acquire(state)
                            if warp_idx == 0:
                                if kt >= early:
                                    pipe_b.producer_acquire(state_b)
                                    bar = pipe_b.producer_get_barrier(state_b)
                                    self._load_weights(tma_b0, tBgB0, tBsB0, tma_b1, tBgB1, tBsB1, n_tile, kt, e, state_b.index, bar, policy)
                            past_k = Int32(0)
                            if const_expr(self.tile_k > 64):
                                past_k = Int32(cutlass.select_(kt * 8 + chunk >= k_chunks, 1, 0))
                            for i in cutlass.range_constexpr(rows_per_thread):
                                # Dead rows: cp.async with source size 0 (zero-fill; the module docstring).
                                live[0] = ((dead >> i) | past_k) & 1 == 0
                                g_chunk = cute.local_tile(mA[src[i], None], (chunk_elems,), (kt * 8 + chunk,))
                                cute.copy(copy_atom, g_chunk, tAsA[(None, i, 0, state.index)], pred=live)
                            pipe_a.producer_commit(state)
                            state.advance()
                            state_b.advance()
                        early = Int32(0)
                        tile += grid
                    else:
                        e, base, e_tiles = self._next_expert(sOff, num_experts, tile, e, base, e_tiles, n_tiles)
                pipe_a.producer_tail(state)
                if warp_idx == 0:
                    pipe_b.producer_tail(state_b)
        else:
            # ------------------------------- consumers --------------------------------------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if const_expr(self.early_b):
                # No global write before the previous kernel completes: C may reuse memory it reads.
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            sEpi = storage.sEpi.get_tensor(cute.make_layout((16, EPI_STRIDE, EPI_WARPS), stride=(EPI_STRIDE, 1, 16 * EPI_STRIDE)))
            sDest = storage.sDest.get_tensor(cute.make_layout((16, EPI_WARPS), stride=(1, 16)))
            ctid = tidx - 128
            thr_mma = tiled_mma.get_slice(ctid % 128 if self.hand_over else ctid)
            sXchg = storage.sXchg.get_tensor(cute.make_layout((XCHG_ELEMS, 128), stride=(128, 1)))
            if const_expr(self.swap):
                # The weights are the MMA's A operand and the tokens its B (C^T = B A^T per tile). With
                # wg_part warpgroup 1 multiplies the gate part and warpgroup 2 the up part: the same
                # code, each its own ring (found by offset).
                sB_mine = sB0
                if const_expr(self.wg_part):
                    sB_mine = cute.make_tensor(sB0.iterator + (wg_idx - 1) * cute.cosize(sB_layout), sB0.layout)
                tCrA = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))
                tCrB0 = tiled_mma.make_fragment_A(thr_mma.partition_A(sB_mine))
                tCrB1 = tCrB0
                cC = cute.make_identity_tensor((self.part_n, self.tile_m))
            else:
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
                tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
                cC = cute.make_identity_tensor((self.tile_m, self.part_n))
            tCcC = thr_mma.partition_C(cC)
            acc0 = cute.make_rmem_tensor(tCcC.shape, Float32)
            acc1 = cute.make_rmem_tensor(tCcC.shape, Float32)
            # The WGMMAs' destinations: the accumulators, or with e4m3 operands a k-tile's temporaries.
            c0, c1 = acc0, acc1
            if const_expr(self.promote):
                c0 = cute.make_rmem_tensor(tCcC.shape, Float32)
                c1 = cute.make_rmem_tensor(tCcC.shape, Float32) if self.num_parts == 2 and not self.wg_part else c0
            # lag: the second set of temporaries, for the odd k-tiles.
            d0, d1 = c0, c1
            if const_expr(self.lag):
                d0 = cute.make_rmem_tensor(tCcC.shape, Float32)
                d1 = cute.make_rmem_tensor(tCcC.shape, Float32) if self.num_parts == 2 and not self.wg_part else d0
            # The B part a swapped [gate; up] warpgroup's acc0 holds before the hand-over.
            part0 = (wg_idx - 1) if self.wg_part else 0
            num_k_blocks = cute.size(tCrA, mode=[2])
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            # sA without its swizzle: the swizzle permutes 16-byte chunks within each 128-byte row, so
            # a whole row is the same bytes in either view.
            sA_rows = storage.sA.get_tensor(
                cute.make_layout((self.tile_m, self.tile_k, stages), stride=(self.tile_k, 1, self.tile_m * self.tile_k))
            )

            # defer: the previous tile's packed outputs and where they go (p_rows_left 0: none pending).
            packed = cute.make_rmem_tensor((cute.size(acc0),), mC.element_type)
            p_row0 = Int32(0)
            p_rows_left = Int32(0)
            p_col0 = Int32(0)
            tile, e, base, e_tiles = self._walk_start(sOff, num_experts, n_tiles)
            while e < num_experts:
                if tile < base + e_tiles:
                    n_tile, row0, rows_left = self._tile_coords(sOff, e, tile - base, e_tiles, n_tiles)
                    # Swapped tiles: the thread's few bias values, loaded before the k-loop hides their
                    # latency (at M = 1 loaded after it, they cost the layer 1.5-2 µs; NOTES v34).
                    biases = self._swap_biases(tCcC, mBias, e, n_tile * self.out_n, n_out)
                    # Likewise the fp8 scales: loaded after the k-loop they cost their round trip at the
                    # end of every tile, which at small M is a CTA's only one.
                    factors = ()
                    if const_expr(self.lag):
                        factors = self._scale_factors(tCcC, mAScale, mWScale, mGather, e, row0, rows_left, n_tile, gB1_full.shape[0])

                    acc0.fill(0.0)
                    if const_expr(self.num_parts == 2 and not self.wg_part):
                        acc1.fill(0.0)
                    if const_expr(self.lag):
                        # The first k-tile's promotion adds the odd set before any WGMMA wrote it.
                        d0.fill(0.0)
                        if const_expr(self.num_parts == 2 and not self.wg_part):
                            d1.fill(0.0)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    # lag: two k-tiles per iteration, the even one into (c0, c1), the odd into (d0, d1)
                    # (registers cannot be picked by a run-time index); k_tiles is even then.
                    pair = 2 if self.lag else 1
                    for kp in range(k_tiles // pair):
                        for half in cutlass.range_constexpr(pair):
                            kt = kp * pair + half
                            t0, t1 = (c0, c1) if half == 0 else (d0, d1)
                            if const_expr(self.promote):
                                # The temporaries were read by a promotion (ordinary instructions)
                                # before these WGMMAs overwrite them.
                                warpgroup.fence()
                            if const_expr(not self.tma_a):
                                pipe_a.consumer_wait(read)
                            pipe_b.consumer_wait(read)
                            if const_expr(self.zero_pad):
                                # Zero this warpgroup's share of the rows past the expert before its
                                # WGMMAs read the stage. The fence and barrier run on every k-tile: under a
                                # branch, even a warpgroup-uniform one, ptxas serialises the WGMMAs
                                # (C7520); they measured free (bench/NOTES.md v27).
                                self._zero_rows(sA_rows, read.index, (wg_idx - 1) * 64, rows_left, ctid % 128)
                                cute.arch.fence_view_async_shared()
                                cute.arch.barrier(barrier_id=1 + wg_idx, number_of_threads=128)
                            for kb in cutlass.range_constexpr(num_k_blocks // 2 if self.k_split else num_k_blocks):
                                coord = (None, None, kb, read.index)
                                if const_expr(self.k_split):
                                    # This warpgroup's half of the stage's k-blocks.
                                    coord = (None, None, kb + (wg_idx - 1) * (num_k_blocks // 2), read.index)
                                if const_expr(self.promote):
                                    # A k-tile's first WGMMA overwrites the temporaries (no zeroing: zeros
                                    # written by ordinary instructions made ptxas serialise the WGMMAs).
                                    tiled_mma.set(warpgroup.Field.ACCUMULATE, kb > 0)
                                if const_expr(self.swap):
                                    # One accumulator per warpgroup: its 64 weight rows of the one part it has.
                                    cute.gemm(tiled_mma, t0, tCrB0[coord], tCrA[coord], t0)
                                else:
                                    cute.gemm(tiled_mma, t0, tCrA[coord], tCrB0[coord], t0)
                                    if const_expr(self.num_parts == 2):
                                        cute.gemm(tiled_mma, t1, tCrA[coord], tCrB1[coord], t1)
                            warpgroup.commit_group()
                            if const_expr(self.defer):
                                # One 64-column chunk of the previous tile's outputs under each of the
                                # first k-tiles' WGMMAs (the rest under the last, with fewer k-tiles than
                                # chunks).
                                for q in cutlass.range_constexpr(self._chunks()):
                                    if kt == cutlass.min(q, k_tiles - 1):
                                        if p_rows_left > 0:
                                            self._store_packed(packed, tCcC, mC, p_row0, p_rows_left, p_col0, n_out, sEpi, sDest, q, q + 1)
                            if const_expr(self.lag):
                                # The previous k-tile's products join the fp32 sums while this one's
                                # WGMMAs run (before the first, the zeroed odd set).
                                warpgroup.wait_group(1)
                                if const_expr(half == 0):
                                    self._promote(acc0, acc1, d0, d1, None)
                                else:
                                    self._promote(acc0, acc1, c0, c1, None)
                            elif const_expr(self.promote):
                                # This k-tile's products join the fp32 sums; block scales load under its
                                # WGMMAs.
                                scales = None
                                if const_expr(self.block):
                                    scales = self._block_scales(tCcC, mAScale, mWScale, mGather, e, row0, rows_left, n_tile, gB1_full.shape[0], kt, part0)
                                warpgroup.wait_group(0)
                                self._promote(acc0, acc1, t0, t1, scales)
                            else:
                                # Keep one k-tile of WGMMAs in flight; free the buffer of the one before it.
                                warpgroup.wait_group(1)
                            if kt > 0:
                                if const_expr(not self.tma_a):
                                    pipe_a.consumer_release(release)
                                pipe_b.consumer_release(release)
                                release.advance()
                            read.advance()
                    warpgroup.wait_group(0)
                    if const_expr(self.lag):
                        # The last (odd) k-tile's products.
                        self._promote(acc0, acc1, d0, d1, None)
                    if k_tiles > 0:
                        if const_expr(not self.tma_a):
                            pipe_a.consumer_release(release)
                        pipe_b.consumer_release(release)
                        release.advance()
                    if const_expr(not self.lag):
                        factors = self._scale_factors(tCcC, mAScale, mWScale, mGather, e, row0, rows_left, n_tile, gB1_full.shape[0])
                    if const_expr(self.hand_over):
                        # Warpgroup 2's accumulators to warpgroup 1 (same fragment layout, so thread t of
                        # one reads what thread t of the other wrote): the up part (wg_part), or the
                        # partial sums of the other k-blocks (k_split).
                        if wg_idx == 2:
                            for i in cutlass.range_constexpr(cute.size(acc0)):
                                sXchg[i, ctid % 128] = acc0[i]
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        if wg_idx == 1:
                            for i in cutlass.range_constexpr(cute.size(acc0)):
                                if const_expr(self.k_split):
                                    acc0[i] = acc0[i] + sXchg[i, ctid % 128]
                                else:
                                    acc1[i] = sXchg[i, ctid % 128]
                        # Before the next tile's hand-over overwrites the buffer.
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        if wg_idx == 1:
                            self._scale(acc0, acc1, factors)
                            self._epilogue(acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, n_tile * self.out_n, n_out, sEpi, sDest, biases)
                    elif const_expr(self.defer):
                        self._scale(acc0, acc1, factors)
                        for q in cutlass.range_constexpr(self._chunks()):
                            self._pack(acc0, acc1, tCcC, mBias, e, n_tile * self.out_n, n_out, packed, q, q + 1)
                        p_row0 = row0
                        p_rows_left = rows_left
                        p_col0 = n_tile * self.out_n
                    else:
                        self._scale(acc0, acc1, factors)
                        self._epilogue(acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, n_tile * self.out_n, n_out, sEpi, sDest, biases)
                    tile += grid
                else:
                    e, base, e_tiles = self._next_expert(sOff, num_experts, tile, e, base, e_tiles, n_tiles)
            if const_expr(self.defer):
                if p_rows_left > 0:
                    self._store_packed(packed, tCcC, mC, p_row0, p_rows_left, p_col0, n_out, sEpi, sDest, 0, self._chunks())

    @cute.jit
    def _scale_factors(self, tCcC, mAScale, mWScale, mGather, e, row0, rows_left, n_tile, n_part):
        """Epilogue.scales "fp8": the scales this thread's accumulators take (_scale), loaded before the
        tile's main loop so that their latency hides under it; () for other scales. A non-swapped thread
        holds two rows (fragment element i's row half (i // 2) % 2) and pairs of columns (elements 4b + v
        and 4b + 2 + v share column v of block b): (its two A scales, per part one weight scale per
        column). A swapped one holds a few tokens' columns of a few weight rows: per part one factor
        (A scale x weight scale) per element. (fp8_block scales each k-tile in the main loop instead:
        _block_scales.)"""
        if const_expr(self.epi.scales != "fp8"):
            return ()
        cols = mWScale.shape[1]
        if const_expr(self.swap):
            parts = []
            for p in cutlass.range_constexpr(self.num_parts):
                f = []
                for i in cutlass.range_constexpr(cute.size(tCcC)):
                    n, m = tCcC[i]
                    a = mAScale[self._src_row(mGather, row0, m, rows_left), 0]
                    f.append(a * mWScale[e, cutlass.min(self._w_row(n, p, n_tile, n_part), cols - 1), 0])
                parts.append(f)
            return tuple(parts)
        frag = cute.shape(tCcC)
        assert frag[0][0] == 2 and frag[0][1] == 2 and frag[1] == 1 and frag[2] == 1, frag
        a = (
            mAScale[self._src_row(mGather, row0, tCcC[0][0], rows_left), 0],
            mAScale[self._src_row(mGather, row0, tCcC[2][0], rows_left), 0],
        )
        ws = []
        for p in cutlass.range_constexpr(self.num_parts):
            w = []
            for b in cutlass.range_constexpr(cute.size(tCcC) // 4):
                for v in cutlass.range_constexpr(2):
                    w.append(mWScale[e, cutlass.min(self._w_row(tCcC[4 * b + v][1], p, n_tile, n_part), cols - 1), 0])
            ws.append(w)
        return a, tuple(ws)

    @cute.jit
    def _scale(self, acc0, acc1, factors):
        """Multiply this thread's accumulators by their scales (factors from _scale_factors), before
        the bias and the activation; nothing without fp8 per-tensor/per-row scales."""
        if const_expr(self.epi.scales == "fp8"):
            accs = (acc0, acc1)[: self.num_parts]
            if const_expr(self.swap):
                for p in cutlass.range_constexpr(self.num_parts):
                    for i in cutlass.range_constexpr(cute.size(acc0)):
                        accs[p][i] = accs[p][i] * factors[p][i]
            else:
                a, ws = factors
                for p in cutlass.range_constexpr(self.num_parts):
                    for b in cutlass.range_constexpr(cute.size(acc0) // 4):
                        for v in cutlass.range_constexpr(2):
                            for h in cutlass.range_constexpr(2):
                                accs[p][4 * b + 2 * h + v] = accs[p][4 * b + 2 * h + v] * (a[h] * ws[p][2 * b + v])

    @cute.jit
    def _block_scales(self, tCcC, mAScale, mWScale, mGather, e, row0, rows_left, n_tile, n_part, kt, part0):
        """fp8_block: the scales of k-tile kt for this thread's accumulators, loaded before the k-tile's
        WGMMAs are waited for: (A scales, weight scales per part). Swapped: one of each per element.
        Non-swapped: the two rows' A scales, and per part the scales of the two 128-row blocks its rows
        can span (a part has at most 128 rows here, or 256 aligned to 128), each column pair picking its
        block's: one load per column pair held 32 values across the wait and spilled. part0: the B part
        of acc0 (1 for the up warpgroup of a swapped [gate; up] tile, whose acc0 holds the up rows)."""
        rows_total = n_part * (2 if self.epi.gate_layout == "concat" else 1)
        if const_expr(self.swap):
            a = []
            w = []
            for i in cutlass.range_constexpr(cute.size(tCcC)):
                n, m = tCcC[i]
                a.append(mAScale[self._src_row(mGather, row0, m, rows_left), kt])
                w.append(mWScale[e, self._w_block(self._w_row(n, part0, n_tile, n_part), rows_total), kt])
            return a, (w,)
        a = [
            mAScale[self._src_row(mGather, row0, tCcC[0][0], rows_left), kt],
            mAScale[self._src_row(mGather, row0, tCcC[2][0], rows_left), kt],
        ]
        last = mWScale.shape[1] - 1
        ws = []
        for p in cutlass.range_constexpr(self.num_parts):
            first = self._w_block(self._w_row(0, p, n_tile, n_part), rows_total)
            pair = (mWScale[e, first, kt], mWScale[e, cutlass.min(first + 1, last), kt])
            w = []
            for b in cutlass.range_constexpr(cute.size(tCcC) // 4):
                for v in cutlass.range_constexpr(2):
                    blk = self._w_block(self._w_row(tCcC[4 * b + v][1], p, n_tile, n_part), rows_total)
                    w.append(Float32(cutlass.select_(blk == first, pair[0], pair[1])))
            ws.append(w)
        return a, tuple(ws)

    @cute.jit
    def _promote(self, acc0, acc1, tmp0, tmp1, scales):
        """acc += tmp (e4m3 operands), times (A scale x weight scale) with block scales (_block_scales'
        order), element by element."""
        if const_expr(scales is None):
            for p in cutlass.range_constexpr(self.num_parts if not self.swap else 1):
                acc, tmp = (acc0, acc1)[p], (tmp0, tmp1)[p]
                for i in cutlass.range_constexpr(cute.size(acc0)):
                    acc[i] = acc[i] + tmp[i]
        elif const_expr(self.swap):
            a, ws = scales
            for i in cutlass.range_constexpr(cute.size(acc0)):
                acc0[i] = acc0[i] + tmp0[i] * (a[i] * ws[0][i])
        else:
            a, ws = scales
            accs, tmps = (acc0, acc1), (tmp0, tmp1)
            for p in cutlass.range_constexpr(self.num_parts):
                for b in cutlass.range_constexpr(cute.size(acc0) // 4):
                    for v in cutlass.range_constexpr(2):
                        for h in cutlass.range_constexpr(2):
                            i = 4 * b + 2 * h + v
                            accs[p][i] = accs[p][i] + tmps[p][i] * (a[h] * ws[p][2 * b + v])

    @cute.jit
    def _w_row(self, n, part, n_tile, n_part) -> Int32:
        """The weight row of tile row n of B part `part` (n_tile: the tile's index along the output
        columns; n_part: rows per part, so [gate; up]'s up rows start n_part rows after the gate rows).
        The paired split-K view interleaves blocks of 8 gate and 8 up rows (see __call__). Not clamped:
        a partial last tile's rows may lie past N (never stored; callers clamp)."""
        row = n_tile * self.part_n + n
        if const_expr(self.paired):
            col = n_tile * self.out_n + n % 8 + 8 * (n // 16)
            up = (n // 8) % 2
            if const_expr(self.epi.gate_layout == "concat"):
                row = col + up * n_part
            else:
                row = 2 * col + up
        else:
            row = row + part * n_part  # part: 0 or 1, known when tracing or not (a swapped warpgroup's)
        return row

    @cute.jit
    def _w_block(self, row, rows_total) -> Int32:
        """The 128-row scale block of weight row `row`, rows past the last (rows_total) in the last."""
        return cutlass.min(row, rows_total - 1) // SCALE_BLOCK

    @cute.jit
    def _src_row(self, mGather, row0, m, rows_left) -> Int32:
        """The A row of the tile's row m (GEMM1: its token, through the gather); rows past the expert
        read the expert's last row instead (their products are never stored), without a branch: in the
        main loop a branch between WGMMAs makes ptxas serialise them (C7520)."""
        r = row0 + cutlass.min(m, rows_left - 1)
        if const_expr(self.gather):
            r = mGather[r]
        return r

    @cute.jit
    def _zero_rows(self, sA_rows, stage, lo, rows_left, t):
        """Zero rows max(lo, rows_left) .. lo + 63 of A's stage, by the 128 threads of one warpgroup
        (thread t: 16-byte chunk t % 8 of rows lo + t // 8 + 16 i): a 128-row tile's 64 rows of one
        consumer warpgroup, 128 bytes each."""
        chunk_elems = 16 // self.operand_bytes
        zeros = cute.make_rmem_tensor((chunk_elems,), sA_rows.element_type)
        zeros.fill(0.0)
        copy128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sA_rows.element_type, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(4):
            r = lo + t // 8 + 16 * i
            if r >= rows_left:
                cute.copy(copy128, zeros, cute.local_tile(sA_rows[r, None, stage], (chunk_elems,), (t % 8,)))

    @cute.jit
    def _epilogue(self, acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, sEpi, sDest, biases):
        """Apply the recipe's epilogue to this thread's accumulators and store its elements of rows
        < rows_left and columns < n_out (row0 and col0: the tile's first output row and column);
        biases: _swap_biases' values for swapped tiles."""
        epi = self.epi
        out_dtype = mC.element_type
        if const_expr(self.paired):
            # Element i is (weight row n, token m); the row half (i // 2) % 2 is the gate (0) or the up
            # (1) of output column n % 8 + 8 (n // 16) (see the paired B view in __call__).
            frag = cute.shape(tCcC)
            assert frag[0][0] == 2 and frag[0][1] == 2 and frag[1] == 1 and frag[2] == 1, frag
            for i in cutlass.range_constexpr(cute.size(acc0)):
                if const_expr((i // 2) % 2 == 0):
                    n, m = tCcC[i]
                    col = col0 + n % 8 + 8 * (n // 16)
                    if m < rows_left and col < n_out:
                        mC[row0 + m, col] = self._activate(acc0[i], acc0[i + 2], biases).to(out_dtype)
        elif const_expr(self.swap):
            # Element i is (weight row n, token m) of the tile: output row row0 + m, column col0 + n;
            # its row half h = (i // 2) % 2 is weight row n or n + 8, whose biases are biases[h].
            for i in cutlass.range_constexpr(cute.size(acc0)):
                n, m = tCcC[i]
                col = col0 + n
                # Inside the branch: at M = 1 one token of the tile's 16 is real, and only its elements
                # pay for the activation.
                if m < rows_left and col < n_out:
                    y = self._activate(acc0[i], acc1[i], biases[(i // 2) % 2] if epi.has_bias else ())
                    mC[row0 + m, col] = y.to(out_dtype)
        elif const_expr(epi.gate_layout == "interleaved"):
            self._store_interleaved(acc0, tCcC, mC, mBias, e, row0, rows_left, col0, n_out)
        elif const_expr(self.staged):
            self._store_staged(acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, sEpi, sDest)
        else:
            self._store_rows(acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, col0, n_out)

    @cute.jit
    def _store_rows(self, acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, col0, n_out):
        """The direct epilogue of [gate; up] or ungated rows, stored 8 columns (16 bytes) per thread.

        Fragment elements 2j and 2j+1 are adjacent columns of one row (row half j % 2, block j // 2):
        lane t of a quad holds columns 2t and 2t + 1 of each 8-column block. Two blocks give each
        thread four 32-bit words w[2h + d] (row half h, block b + d), each the pair of outputs its lane
        contributes to that row's 16-byte piece; _quad_transpose gathers piece (h, d) in lane 2h + d.
        The quad then writes two whole 32-byte sectors (rows r and r + 8, blocks b and b + 1) with one
        128-bit store each, where 32-bit stores took two instructions of 16 bytes per sector and row
        (bench/NOTES.md v35: the layer 1-4% faster at M = 8192).
        An odd last block is stored as before, a 32-bit pair per element pair."""
        frag = cute.shape(tCcC)
        assert frag[0][0] == 2 and frag[0][1] == 2 and frag[1] == 1 and frag[2] == 1, frag
        out_dtype = mC.element_type
        blocks = cute.size(acc0) // 4
        quad_lane = cute.arch.lane_idx() % 4
        vals = cute.make_rmem_tensor((8,), out_dtype)
        words = cute.recast_tensor(vals, Int32)
        piece = cute.make_rmem_tensor((8,), out_dtype)
        piece_words = cute.recast_tensor(piece, Int32)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=8 * out_dtype.width)
        for p in cutlass.range_constexpr(blocks // 2):
            for d in cutlass.range_constexpr(2):
                # Both row halves share the block's columns and so its biases: loaded once.
                biases = self._bias_cols(mBias, e, col0 + tCcC[4 * (2 * p + d)][1], n_out)
                for h in cutlass.range_constexpr(2):
                    self._values(acc0, acc1, 2 * (2 * p + d) + h, biases, vals, at=2 * (2 * h + d))
            out = _quad_transpose([words[0], words[1], words[2], words[3]], Int32)
            for j in cutlass.range_constexpr(4):
                piece_words[j] = out[j]
            # Block 2p's columns start 2t before this lane's.
            base = 4 * (2 * p)
            _store_piece(piece, store, mC, tCcC, base, col0 + tCcC[base][1] - 2 * quad_lane, row0, rows_left, n_out)
        if const_expr(blocks % 2 == 1):
            pair = cute.make_rmem_tensor((2,), out_dtype)
            pair_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=2 * out_dtype.width)
            biases = self._bias_cols(mBias, e, col0 + tCcC[4 * (blocks - 1)][1], n_out)
            for h in cutlass.range_constexpr(2):
                j = 2 * (blocks - 1) + h
                m, n = tCcC[2 * j]
                # n_out is even (a multiple of 64), so col < n_out covers col + 1 too.
                if m < rows_left and col0 + n < n_out:
                    self._values(acc0, acc1, j, biases, pair)
                    cute.copy(pair_store, pair, cute.local_tile(mC[row0 + m, None], (2,), ((col0 + n) // 2,)))

    @cute.jit
    def _store_interleaved(self, acc0, tCcC, mC, mBias, e, row0, rows_left, col0, n_out):
        """The epilogue of interleaved gate/up rows, stored 8 columns (16 bytes) per thread.

        Fragment elements 4b and 4b+1 are one row's (gate, up) of one output column, 4b+2 and 4b+3
        the same column 8 rows down, and lane t of a quad holds column t of each 4-column block b.
        Four blocks make two rounds of _quad_transpose, each sending lane 2h + d the 4 columns of row
        half h in block 2d (then 2d + 1) of the four: every lane ends with 8 adjacent columns of one
        row, and the quad writes two whole 32-byte sectors (rows r and r + 8) with one 128-bit store
        each, where a 32-bit pair per lane took four instructions of 8 bytes per sector and row
        (bench/NOTES.md v35: 5% of the layer at M = 8192). A last pair of blocks goes out 4 columns
        (64 bits) per lane."""
        frag = cute.shape(tCcC)
        assert frag[0][0] == 2 and frag[0][1] == 2 and frag[1] == 1 and frag[2] == 1, frag
        blocks = cute.size(acc0) // 4
        assert blocks % 2 == 0, blocks
        for q in cutlass.range_constexpr(blocks // 4):
            self._store_interleaved_blocks(acc0, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, 4 * q, 4)
        if const_expr(blocks % 4 == 2):
            self._store_interleaved_blocks(acc0, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, blocks - 2, 2)

    @cute.jit
    def _store_interleaved_blocks(self, acc0, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, first_block, count):
        """_store_interleaved for the `count` (2 or 4) blocks from first_block: lane 2h + d stores row
        half h of blocks first_block + (count // 2) d + s, s < count // 2."""
        epi = self.epi
        out_dtype = mC.element_type
        per_lane = count // 2  # blocks per lane
        quad_lane = cute.arch.lane_idx() % 4
        piece = cute.make_rmem_tensor((4 * per_lane,), out_dtype)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=4 * per_lane * out_dtype.width)
        for s in cutlass.range_constexpr(per_lane):
            v = [None] * 4
            for d in cutlass.range_constexpr(2):
                block = 4 * (first_block + per_lane * d + s)
                # The column's (gate, up) biases: one load for both row halves.
                bias = self._bias_pair(mBias, e, 2 * (col0 + tCcC[block][1] // 2), 2 * n_out) if const_expr(epi.has_bias) else ()
                for h in cutlass.range_constexpr(2):
                    v[2 * h + d] = self._activate(acc0[block + 2 * h], acc0[block + 2 * h + 1], bias)
            out = _quad_transpose(v, Float32)
            for j in cutlass.range_constexpr(4):
                piece[4 * s + j] = out[j].to(out_dtype)
        # The first block's columns start at (its fragment column / 2) minus this lane's place in the quad.
        base = 4 * first_block
        _store_piece(piece, store, mC, tCcC, base, col0 + tCcC[base][1] // 2 - quad_lane, row0, rows_left, n_out)

    @cute.jit
    def _bias_pair(self, mBias, e, col, width):
        """(bias[e, col], bias[e, col + 1]) in float32 by one load of both (col even). A column past the
        row's width (a partial last tile's, never stored) reads the row's last pair instead.
        An invariant (ld.global.nc) load: the biases are read-only for the kernel, and saying so lets
        ptxas issue the epilogue's bias loads ahead of its output stores; as plain loads each waited
        behind the previous store, which might have written them (gpt-oss's recipe at M = 8192 3.7%
        faster, bench/NOTES.md v35)."""
        pair = cute.make_rmem_tensor((2,), mBias.element_type)
        load = cute.make_copy_atom(
            cute.nvgpu.CopyG2ROp(), mBias.element_type, num_bits_per_copy=2 * mBias.element_type.width, invariant=True
        )
        cute.copy(load, cute.local_tile(mBias[e, None], (2,), (cutlass.min(col, width - 2) // 2,)), pair)
        return pair[0].to(Float32), pair[1].to(Float32)

    @cute.jit
    def _bias_cols(self, mBias, e, col, n_out):
        """The biases _values adds at output columns col and col + 1 (col even): () without biases,
        (b0, b1), or with [gate; up] (gate0, gate1, up0, up1) from columns col and n_out + col."""
        if const_expr(not self.epi.has_bias):
            return ()
        if const_expr(self.epi.gate_layout == "concat"):
            return (*self._bias_pair(mBias, e, col, n_out), *self._bias_pair(mBias, e, n_out + col, 2 * n_out))
        return self._bias_pair(mBias, e, col, n_out)

    @cute.jit
    def _values(self, acc0, acc1, j, biases, pair, at=0):
        """pair[at + v] = the output dtype's value of fragment element 2j + v (output column col + v,
        whose biases _bias_cols gave): the bias and the activation ([gate; up] from acc0 and acc1, or
        relu2)."""
        for v in cutlass.range_constexpr(2):
            column = biases[v :: 2] if self.epi.has_bias else ()
            pair[at + v] = self._activate(acc0[2 * j + v], acc1[2 * j + v], column).to(pair.element_type)

    @cute.jit
    def _activate(self, y, u, bias):
        """One output element in float32 from its sums y (and u, the up sum, with a gate) and its
        biases (bias[0] for y, bias[1] for u; () without): the bias, then the activation."""
        epi = self.epi
        if const_expr(epi.has_bias):
            y = y + bias[0]
        if const_expr(epi.gate_layout != "none"):
            if const_expr(epi.has_bias):
                u = u + bias[1]
            return _gated(epi.activation, y, u, epi.alpha, epi.limit)
        if const_expr(epi.activation == "relu2"):
            y = cute.arch.fmax(y, Float32(0.0))
            y = y * y
        return y

    @cute.jit
    def _swap_biases(self, tCcC, mBias, e, col0, n_out):
        """A swapped tile's bias values for this thread's weight rows, in float32: () without biases;
        paired (gate, up) of its one output column; else per row half h (weight rows n and n + 8)
        (bias,) or with [gate; up] (gate, up). Columns past n_out (a partial last tile's, never
        stored) read the row's last element instead."""
        epi = self.epi
        if const_expr(not (self.swap and epi.has_bias)):
            return ()

        def at(i, width):
            return mBias[e, cutlass.min(i, width - 1)].to(Float32)

        if const_expr(self.paired):
            n = tCcC[0][0]
            col = col0 + n % 8 + 8 * (n // 16)
            if const_expr(epi.gate_layout == "interleaved"):
                return (at(2 * col, 2 * n_out), at(2 * col + 1, 2 * n_out))
            return (at(col, n_out), at(n_out + col, 2 * n_out))
        halves = []
        for h in cutlass.range_constexpr(2):
            col = col0 + tCcC[2 * h][0]
            if const_expr(epi.gate_layout == "concat"):
                halves.append((at(col, n_out), at(n_out + col, 2 * n_out)))
            else:
                halves.append((at(col, n_out),))
        return tuple(halves)

    @cute.jit
    def _store_staged(self, acc0, acc1, tCcC, mC, mBias, e, row0, rows_left, col0, n_out, sEpi, sDest):
        """The epilogue's values stored through shared memory (_store_packed), each chunk packed
        (_pack) just before it is stored."""
        packed = cute.make_rmem_tensor((cute.size(acc0),), mC.element_type)
        self._store_packed(packed, tCcC, mC, row0, rows_left, col0, n_out, sEpi, sDest, 0, self._chunks(), (acc0, acc1, mBias, e))

    def _chunks(self) -> int:
        """The staged epilogue's chunks of EPI_COLS columns (fewer with narrow tiles) per warpgroup."""
        return self.wg_out_n // min(EPI_COLS, self.wg_out_n)

    @cute.jit
    def _pack(self, acc0, acc1, tCcC, mBias, e, col0, n_out, packed, first, end):
        """packed[i] = the output value of fragment element i (bias and activation applied), for the
        elements of chunks first .. end - 1."""
        chunk = min(EPI_COLS, self.wg_out_n)
        biases = ()
        for j in cutlass.range_constexpr(first * chunk // 4, end * chunk // 4):
            n = tCcC[2 * j][1]
            # j even then odd: rows 8 apart, the same columns and biases (the range starts even).
            if const_expr(j % 2 == 0):
                biases = self._bias_cols(mBias, e, col0 + n, n_out)
            self._values(acc0, acc1, j, biases, packed, at=2 * j)

    @cute.jit
    def _store_packed(self, packed, tCcC, mC, row0, rows_left, col0, n_out, sEpi, sDest, first, end, acc=None):
        """Store chunks first .. end - 1 of _pack's values through shared memory, 16 bytes wide and
        row-contiguous: each warp owns 16 rows (fragment elements 2j and 2j+1 are adjacent columns of
        the row half j % 2, rows 8 apart); per 64-column chunk it writes its values into its own padded
        [16, EPI_STRIDE] buffer, then each lane stores 16-byte pieces of whole rows to their
        destination rows. acc: (acc0, acc1, mBias, e) to pack each chunk from first, only if it is
        stored."""
        # The accumulator is ((2 columns, 2 rows 8 apart, N/8 column blocks), 1, 1): element i is in
        # row half (i // 2) % 2.
        frag = cute.shape(tCcC)
        assert frag[0][0] == 2 and frag[0][1] == 2 and frag[1] == 1 and frag[2] == 1, frag
        out_dtype = mC.element_type
        tidx, _, _ = cute.arch.thread_idx()
        warp = (tidx - 128) // 32
        lane = tidx % 32
        row_base = tCcC[0][0] - lane // 4  # the warp's first row in the tile
        col_base = tCcC[0][1] - 2 * (lane % 4)  # its warpgroup's first column
        chunk = min(EPI_COLS, self.wg_out_n)
        if lane % 4 == 0:
            for h in cutlass.range_constexpr(2):
                m = tCcC[2 * h][0]
                sDest[m - row_base, warp] = -1
                if m < rows_left:
                    sDest[m - row_base, warp] = row0 + m
        piece = cute.make_rmem_tensor((8,), out_dtype)
        store32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=2 * out_dtype.width)
        copy128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=128)
        for q in cutlass.range_constexpr(first, end):
            first_col = col0 + col_base + q * chunk
            # n_out is a multiple of 64 and chunks are 32 or 64 columns on 32-column boundaries: a
            # chunk is wholly inside or outside the output.
            if first_col < n_out:
                if const_expr(acc is not None):
                    self._pack(acc[0], acc[1], tCcC, acc[2], acc[3], col0, n_out, packed, q, q + 1)
                for j in cutlass.range_constexpr(q * chunk // 4, (q + 1) * chunk // 4):
                    m, n = tCcC[2 * j]
                    local = n - col_base - q * chunk
                    cute.copy(store32, cute.local_tile(packed, (2,), (j,)), cute.local_tile(sEpi[m - row_base, None, warp], (2,), (local // 2,)))
                cute.arch.sync_warp()
                for t in cutlass.range_constexpr(16 * chunk // 8 // 32):
                    r = (lane + 32 * t) // (chunk // 8)
                    c = (lane + 32 * t) % (chunk // 8)
                    out_row = sDest[r, warp]
                    if out_row >= 0:
                        cute.copy(copy128, cute.local_tile(sEpi[r, None, warp], (8,), (c,)), piece)
                        cute.copy(copy128, piece, cute.local_tile(mC[out_row, None], (8,), (first_col // 8 + c,)))
                # The next chunk overwrites the buffer.
                cute.arch.sync_warp()
