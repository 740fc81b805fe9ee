"""W4a16GroupedSm90: the grouped GEMM of MoE experts with mxfp4 weights and bf16 activations, on Hopper.

    C[r, c] = epilogue(sum_k A[r, k] * W[e(r)][row(c), k])     for the grouped rows r of each expert e

A [P, K] bf16 holds each expert's rows contiguously (offsets [E + 1], the routing plan's); W comes packed by
w4a16_pack.py (one chunk per (expert, tile, k-tile of 128)). The weights stream through shared memory once per
m-tile of A (16, 32, 64 or 128 rows: `tok`), and each consumer thread decodes its own words into register-A WGMMA
fragments (swapped operands: 64 weight rows on WGMMA's M side, the m-tile on its N side), so no decoded weight
is ever stored. The decode is the kernel's cost and is paid once per m-tile: larger m-tiles divide it where
experts hold that many rows.
At small M this reads 4.25 bits per weight where the bf16 kernels read 16.

Work: units (expert, m-tile, tile), expert by expert, handed out round-robin over a persistent grid of
one CTA per SM. A unit's expert comes from a binary search over a per-CTA prefix sum of units per expert (warp
0 scans with shuffles), not a walk over every expert: at M = 1 the walk over 128 experts, one dependent
shared-memory load each, took half of GEMM2's time (branch wip/w4a16, bench/NOTES.md v54). Warpgroup 0's
first warp loads (TMA) each k-tile's weight chunk and the unit's rows of A into a ring of stages; two
consumer warpgroups decode and multiply 64 weight rows each. Rows of an m-tile past its expert (the next
expert's, or zeros past P) are multiplied and not stored. The gather variant (GEMM1 only) reads grouped row r
from the tokens' row A[g[r]] instead: all of warpgroup 0 copies the rows in 16-byte cp.async chunks (rows past
the expert zero-filled) on a second pipeline, so the layer writes no gathered copy of its tokens.

The kernel launches as a programmatic dependent (PDL) of the one before (the routing plan, or GEMM1) and waits
(griddepcontrol.wait) before its first global read, so its launch and prologue overlap that kernel's tail. With
early_weights (GEMM2 right after GEMM1, weights tiled at load time) it reads the offsets and starts its first unit's
weight chunks before the wait, so they stream while GEMM1 finishes.

Epilogue, offloaded at 64- and 128-row m-tiles without gather: the consumers write each unit's sums to a shared-memory
staging buffer (a one-stage pipeline) and go on to the next unit's MMAs; the producer warpgroup's warps 1-3, idle
beside warp 0's TMA, add the biases, apply the activation and store. Otherwise the consumers store themselves.
By the tile kind the weights were packed as:
- "rows" (activation None): C [P, N] float32 (or bf16, rows_bf16) = the sums (+ bias [E, N]);
- "gate_up" (a GATED activation): warpgroup 1's up sums join warpgroup 0's gate sums of the same 64 columns
  through shared memory; C [P, N / 2] bf16 = act(gate (+ its bias), up (+ its bias)), bias [E, N] in the
  weights' gate layout (strides given at launch).

The decode (decode_word): five shifts of a word, four masks, four bf16x2 multiplies by 2^(s - 1) (the e8m0
scale s times the 2^126 that lifts a code off bf16's subnormals) and four sign xors give its four fragment
registers exactly. Scales above 2^1 (s > 128) and NaN (255) do not fit one multiplier: the warps whose
k-tile holds such a scale (a vote per k-tile) take a second multiply. What bounds the kernel is this
instruction stream, not the reads (Nsight Compute on branch wip/w4a16: issue slots ~60% busy, DRAM ~40%).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm as mlir_llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .moe_gemm import GATED, READS, _gated
from .w4a16_pack import CODE_WORDS, GROUP, GROUPS, KT, MAG_MASK, MAG_SHIFT, SIGN_MASK, SIGN_SHIFT, TILE_ROWS, WORDS

BF16 = cutlass.BFloat16
TOKS = (16, 32, 64, 128)  # rows of A per m-tile (WGMMA's N), a variant: tiles.choose_w4a16_tok
KB = KT // 16  # WGMMA k-blocks per k-tile
CHUNK = WORDS * 4  # bytes of one (expert, tile, k-tile) chunk
ROW_W = 128  # the chunk as a TMA box of BOX rows of ROW_W bytes (a box has at most 256 rows)
BOX = CHUNK // ROW_W
assert CHUNK % ROW_W == 0 and BOX <= 256
# Ring stages by m-tile rows: 150 KB at 16 rows, 198 KB at 32, 196 KB at 64, 162 KB at 128 (deeper rings measured no
# faster at 16: branch wip/w4a16; 64 and 128 rows fill shared memory with 8 and 4 beside the gated up sums). At 64 and
# 128 rows only the gathered variants use them: the others take STAGES_OFFLOADED.
STAGES_BY_TOK = {16: 12, 32: 12, 64: 8, 128: 4}
# The offloaded epilogue (m-tiles of these rows, without gather): the consumers hand each unit's sums to the producer
# warpgroup's other STORE_WARPS warps through shared memory (a [128, tok] float32 staging buffer) and go on to the
# next unit's MMAs, which an epilogue of their own left idle for 15-26% of the kernel (bench/NOTES.md v59). The
# staging buffer takes ring stages: 7 at 64 rows, 3 at 128.
STAGES_OFFLOADED = {64: 7, 128: 3}
STORE_WARPS = 3
SC_PITCH = 132  # floats between the staging buffer's columns: element (m, c) in bank m + 4c, so no conflicts
CONSUMERS = 2  # warpgroups, 64 weight rows each
THREADS = 128 * (1 + CONSUMERS)
# The offsets and the units' prefix sum live in shared memory (one round of global loads per CTA).
MAX_EXPERTS = 1024
GATE_COLS = TILE_ROWS // 2  # output columns per "gate_up" tile
A_CHUNKS = KT * 2 // 16  # 16-byte chunks of a k-tile's row of A

SIGN = SIGN_MASK - (1 << 32)  # as a signed 32-bit immediate
MAG = MAG_MASK
# A thread's WGMMA accumulators (m64nNk16) are ((2, 2, N / 8)): element i lies on weight row row_slot(i) of its two
# rows (lane / 4 and that + 8 of its warp's 16), so a value per weight row (a bias) is held twice, not per element.
ROW_SLOTS = 2


def row_slot(i: int) -> int:
    return i // 2 % ROW_SLOTS


@dataclass(frozen=True)
class W4Epilogue:
    """activation: None (the "rows" kind: the sums) or a GATED kind (the "gate_up" kind: bf16 act(gate, up));
    alpha, limit: the activation's parameters (moe_gemm.READS); has_bias: biases added to the sums in float32,
    read as the layer holds them (float32, or bf16 with bias_bf16); rows_bf16: the "rows" kind stores bf16 (for
    the token sum kernels) instead of float32."""

    activation: str | None = None
    alpha: float = 1.702
    limit: float = 7.0
    has_bias: bool = False
    rows_bf16: bool = False
    bias_bf16: bool = False

    def __post_init__(self):
        if self.activation is not None and self.activation not in GATED:
            raise ValueError(f"W4Epilogue.activation: got {self.activation!r}; allowed: None, {', '.join(map(repr, GATED))}")
        if self.bias_bf16 and not self.has_bias:
            raise ValueError("W4Epilogue.bias_bf16: the biases' dtype, with has_bias only")
        if self.activation is not None and self.rows_bf16:
            raise ValueError("W4Epilogue.rows_bf16: only without an activation (an activation's output is bf16 already)")
        # A parameter the activation does not read keeps its default, so that it names no variant of its own.
        for name in ("alpha", "limit"):
            if name not in READS.get(self.activation, ()):
                object.__setattr__(self, name, type(self).__dataclass_fields__[name].default)


def _asm(asm: str, cons: str, *args):
    return Int32(mlir_llvm.inline_asm(Int32.mlir_type, [a.ir_value() for a in args], asm, cons))


def _bf16x2_mul(a, b):
    return _asm("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", a, b)


def scale_mult(word, g: int):
    """Byte g of a scale word (e8m0 s <= 128) -> bf16x2 2^(s - 1) in both halves: 0x3F00 + (s << 7) per half."""
    return _asm(f"{{ .reg .b32 t; prmt.b32 t, $1, 0, {0x4440 + g}; mad.lo.u32 $0, t, 0x00800080, 0x3F003F00; }}", "=r,r", word)


# Any e8m0 s: m1 = 2^(min(s, 128) - 1), m2 = 2^(s - 128) (s > 128), 1, or NaN (s = 255); m1 * m2 is the multiplier.
_SCALE_ANY = """{
 .reg .b32 t, c;
 .reg .pred big, nan;
 prmt.b32 t, $2, 0, SEL;
 setp.gt.u32 big, t, 128;
 setp.eq.u32 nan, t, 255;
 min.u32 c, t, 128;
 mad.lo.u32 $0, c, 0x00800080, 0x3F003F00;
 add.u32 c, t, 0xFFFFFFFF;
 mul.lo.u32 c, c, 0x00800080;
 selp.b32 c, c, 0x3F803F80, big;
 selp.b32 $1, 0x7FC07FC0, c, nan;
}"""


def scale_mults_any(word, g: int):
    """(m1, m2) as bf16x2 pairs for byte g of a scale word, any e8m0 value (see _SCALE_ANY)."""
    res = mlir_llvm.inline_asm(
        mlir_llvm.StructType.get_literal([Int32.mlir_type, Int32.mlir_type]), [word.ir_value()],
        _SCALE_ANY.replace("SEL", str(0x4440 + g)), "=r,=r,r",
    )  # fmt: skip
    return Int32(mlir_llvm.extractvalue(Int32.mlir_type, res, [0])), Int32(mlir_llvm.extractvalue(Int32.mlir_type, res, [1]))


def _shifted(q):
    """(magnitude source, sign source) of the word's four outputs: w4a16_pack's MAG_SHIFT (0, 3, 6, -3) and
    SIGN_SHIFT (0, 1, 2, 3). The arithmetic right shift's copied sign bits fall outside MAG."""
    assert MAG_SHIFT == (0, 3, 6, -3) and SIGN_SHIFT == (0, 1, 2, 3)  # the shifts written out below
    l1, l2, l3 = q << 1, q << 2, q << 3
    return ((q, q), (l3, l1), (q << 6, l2), (q >> 3, l3))


