"""The per-token sum after GEMM2 with a norm of each row first (MuseSpark's post-expert norm), in the CuTe DSL.

    s_j = round(y[inverse[m*k + j], :] * round_w(1 + norm_weight))     round: to y's dtype,
    n_j = round(s_j / sqrt(mean(s_j^2) + eps))                         round_w: to norm_weight's
    out[m, :] = round(sum_{j=0}^{k-1} topk_weights[m, j] * n_j)        (float32 in between)

over the pairs that hold work, as token_sum.py's sum. A row's norm needs its whole width, so one CTA
owns one token, its threads holding the token's output row in registers (16 bytes of y per thread and
chunk, at most MAX_CHUNKS chunks: H <= MAX_H). Rows go in groups of GROUP: each warp sums the squares
of its rows of the group (a warp reduction, no barrier) into shared memory, then every thread adds its
chunks of the group's normalized, weighted rows in the order j = 0..k-1 (y read again, from L1/L2),
UNROLL rows at a time: deterministic, no atomics. H must be a multiple of 8.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.memory import SmemAllocator

from .token_sum import VEC, token_sum_views

THREADS = 256
WARPS = THREADS // 32
MAX_CHUNKS = 4  # 16-byte chunks of a row per thread
MAX_H = THREADS * VEC * MAX_CHUNKS
GROUP = 2 * WARPS  # rows whose inverse root mean squares shared memory holds at a time
UNROLL = 4  # rows whose chunks are loaded together in the sum


class NormTokenSumSm90:
    """weight_float32: norm_weight is float32 (else it has y's dtype, and 1 + weight rounds to it)."""

    def __init__(self, weight_float32: bool):
        self.weight_float32 = weight_float32

    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,  # (M * k, H) GEMM2's rows in grouped-row order
        inverse_ptr: cute.Pointer,  # (M * k,) int32: the grouped row of each pair
        weights_ptr: cute.Pointer,  # (M * k,) float32: the router weight of each pair
        offsets_ptr: cute.Pointer,  # (E + 1,) int32: offsets[E] = rows that hold work
        norm_ptr: cute.Pointer,  # (H,) the norm's weight
        out_ptr: cute.Pointer,  # (M, H)
        m: Int32,
        k: Int32,
        h: Int32,
        num_experts: Int32,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        mY, mInv, mW, mOff, mOut = token_sum_views(y_ptr, inverse_ptr, weights_ptr, offsets_ptr, out_ptr, m, k, h, num_experts)
        mNorm = cute.make_tensor(norm_ptr, cute.make_layout((mOut.shape[1],)))
        self.kernel(mY, mInv, mW, mOff, mNorm, mOut, k, num_experts, eps).launch(
            grid=[m, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.jit
    def _one_plus(self, mNorm, c, wfrag):
        """1 + the norm's weight over chunk c in float32, rounded to the weight's dtype (as torch adds there)."""
        cute.autovec_copy(cute.local_tile(mNorm, (VEC,), (c,)), wfrag)
        one_plus = wfrag.load().to(Float32) + 1.0
        if const_expr(not self.weight_float32):
            one_plus = one_plus.to(mNorm.element_type).to(Float32)
        return one_plus

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mInv: cute.Tensor, mW: cute.Tensor, mOff: cute.Tensor, mNorm: cute.Tensor,
               mOut: cute.Tensor, k: Int32, num_experts: Int32, eps: Float32):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        h = mOut.shape[1]
        chunks = h // VEC
        warp, lane = tidx // 32, tidx % 32

        @cute.struct
        class Storage:
            rstd: cute.struct.Align[cute.struct.MemRange[Float32, GROUP], 16]

        sRstd = SmemAllocator().allocate(Storage).rstd.get_tensor(cute.make_layout((GROUP,)))
        wfrag = cute.make_rmem_tensor((VEC,), mNorm.element_type)
        # GEMM2 (this kernel's programmatic predecessor) writes y: y is read after the wait only.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        valid_rows = mOff[num_experts]
        frag = cute.make_rmem_tensor((VEC,), mY.element_type)
        frags = [cute.make_rmem_tensor((VEC,), mY.element_type) for _ in range(UNROLL)]
        rows = cute.make_rmem_tensor((UNROLL,), Int32)
        acc = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(MAX_CHUNKS)]
        for i in cutlass.range_constexpr(MAX_CHUNKS):
            acc[i].fill(0.0)
        for j0 in range(0, k, GROUP):
            # Each warp: the inverse root mean square of its rows j0 + warp, j0 + warp + WARPS, ...
            for jw in cutlass.range_constexpr(GROUP // WARPS):
                j = j0 + jw * WARPS + warp
                if j < k:
                    row = mInv[token * k + j]
                    part = Float32(0.0)
                    if row >= 0 and row < valid_rows:
                        # unrolled, so that several rows' loads are in flight (one token's CTA is the
                        # whole kernel at M = 1)
                        for c in cutlass.range(lane, chunks, 32, unroll=4):
                            cute.autovec_copy(cute.local_tile(mY[row, None], (VEC,), (c,)), frag)
                            s = (frag.load().to(Float32) * self._one_plus(mNorm, c, wfrag)).to(mY.element_type).to(Float32)
                            part = part + (s * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    part = cute.arch.warp_reduction_sum(part)
                    if lane == 0:
                        sRstd[jw * WARPS + warp] = cute.math.rsqrt(part / Float32(h) + eps)
            cute.arch.sync_threads()
            # Every thread: its chunks of the group's rows, normalized and weighted, in the order j;
            # UNROLL rows' loads in flight at a time (first all loads, then the sums).
            for u0 in cutlass.range_constexpr(0, GROUP, UNROLL):
                for u in cutlass.range_constexpr(UNROLL):
                    rows[u] = -1
                    if j0 + u0 + u < k:
                        rows[u] = mInv[token * k + j0 + u0 + u]
                for i in cutlass.range_constexpr(MAX_CHUNKS):
                    if tidx + i * THREADS < chunks:
                        for u in cutlass.range_constexpr(UNROLL):
                            if rows[u] >= 0 and rows[u] < valid_rows:
                                cute.autovec_copy(cute.local_tile(mY[rows[u], None], (VEC,), (tidx + i * THREADS,)), frags[u])
                        # (from L1: kept in registers for every chunk, they cost the kernel occupancy)
                        scale = self._one_plus(mNorm, tidx + i * THREADS, wfrag)
                        for u in cutlass.range_constexpr(UNROLL):
                            if rows[u] >= 0 and rows[u] < valid_rows:
                                s = (frags[u].load().to(Float32) * scale).to(mY.element_type).to(Float32)
                                normed = (s * sRstd[u0 + u]).to(mY.element_type).to(Float32)
                                acc[i].store(acc[i].load() + normed * mW[token * k + j0 + u0 + u])
            # The next group's warps overwrite sRstd only after every thread has read this group's.
            cute.arch.sync_threads()
        res = cute.make_rmem_tensor((VEC,), mOut.element_type)
        for i in cutlass.range_constexpr(MAX_CHUNKS):
            if tidx + i * THREADS < chunks:
                res.store(acc[i].load().to(mOut.element_type))
                cute.autovec_copy(res, cute.local_tile(mOut[token, None], (VEC,), (tidx + i * THREADS,)))
