"""The per-token sum after GEMM2, in the CuTe DSL.

    out[m, :] = sum_{j=0}^{k-1} y[m*k + j, :]     over the pairs that hold work (float32, then the output dtype)

y is in pair order and already scaled by the router weights (moe_gemm.py's router-weight epilogue), so
a token's k rows are adjacent. Deterministic: one CTA owns a token and adds its k rows in the order
j = 0..k-1, with no atomics, so the same inputs give bit-identical outputs run to run. A pair whose
grouped row (inverse) is at or past offsets[E] (dropped by expert_map, or out of range) was never
written by GEMM2; it contributes nothing and its row is never read.
Each thread moves 16-byte chunks (8 bf16/fp16 values); H must be a multiple of 8.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
VEC = 8


class TokenSumSm90:
    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,  # (M * k, H) weighted rows in pair order
        inverse_ptr: cute.Pointer,  # (M * k,) int32: the grouped row of each pair
        offsets_ptr: cute.Pointer,  # (E + 1,) int32: offsets[E] = rows that hold work
        out_ptr: cute.Pointer,  # (M, H)
        m: Int32,
        k: Int32,
        h: Int32,
        num_experts: Int32,
        stream: cuda.CUstream,
    ):
        h = cute.assume(h, divby=VEC)
        mY = cute.make_tensor(y_ptr, cute.make_layout((m * k, h), stride=(h, 1)))
        mInv = cute.make_tensor(inverse_ptr, cute.make_layout((m * k,)))
        mOff = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((m, h), stride=(h, 1)))
        self.kernel(mY, mInv, mOff, mOut, k, num_experts).launch(grid=[m, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mInv: cute.Tensor, mOff: cute.Tensor, mOut: cute.Tensor, k: Int32, num_experts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        h = mOut.shape[1]
        valid_rows = mOff[num_experts]
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mY.element_type, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor((VEC,), mY.element_type)
        res = cute.make_rmem_tensor((VEC,), mOut.element_type)
        chunks = h // VEC
        for c in range(tidx, chunks, THREADS):
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            for j in range(k):
                row = mInv[token * k + j]
                if row >= 0 and row < valid_rows:
                    cute.copy(atom, cute.local_tile(mY[token * k + j, None], (VEC,), (c,)), frag)
                    acc.store(acc.load() + frag.load().to(Float32))
            res.store(acc.load().to(mOut.element_type))
            cute.copy(atom, res, cute.local_tile(mOut[token, None], (VEC,), (c,)))