def decode_word(q, mult):
    """A packed word -> its four bf16x2 fragment registers, scales up to 2^1."""
    return [_bf16x2_mul(m & Int32(MAG), mult) ^ (sg & Int32(SIGN)) for m, sg in _shifted(q)]


def decode_word_any(q, m1, m2):
    """A packed word -> its four bf16x2 fragment registers, any scale (two multiplies)."""
    return [_bf16x2_mul(_bf16x2_mul(m & Int32(MAG), m1), m2) ^ (sg & Int32(SIGN)) for m, sg in _shifted(q)]


class W4a16GroupedSm90:
    """See the module docstring. Compile with __call__'s argument types (interface.w4a16_compile_args)."""

    def __init__(self, epilogue: W4Epilogue, tok: int = 16, gather: bool = False, early_weights: bool = False):
        if tok not in TOKS:
            raise ValueError(f"W4a16GroupedSm90: tok={tok!r}; allowed: {TOKS}")
        if gather and epilogue.activation is None:
            raise ValueError("W4a16GroupedSm90: gather=True needs a gated activation (GEMM1); the rows kind reads grouped rows")
        # early_weights: the offsets are read, and the first unit's weight chunks start loading, before the wait for
        # the previous kernel, which must then have written neither (GEMM2 after GEMM1 over the same plan, weights
        # tiled at load time). Not with gather: GEMM1's previous kernel is the plan, which writes the offsets.
        if early_weights and gather:
            raise ValueError("W4a16GroupedSm90: early_weights=True with gather=True; GEMM1 needs the plan's offsets first")
        self.early = early_weights
        self.epi = epilogue
        self.tok = tok
        self.gated = epilogue.activation is not None
        self.gather = gather
        # The TMA bytes a stage's barrier waits for: the weights' chunk, and without gather its A tile (gathered rows
        # come by cp.async, on a pipeline of their own).
        self.stage_bytes = CHUNK + (0 if gather else tok * KT * 2)
        self.offload = not gather and tok in STAGES_OFFLOADED
        self.stages = STAGES_OFFLOADED[tok] if self.offload else STAGES_BY_TOK[tok]
        self.cols = GATE_COLS if self.gated else TILE_ROWS  # output columns per tile

    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, a_ptr: cute.Pointer, off_ptr: cute.Pointer, c_ptr: cute.Pointer,
                 b_ptr: cute.Pointer, g_ptr: cute.Pointer, e_num: Int32, n_out: Int32, k: Int32, p: Int32, a_rows: Int32,
                 num_sms: Int32, expert_chunks: Int32, b_gate_stride: Int32, b_col_stride: Int32, stream: cuda.CUstream):  # fmt: skip
        if const_expr(w_ptr.dtype.width != 8 or a_ptr.dtype != BF16):
            # A wider pointer would make the weights' TMA box (BOX x ROW_W elements) larger than the stage's
            # bytes the barrier waits for: a hang, not an error.
            raise TypeError(f"W4a16GroupedSm90: w_ptr must point to bytes (got {w_ptr.dtype}) and a_ptr BFloat16 (got {a_ptr.dtype})")
        if const_expr(self.epi.has_bias and b_ptr.dtype != (BF16 if self.epi.bias_bf16 else Float32)):
            raise TypeError(f"W4a16GroupedSm90: b_ptr {b_ptr.dtype} for {self.epi}")
        k = cute.assume(k, divby=GROUP)  # the interface checks it: each row of A starts 16-byte aligned (cp.async)
        n_tiles = (n_out + self.cols - 1) // self.cols
        k_tiles = (k + KT - 1) // KT
        # Expert e's chunks start at chunk e * expert_chunks (>= n_tiles * k_tiles: weights tiled at load time pad
        # each expert to a whole number of [N, B] bytes, w4a16_pack.tiled_chunks).
        mW = cute.make_tensor(w_ptr, cute.make_layout((e_num * expert_chunks * BOX, ROW_W), stride=(ROW_W, 1)))
        # gather: A is the tokens [a_rows, K], grouped row r read from A[g[r]] by cp.async; else A holds the grouped
        # rows [P, K], read by TMA (g_ptr unread).
        mA = cute.make_tensor(a_ptr, cute.make_layout((a_rows if self.gather else p, k), stride=(k, 1)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((p,)))
        mOff = cute.make_tensor(off_ptr, cute.make_layout((e_num + 1,)))
        mC = cute.make_tensor(c_ptr, cute.make_layout((p, n_out), stride=(n_out, 1)))
        if const_expr(self.gated):
            # The layer's own [E, 2 n_out] bias: gate and up of column c at c * b_col_stride and that + b_gate_stride
            # ([gate; up]: n_out and 1; interleaved pairs: 1 and 2), so no call re-lays it.
            mB = cute.make_tensor(b_ptr, cute.make_layout((e_num, 2, n_out), stride=(2 * n_out, b_gate_stride, b_col_stride)))
        else:
            mB = cute.make_tensor(b_ptr, cute.make_layout((e_num, n_out), stride=(n_out, 1)))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BF16, BF16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32, (1, 1, 1),
            tiler_mn=(64, self.tok), a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BF16, 64), BF16)
        sA_layout = cute.tile_to_shape(atom, (self.tok, KT, self.stages), order=(0, 1, 2))
        # (Unused with gather.)
        tma_a, gA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sA_layout, (None, None, 0)), (self.tok, KT))
        sW_layout = cute.make_layout((BOX, ROW_W, self.stages), stride=(ROW_W, 1, CHUNK))
        tma_w, gW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, cute.make_layout((BOX, ROW_W), stride=(ROW_W, 1)), (BOX, ROW_W))

        @cute.struct
        class Storage:
            bar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            bar_a: cute.struct.MemRange[cutlass.Int64, self.stages * 2 if self.gather else 1]
            off: cute.struct.MemRange[Int32, MAX_EXPERTS + 1]
            cum: cute.struct.MemRange[Int32, MAX_EXPERTS + 1]
            up: cute.struct.MemRange[Float32, 128 * (self.tok // 2) if self.gated and not self.offload else 1]
            bar_c: cute.struct.MemRange[cutlass.Int64, 2]
            sc: cute.struct.Align[cute.struct.MemRange[Float32, SC_PITCH * self.tok if self.offload else 1], 16]
            sA: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(sA_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(sW_layout)], 1024]

        self.storage = Storage
        self.kernel(tiled_mma, tma_w, gW, tma_a, gA, mA, mG, mOff, mC, mB, sA_layout, sW_layout, n_tiles, k_tiles,
                    expert_chunks).launch(
            grid=[num_sms, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream, use_pdl=True
        )  # fmt: skip

    @cute.jit
    def expert_of(self, sCum: cute.Tensor, u: Int32, e_num: Int32) -> Int32:
        """The expert e whose units hold unit u: the largest e with sCum[e] <= u (an empty expert's successor
        has the same sCum, so the largest is never empty)."""
        lo = Int32(0)
        hi = e_num - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sCum[mid] <= u:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @cute.jit
    def unit_place(self, sCum: cute.Tensor, sOff: cute.Tensor, u: Int32, e_num: Int32, n_tiles: Int32):
        """(expert, tile, first row, rows of the expert from there) of unit u."""
        e = self.expert_of(sCum, u, e_num)
        m_tile = (u - sCum[e]) // n_tiles
        tile = u - sCum[e] - m_tile * n_tiles
        row0 = sOff[e] + m_tile * self.tok
        return e, tile, row0, sOff[e + 1] - row0

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, gW_full: cute.Tensor, tma_a: cute.CopyAtom, gA_full: cute.Tensor,
               mA: cute.Tensor, mG: cute.Tensor, mOff: cute.Tensor, mC: cute.Tensor, mB: cute.Tensor,
               sA_layout: cute.ComposedLayout, sW_layout: cute.Layout, n_tiles: Int32, k_tiles: Int32,
               expert_chunks: Int32):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid = cute.arch.grid_dim()[0]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        storage = SmemAllocator().allocate(self.storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * CONSUMERS),
            tx_count=self.stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )  # fmt: skip
        pipe_a = None
        if const_expr(self.gather):
            pipe_a = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.bar_a.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * CONSUMERS), defer_sync=True,
            )  # fmt: skip
        pipe_c = None
        if const_expr(self.offload):
            pipe_c = pipeline.PipelineAsync.create(
                barrier_storage=storage.bar_c.data_ptr(), num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * CONSUMERS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * STORE_WARPS), defer_sync=True,
            )  # fmt: skip
        cute.arch.mbarrier_init_fence()
        # Launched as a programmatic dependent (PDL) of the kernel before (the routing plan, or GEMM1): its launch
        # and this prologue overlap that kernel's end. Global reads come after the wait, which returns once that
        # kernel is complete; letting the next kernel launch then only queues its CTAs behind this one's. The
        # exception, early_weights: the offsets (past L1, which may hold an earlier launch's) and the first unit's
        # weights are read before it; the plan wrote the offsets and completed before the kernel before this one
        # passed its own wait.
        if const_expr(not self.early):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        e_num = mOff.shape[0] - 1
        sOff = storage.off.get_tensor(cute.make_layout((MAX_EXPERTS + 1,)))
        for i in range(tidx, e_num + 1, THREADS):
            sOff[i] = cute.arch.load(mOff.iterator + i, Int32, cop="cg") if const_expr(self.early) else mOff[i]
        cute.arch.sync_threads()
        sCum = storage.cum.get_tensor(cute.make_layout((MAX_EXPERTS + 1,)))
        # sCum[e] = units of the experts before e: each lane of warp 0 sums a run of experts, a warp scan adds the runs.
        if warp_idx == 0:
            lane = tidx % 32
            per = (e_num + 31) // 32
            lo = lane * per
            hi = cutlass.min(lo + per, e_num)
            own = Int32(0)
            for e in range(lo, hi):
                own += (sOff[e + 1] - sOff[e] + self.tok - 1) // self.tok * n_tiles
            incl = own
            for d in cutlass.range_constexpr(5):
                t = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl += t
            run = incl - own
            for e in range(lo, hi):
                sCum[e] = run
                run += (sOff[e + 1] - sOff[e] + self.tok - 1) // self.tok * n_tiles
            if lane == 31:
                sCum[e_num] = incl
        cute.arch.sync_threads()
        units = sCum[e_num]
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sW = storage.sW.get_tensor(sW_layout)
        early = Int32(0)  # k-tiles of the CTA's first unit whose weight chunks are already loading (early_weights)
        if const_expr(self.early):
            if warp_idx == 0:
                early = self.early_chunks(tma_w, gW_full, sW, pipe, sCum, sOff, e_num, units, n_tiles, k_tiles, expert_chunks, bidx)
            # Every thread waits: no global write, and no read of the previous kernel's output, before it completes.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if wg_idx == 0:
            if const_expr(self.gather):
                self.produce_gathered(tma_w, gW_full, sW, pipe, pipe_a, mA, mG, sA, sCum, sOff, e_num, units,
                                      n_tiles, k_tiles, expert_chunks, tidx, warp_idx, bidx, grid)  # fmt: skip
            else:
                if warp_idx == 0:
                    tWs, tWg = self.weight_chunks(tma_w, gW_full, sW)
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    u = Int32(bidx)
                    while u < units:
                        e, tile, row0, _ = self.unit_place(sCum, sOff, u, e_num, n_tiles)
                        gA = cute.local_tile(cute.domain_offset((row0, 0), gA_full), (self.tok, KT), (0, None))
                        tAs, tAg = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                        for kt in range(k_tiles):
                            if kt >= early:
                                self.load_chunk(pipe, state, tma_w, tWs, tWg, e * expert_chunks + tile * k_tiles + kt)
                            # An early k-tile's barrier already expects A's bytes too.
                            cute.copy(tma_a, tAg[(None, kt)], tAs[(None, state.index)], tma_bar_ptr=pipe.producer_get_barrier(state))
                            state.advance()
                        early = Int32(0)
                        u += grid
                    pipe.producer_tail(state)
                else:
                    if const_expr(self.offload):
                        self.store_units(pipe_c, self.staged(storage), mC, mB, sCum, sOff, e_num, units, n_tiles, tidx, bidx, grid)
        else:
            self.consume(tiled_mma, pipe, pipe_a, pipe_c, sA, sW, sCum, sOff, storage, mC, mB, e_num, units, n_tiles,
                         k_tiles, tidx, wg_idx, bidx, grid)  # fmt: skip

    @cute.jit
    def staged(self, storage):
        """The staging buffer as [128 weight rows, tok rows of A] (offloaded epilogue)."""
        return storage.sc.get_tensor(cute.make_layout((128, self.tok), stride=(1, SC_PITCH)))

    @cute.jit
    def store_units(self, pipe_c, sC, mC, mB, sCum, sOff, e_num, units, n_tiles, tidx, bidx, grid):
        """The offloaded epilogue, by the producer warpgroup's warps 1..STORE_WARPS: for each unit the consumers
        stage, its outputs (+ biases, the activation of gate and up for gated tiles) to global memory. Lane l finishes
        the VEC = cols / 32 consecutive columns from VEC l (4 of a rows tile's 128, 2 of a gated tile's 64), read from
        the buffer in one vector load per operand and stored in one vector store where the output's rows allow it
        (n_out a multiple of VEC), so a warp instruction covers a row's whole tile. At one element a lane the store
        warps cost 128-row GEMM1 12-13% over storing nothing; in vectors 1-4%. GEMM2's 22-28% hardly moved: what is
        left there is the writes themselves, not the warps' instructions (bench/NOTES.md v60). Warp s takes rows s,
        s + STORE_WARPS, ... The buffer is released after the stores: the consumers need it again only at their next
        unit's end."""
        t = tidx - 32
        sw = t // 32
        lane = t % 32
        n_out = mC.shape[1]
        vec = self.cols // 32
        whole = n_out % vec == 0  # every output row then starts aligned for a VEC-element store
        n_vec = n_out // vec
        mCv = cute.make_tensor(mC.iterator, cute.make_layout((mC.shape[0], n_vec * vec), stride=(n_vec * vec, 1)))
        bias = cute.make_rmem_tensor((2, vec), Float32)
        sums = cute.make_rmem_tensor((2, vec), Float32)  # (gate or row, up)
        res = cute.make_rmem_tensor((vec,), mC.element_type)
        cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        u = Int32(bidx)
        while u < units:
            e, tile, row0, rows_left = self.unit_place(sCum, sOff, u, e_num, n_tiles)
            first = tile * self.cols + vec * lane  # this lane's first column
            if const_expr(self.epi.has_bias):
                for j in cutlass.range_constexpr(vec):
                    if first + j < n_out:
                        if const_expr(self.gated):
                            bias[0, j] = mB[e, 0, first + j].to(Float32)
                            bias[1, j] = mB[e, 1, first + j].to(Float32)
                        else:
                            bias[0, j] = mB[e, first + j].to(Float32)
            pipe_c.consumer_wait(cstate)
            for c in range(sw, cutlass.min(rows_left, self.tok), STORE_WARPS):
                cute.autovec_copy(cute.local_tile(sC[None, c], (vec,), (lane,)), sums[0, None])
                if const_expr(self.gated):
                    cute.autovec_copy(cute.local_tile(sC[None, c], (vec,), (GATE_COLS // vec + lane,)), sums[1, None])
                for j in cutlass.range_constexpr(vec):
                    res[j] = self.finished(sums[0, j], sums[1, j] if const_expr(self.gated) else None, bias, j, mC.element_type)
                if whole:
                    if first < n_out:
                        cute.autovec_copy(res, cute.local_tile(mCv[row0 + c, None], (vec,), (tile * (self.cols // vec) + lane,)))
                else:
                    for j in cutlass.range_constexpr(vec):
                        if first + j < n_out:
                            mC[row0 + c, first + j] = res[j]
            pipe_c.consumer_release(cstate)
            cstate.advance()
            u += grid

    @cute.jit
    def weight_chunks(self, tma_w, gW_full, sW):
        """The weights' TMA partition: (the ring's stages, the chunks in global memory, by chunk index)."""
        gW = cute.local_tile(gW_full, (BOX, ROW_W), (None, None))
        return cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))

    @cute.jit
    def early_chunks(self, tma_w, gW_full, sW, pipe, sCum, sOff, e_num, units, n_tiles, k_tiles, expert_chunks, bidx) -> Int32:
        """Start the weight chunks of this CTA's first unit into the ring's first stages before the wait for the
        previous kernel (early_weights): at small M a CTA's job is a unit or two, and its weights then stream while
        GEMM1 finishes. Returns how many k-tiles were started (the producer loop skips their chunks; their barriers
        still count A's bytes). Warp 0 only."""
        started = Int32(0)
        if Int32(bidx) < units:
            e, tile, _, _ = self.unit_place(sCum, sOff, Int32(bidx), e_num, n_tiles)
            tWs, tWg = self.weight_chunks(tma_w, gW_full, sW)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            started = cutlass.min(k_tiles, self.stages)
            for kt in range(started):
                self.load_chunk(pipe, state, tma_w, tWs, tWg, e * expert_chunks + tile * k_tiles + kt)
                state.advance()
        return started

    @cute.jit
    def load_chunk(self, pipe, state, tma_w, tWs, tWg, chunk):
        """Acquire the producer's stage and start its weight chunk's TMA; returns the stage's barrier."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(tma_w, tWg[(None, chunk, 0)], tWs[(None, state.index)], tma_bar_ptr=bar)
        return bar

    @cute.jit
    def produce_gathered(self, tma_w, gW_full, sW, pipe, pipe_a, mA, mG, sA, sCum, sOff, e_num, units, n_tiles,
                         k_tiles, expert_chunks, tidx, warp_idx, bidx, grid):  # fmt: skip
        """The producer warpgroup with gather: warp 0 loads the weights' chunks (TMA, as without) and all 128
        threads copy the unit's rows of A, each from its token's row A[g[r]], in 16-byte cp.async chunks:
        thread t copies chunk t % 16 of rows t // 16 + 8 i. Rows past the expert, and chunks past K, are zero-filled
        (source size 0), so no gathered copy of the activations is ever written to memory."""
        copy_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BF16, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(copy_atom, cute.make_layout((8, A_CHUNKS), stride=(A_CHUNKS, 1)), cute.make_layout((1, 8)))
        tAsA = tiled_copy.get_slice(tidx).partition_D(sA)  # ((8), tok / 8, 1, stages)
        chunk = tidx % A_CHUNKS
        row_in = tidx // A_CHUNKS
        per_thread = self.tok // 8
        k_chunks = mA.shape[1] // 8
        src = cute.make_rmem_tensor(per_thread, Int32)
        # One predicate for the 8 elements of a chunk (stride 0).
        live = cute.make_rmem_tensor(cute.make_layout(((8,), 1), stride=((0,), 0)), cutlass.Boolean)
        tWs, tWg = self.weight_chunks(tma_w, gW_full, sW)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        u = Int32(bidx)
        while u < units:
            e, tile, row0, rows_left = self.unit_place(sCum, sOff, u, e_num, n_tiles)
            dead = Int32(0)  # bit i: this thread's row i is past the expert
            for i in cutlass.range_constexpr(per_thread):
                r = row_in + 8 * i
                src[i] = 0
                if r >= rows_left:
                    dead = dead | (1 << i)
                else:
                    src[i] = mG[row0 + r]
            for kt in range(k_tiles):
                if warp_idx == 0:
                    self.load_chunk(pipe, state, tma_w, tWs, tWg, e * expert_chunks + tile * k_tiles + kt)
                pipe_a.producer_acquire(state)
                past_k = Int32(cutlass.select_(kt * A_CHUNKS + chunk >= k_chunks, 1, 0))
                for i in cutlass.range_constexpr(per_thread):
                    live[0] = ((dead >> i) | past_k) & 1 == 0
                    g_chunk = cute.local_tile(mA[src[i], None], (8,), (kt * A_CHUNKS + chunk,))
                    cute.copy(copy_atom, g_chunk, tAsA[(None, i, 0, state.index)], pred=live)
                pipe_a.producer_commit(state)
                state.advance()
            u += grid
        # producer_tail advances the state it is given: each pipeline's tail starts from the same state.
        if warp_idx == 0:
            pipe.producer_tail(state.clone())
        pipe_a.producer_tail(state)

    @cute.jit
    def consume(self, tiled_mma, pipe, pipe_a, pipe_c, sA, sW, sCum, sOff, storage, mC, mB, e_num, units, n_tiles, k_tiles,
                tidx, wg_idx, bidx, grid):  # fmt: skip
        ctid = tidx - 128 * wg_idx
        wg = wg_idx - 1  # the tile's 64-row half this warpgroup multiplies
        lane = ctid % 32
        w = ctid // 32
        n_out = mC.shape[1]  # (e_num comes from the global offsets: sOff's static extent is MAX_EXPERTS + 1)
        thr = tiled_mma.get_slice(ctid)
        tCrB = tiled_mma.make_fragment_B(thr.partition_B(sA))
        tCrA = tiled_mma.make_fragment_A(thr.partition_A(cute.make_rmem_tensor((64, KT), BF16)))
        a32 = cute.recast_tensor(tCrA, Int32)
        tCcC = thr.partition_C(cute.make_identity_tensor((64, self.tok)))
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)
        sW32 = cute.recast_tensor(sW, Int32)
        sUp = storage.up.get_tensor(cute.make_layout((128, self.tok // 2)))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)  # the next stage to release
        assert cute.shape(tCcC) == ((2, ROW_SLOTS, self.tok // 8), 1, 1), cute.shape(tCcC)  # what row_slot assumes
        bias = cute.make_rmem_tensor((2, ROW_SLOTS), Float32)  # (gate or row, up) of this thread's two weight rows
        cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)  # the staging buffer (offload)
        u = Int32(bidx)
        while u < units:
            e, tile, row0, rows_left = self.unit_place(sCum, sOff, u, e_num, n_tiles)
            if const_expr(self.epi.has_bias and not self.offload):
                self.load_biases(bias, tCcC, mB, e, tile, n_out, wg)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for kt in range(k_tiles):
                pipe.consumer_wait(state)
                if const_expr(self.gather):
                    pipe_a.consumer_wait(state)
                words = cute.make_rmem_tensor((2, GROUPS), Int32)
                sw = cute.make_rmem_tensor((2,), Int32)
                for h in cutlass.range_constexpr(2):
                    f = (((wg * 4 + w) * 2 + h) * 32 + lane) * GROUPS  # a multiple of GROUPS: within one box row
                    for g in cutlass.range_constexpr(GROUPS):
                        words[h, g] = sW32[f // (ROW_W // 4), f % (ROW_W // 4) + g, state.index]
                    f = CODE_WORDS + ((wg * 4 + w) * 2 + h) * 8 + lane // 4
                    sw[h] = sW32[f // (ROW_W // 4), f % (ROW_W // 4), state.index]
                stage = state.index
                state.advance()
                # The k-tile before's WGMMAs read the fragment registers about to be rewritten, and its stage:
                # both are free once they are done. (A second register set, to decode beside them, measured
                # 5-7% slower: branch wip/w4a16.)
                warpgroup.wait_group(0)
                if kt > 0:
                    self.release(pipe, pipe_a, done)
                    done.advance()
                if cute.arch.vote_any_sync(((sw[0] | sw[1]) & Int32(0x80808080 - (1 << 32))) != 0):
                    for h in cutlass.range_constexpr(2):
                        for g in cutlass.range_constexpr(GROUPS):
                            m1, m2 = scale_mults_any(sw[h], g)
                            self.put(a32, h, g, decode_word_any(words[h, g], m1, m2))
                else:
                    for h in cutlass.range_constexpr(2):
                        for g in cutlass.range_constexpr(GROUPS):
                            self.put(a32, h, g, decode_word(words[h, g], scale_mult(sw[h], g)))
                warpgroup.fence()
                for kb in cutlass.range_constexpr(KB):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb)], tCrB[(None, None, kb, stage)], acc)
                warpgroup.commit_group()
            warpgroup.wait_group(0)
            if k_tiles > 0:
                self.release(pipe, pipe_a, done)
                done.advance()
            if const_expr(self.offload):
                sC = self.staged(storage)
                pipe_c.producer_acquire(cstate)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    mrow, c = tCcC[i]
                    sC[wg * 64 + mrow, c] = acc[i]
                pipe_c.producer_commit(cstate)
                cstate.advance()
            else:
                self.epilogue(acc, tCcC, sUp, mC, bias, e, tile, row0, rows_left, n_out, ctid, wg)
            u += grid

    @cute.jit
    def release(self, pipe, pipe_a, state):
        pipe.consumer_release(state)
        if const_expr(self.gather):
            pipe_a.consumer_release(state)

    @cute.jit
    def load_biases(self, bias, tCcC, mB, e, tile, n_out, wg):
        """The unit's biases of this thread's accumulator elements in float32, loaded before its k-loop so that
        their latency hides under it: loaded in the epilogue, once per unit, it cost ~9% of gpt-oss's biased layer
        at M = 128 (bench/NOTES.md v56). Gated: warpgroup 0 only, which applies the activation. One value per
        weight row the thread's accumulators cover (row_slot), read at the first element on that row."""
        for j in cutlass.range_constexpr(ROW_SLOTS):
            mrow, _ = tCcC[2 * j]  # row_slot(2 j) = j
            if const_expr(self.gated):
                col = tile * GATE_COLS + mrow
                if (wg == 0) & (col < n_out):
                    bias[0, j] = mB[e, 0, col].to(Float32)
                    bias[1, j] = mB[e, 1, col].to(Float32)
            else:
                col = tile * TILE_ROWS + wg * 64 + mrow
                if col < n_out:
                    bias[0, j] = mB[e, col].to(Float32)

    @cute.jit
    def put(self, a32, h, g, regs):
        """A word's four registers into the A fragment: k-blocks 2g and 2g + 1, K halves 0 and 1, row half h."""
        a32[(0, h, 0), 0, 2 * g] = regs[0]
        a32[(0, h, 1), 0, 2 * g] = regs[1]
        a32[(0, h, 0), 0, 2 * g + 1] = regs[2]
        a32[(0, h, 1), 0, 2 * g + 1] = regs[3]

    @cute.jit
    def epilogue(self, acc, tCcC, sUp, mC, bias, e, tile, row0, rows_left, n_out, ctid, wg):
        """Store a unit's sums: accumulator element i is weight row tCcC[i][0] of this warpgroup's 64, row of A
        tCcC[i][1] of the m-tile's; bias: load_biases' values."""
        if const_expr(self.gated):
            # Warpgroup 1's up sums to warpgroup 0, which holds the same columns' gate sums. Barrier 1: warpgroup 0
            # has read the unit before's; barrier 2: warpgroup 1 has written this one's.
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS * 128)
            if wg == 1:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    sUp[ctid, i] = acc[i]
            cute.arch.barrier(barrier_id=2, number_of_threads=CONSUMERS * 128)
            if wg == 0:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    mrow, c = tCcC[i]
                    col = tile * GATE_COLS + mrow
                    if (c < rows_left) & (col < n_out):
                        mC[row0 + c, col] = self.finished(acc[i], sUp[ctid, i], bias, row_slot(i), BF16)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                mrow, c = tCcC[i]
                col = tile * TILE_ROWS + wg * 64 + mrow
                if (c < rows_left) & (col < n_out):
                    mC[row0 + c, col] = self.finished(acc[i], None, bias, row_slot(i), mC.element_type)

    @cute.jit
    def finished(self, v, up, bias, slot, dtype):
        """An output element from its float32 sums, in dtype: v (+ bias[0, slot]), or for gated tiles act(v +
        bias[0, slot], up + bias[1, slot]). Both epilogues (the consumers' own and the offloaded one) use it."""
        if const_expr(self.epi.has_bias):
            v = v + bias[0, slot]
            if const_expr(self.gated):
                up = up + bias[1, slot]
        if const_expr(self.gated):
            v = _gated(self.epi.activation, v, up, self.epi.alpha, self.epi.limit)
        return v.to(dtype)
