"""The per-token sum after GEMM2, in the CuTe DSL.

    out[m, :] = sum_{j=0}^{k-1} topk_weights[m, j] * y[inverse[m*k + j], :]
                over the pairs that hold work (float32, then the output dtype)

y is GEMM2's output in grouped-row order (moe_gemm.py), unweighted: the router weight is applied here,
so GEMM2's epilogue stores each row where it is instead of searching for its pair (that search cost
GEMM2 6-15% at M = 8192; bench/NOTES.md, v9). Deterministic: each thread owns one 16-byte chunk (8
bf16/fp16 values) of a token's row (grid: tokens x H / 1024) and adds that chunk of the k rows in the
order j = 0..k-1, with no atomics, so the same inputs give bit-identical outputs run to run. A pair
whose grouped row (inverse) is at or past offsets[E] (dropped by expert_map, or out of range) was
never written by GEMM2; it contributes nothing and its row is never read. H must be a multiple of 8.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
VEC = 8
EARLY = 8  # pairs of a token whose row index and weight are read before the wait (top-k <= 8 is common)
UNROLL = 4  # rows of a token loaded together past those


def token_sum_views(y_ptr, inverse_ptr, weights_ptr, offsets_ptr, out_ptr, m, k, h, num_experts):
    """The token sums' tensors over their pointers (at trace time): y (M * k, H), inverse and weights
    (M * k,), offsets (E + 1,), out (M, H); H is a multiple of VEC."""
    h = cute.assume(h, divby=VEC)
    return (
        cute.make_tensor(y_ptr, cute.make_layout((m * k, h), stride=(h, 1))),
        cute.make_tensor(inverse_ptr, cute.make_layout((m * k,))),
        cute.make_tensor(weights_ptr, cute.make_layout((m * k,))),
        cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,))),
        cute.make_tensor(out_ptr, cute.make_layout((m, h), stride=(h, 1))),
    )


class TokenSumSm90:
    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,  # (M * k, H) GEMM2's rows in grouped-row order
        inverse_ptr: cute.Pointer,  # (M * k,) int32: the grouped row of each pair
        weights_ptr: cute.Pointer,  # (M * k,) float32: the router weight of each pair
        offsets_ptr: cute.Pointer,  # (E + 1,) int32: offsets[E] = rows that hold work
        out_ptr: cute.Pointer,  # (M, H)
        m: Int32,
        k: Int32,
        h: Int32,
        num_experts: Int32,
        stream: cuda.CUstream,
    ):
        mY, mInv, mW, mOff, mOut = token_sum_views(y_ptr, inverse_ptr, weights_ptr, offsets_ptr, out_ptr, m, k, h, num_experts)
        h = mOut.shape[1]
        # One thread per 16-byte chunk of a token's row, so a small M still spreads over many SMs (one
        # CTA per token looping over H cost up to ~20 µs at M = 1, H = 7168).
        parts = (h // VEC + THREADS - 1) // THREADS
        self.kernel(mY, mInv, mW, mOff, mOut, k, num_experts).launch(
            grid=[m, parts, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mInv: cute.Tensor, mW: cute.Tensor, mOff: cute.Tensor, mOut: cute.Tensor, k: Int32, num_experts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        token, part, _ = cute.arch.block_idx()
        h = mOut.shape[1]
        # Launched dependent on GEMM2 (PDL), right after it, by the same call: GEMM2 lets this kernel
        # launch only once the kernel before GEMM2 is complete, so the plan's offsets and inverse and
        # the router weights (all older than GEMM2, which writes only y) are final already. Reading
        # them before the wait takes two dependent round trips off the end of the layer; y is read
        # only after it.
        valid_rows = mOff[num_experts]
        rows = cute.make_rmem_tensor((EARLY,), Int32)
        scales = cute.make_rmem_tensor((EARLY,), Float32)
        for j in cutlass.range_constexpr(EARLY):
            rows[j] = -1
            if j < k:
                rows[j] = mInv[token * k + j]
                scales[j] = mW[token * k + j]
        cute.arch.griddepcontrol_wait()
        # The next kernel, if it launches as a programmatic dependent (the next MoE layer's routing
        # plan), may now start and wait for this one; that hides its launch (bench/NOTES.md, v22).
        cute.arch.griddepcontrol_launch_dependents()
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mY.element_type, num_bits_per_copy=128)
        res = cute.make_rmem_tensor((VEC,), mOut.element_type)
        c = part * THREADS + tidx
        if c < h // VEC:
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            # UNROLL rows' loads in flight at a time (more would cost registers, so occupancy, where
            # the sum streams at large M), added in the order j = 0..k-1: first the EARLY pairs read
            # above, then any past them (k > EARLY).
            frags = [cute.make_rmem_tensor((VEC,), mY.element_type) for _ in range(UNROLL)]
            for j0 in cutlass.range_constexpr(0, EARLY, UNROLL):
                self._add_rows(mY, c, rows, scales, j0, valid_rows, frags, acc)
            more_rows = cute.make_rmem_tensor((UNROLL,), Int32)
            more_scales = cute.make_rmem_tensor((UNROLL,), Float32)
            for j0 in range(EARLY, k, UNROLL):
                for jj in cutlass.range_constexpr(UNROLL):
                    more_rows[jj] = -1
                    if j0 + jj < k:
                        more_rows[jj] = mInv[token * k + j0 + jj]
                        more_scales[jj] = mW[token * k + j0 + jj]
                self._add_rows(mY, c, more_rows, more_scales, 0, valid_rows, frags, acc)
            res.store(acc.load().to(mOut.element_type))
            cute.copy(atom, res, cute.local_tile(mOut[token, None], (VEC,), (c,)))

    @cute.jit
    def _add_rows(self, mY, c, rows, scales, first, valid_rows, frags, acc):
        """acc += scales[j] * chunk c of row rows[j] of y, for j = first .. first + UNROLL - 1 in order,
        skipping rows outside [0, valid_rows) (dropped pairs, or j >= k). All the loads come first."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mY.element_type, num_bits_per_copy=128)
        for jj in cutlass.range_constexpr(UNROLL):
            if rows[first + jj] >= 0 and rows[first + jj] < valid_rows:
                cute.copy(atom, cute.local_tile(mY[rows[first + jj], None], (VEC,), (c,)), frags[jj])
        for jj in cutlass.range_constexpr(UNROLL):
            if rows[first + jj] >= 0 and rows[first + jj] < valid_rows:
                acc.store(acc.load() + frags[jj].load().to(Float32) * scales[first + jj])
