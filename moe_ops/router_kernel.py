"""The router's linear at decode sizes in one Triton kernel: logits [M, E] = x [M, H] @ weight[E, H]^T
(+ bias [E]).

Why: at M = 1 cuBLAS runs the router's linear as a split-K GEMM and a reduce, two launches of 5-6 µs
together in a CUDA graph, for 0.5-0.8 MB of weights; one kernel that gives each program a few experts'
rows reads them in 1.5-3.4 µs (bench/NOTES.md v62). Past `serves` cuBLAS wins and the op calls it
(router.py).

Each program takes BLOCK_E experts and BLOCK_M tokens and walks H in BLOCK_H chunks: a chunk of weight
rows is loaded once and multiplied by each token's chunk in turn, in float32; the sum over a chunk and
then over chunks is float32, rounded once to the output's dtype (plus the bias, as F.linear adds it).
It serves up to MAX_TOKENS tokens and _WORK products a program (`serves`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch_ints import cdiv, next_power_of_2
from .plan_kernel import on_device, uses_grid_dependency

# Where the kernel serves (router.py calls cuBLAS elsewhere; bench/NOTES.md v62, v63): up to MAX_TOKENS
# tokens, and up to _WORK products a program (M x BLOCK_E x H). Past _WORK each program's sums take
# longer than cuBLAS's split-K GEMM and its reduce (DeepSeek-V3 at M = 4: 8.1 against 6.5 µs, H200). At 5-8
# tokens within _WORK the kernel and the route kernel after it take 1-2 µs less than cuBLAS and the route
# (Qwen3, Mixtral; gpt-oss at 5), and Qwen3's layer read 0.6-3.5 µs faster over three runs, where layer
# rows running the same kernels differ by up to 2.2 µs. Past 8 tokens not measured.
MAX_TOKENS = 8
_WORK = 32768
# Programs the grid aims for: about one per SM, so the weights stream from all of them; from 4 tokens
# half as many, each with twice the experts, which read x's rows half as often (0.2-0.5 µs less at M = 4
# for Qwen3, gpt-oss and Mixtral, bench/NOTES.md v62; at M = 8, 128 programs had cost Qwen3's layer
# 0.8-1.5 µs in three runs of four).
_PROGRAMS = {1: 128, 2: 128, 4: 64, 8: 64}
_TILE = 8192  # weight elements per chunk (BLOCK_E x BLOCK_H): 32 float32 registers a thread
_WARPS = 8


# Sizes vary with M: specialising on its divisibility would compile a new kernel for some token counts.
@triton.jit(do_not_specialize=["m"])
def _router_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, m, h, e, stride_xm, stride_xh, stride_we, stride_wh,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        # The route kernel after this one waits for its completion (griddepcontrol.wait) before reading
        # the logits: letting it launch now hides its launch under this kernel. This kernel reads x
        # only after the kernels before it complete, whatever they are.
        gdc_launch_dependents()
        gdc_wait()
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < e
    row0 = tl.program_id(1) * BLOCK_M
    slots = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, h, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        c_ok = cols < h
        w = tl.load(
            w_ptr + experts[:, None].to(tl.int64) * stride_we + cols[None, :] * stride_wh,
            mask=e_ok[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        # One token at a time against the chunk in registers: a [BLOCK_M, BLOCK_E, BLOCK_H] product
        # would not fit them.
        for i in tl.static_range(BLOCK_M):
            row = row0 + i
            x_end = tl.where(row < m, h, 0)  # no column of a row past M
            xr = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols * stride_xh, mask=cols < x_end, other=0.0)
            part = tl.sum(w * xr.to(tl.float32)[None, :], axis=1)
            acc = tl.where(slots[:, None] == i, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + experts, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    rows = row0 + slots
    out = out_ptr + rows[:, None].to(tl.int64) * e + experts[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < m) & e_ok[None, :])


def compile_options(grid_dependency: bool) -> dict:
    """Triton's compile options: launch_pdl when it launches as a programmatic dependent; FP fusion on
    (a multiply-add per product, as cuBLAS's), said so that Triton 3.9 does not warn of its default."""
    return {"launch_pdl": grid_dependency, "enable_fp_fusion": True}


def serves(m: int, h: int, e: int) -> bool:
    """Whether the kernel serves M tokens of H features for E experts (else cuBLAS, router.py)."""
    return m <= MAX_TOKENS and m * launch_shape(m, h, e)[1] * h <= _WORK


@functools.lru_cache(maxsize=None)  # serves() and every launch ask it: a few sizes per model
def launch_shape(m: int, h: int, e: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_E, BLOCK_H) for M tokens, H features and E experts: every token in one program
    row (M <= MAX_TOKENS), the fewest experts per program that still give about _PROGRAMS[BLOCK_M]
    programs, and chunks of at most _TILE weights."""
    block_m = next_power_of_2(max(m, 1))
    block_e = next_power_of_2(max(1, cdiv(e, _PROGRAMS[min(block_m, MAX_TOKENS)])))
    block_h = min(next_power_of_2(max(h, 16)), max(16, _TILE // block_e))
    return block_m, block_e, block_h


def router_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x [M, H] @ weight [E, H]^T (+ bias [E]) -> logits [M, E] in x's dtype, contiguous; arguments
    checked by the caller (router.check_router_args), for sizes it serves. launch (BLOCK_E, BLOCK_H,
    warps) overrides launch_shape's and _WARPS; bench/router_linear.py sweeps it."""
    m, h = x.shape
    e = weight.shape[0]
    out = torch.empty(m, e, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_e, block_h = launch_shape(m, h, e)
    warps = _WARPS
    if launch is not None:
        block_e, block_h, warps = launch
    grid_dependency = uses_grid_dependency(x.device)
    with on_device(x.device):
        _router_linear_kernel[(cdiv(e, block_e), cdiv(m, block_m))](
            x, weight, bias if bias is not None else weight, out, m, h, e,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_H=block_h, HAS_BIAS=bias is not None, PDL=grid_dependency,
            num_warps=warps, **compile_options(grid_dependency),
        )  # fmt: skip
    return out
