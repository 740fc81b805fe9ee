"""cute_kernels: CuTe DSL (nvidia-cutlass-dsl) kernels for Hopper (sm_90a) behind the fused MoE ops.

- moe_gemm.py: the persistent, warp-specialised grouped GEMM over experts (gathered or grouped A rows,
  TMA weights, WGMMA, fused activation / bias epilogue);
- token_sum.py: the deterministic router-weighted sum of each token's k rows;
- w4a16_grouped.py: the grouped GEMM of bf16 rows with mxfp4 experts, decoded in registers (weights
  packed once by w4a16_pack.py);
- compile.py: compile once (TVM-FFI calling: ints for pointers, scalars and the stream), cache in
  memory and on disk;
- tiles.py: the tile shapes each GEMM takes, chosen from the layer's sizes on the host;
- interface.py: what callers use: support checks with reasons, and launchers taking torch tensors.
This package imports nothing from moe_ops or lowering.
"""
import os

# Compile for Hopper even on a machine without a GPU (the DSL's default target is sm_100a).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
