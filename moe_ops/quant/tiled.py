"""mxfp4 expert weights tiled at load time, in the layout the w4a16 kernels read (cute_kernels/w4a16_pack.py).

mxfp4_w4a16 layers otherwise keep their codes ([E, N, K/2]) and scales ([E, N, K/32]), and each call on the kernels
re-lays the experts it routes to (w4_kernels.py): at gpt-oss's shapes that packing took 50-75% of the layer's time
(bench/NOTES.md v55). Tiled once, the weights replace the codes and scales (a second copy would double the
experts' memory), and a call reads them as they are.

A tiled weight is uint8 [E, N, B] (w4a16_pack.tiled_chunks): N stays the weight's rows, so shapes and fake impls
read N where they did; K is the activations' width (B holds whole 128-K chunks, padded), checked against the
tiles to the k-tile of 128, the finest size they record (FusedMoE checks the activations' width itself; a
hand-written call passing activations narrower than the weights' K within its last k-tile would read the
columns past it). Its op format string names the tile kind, which the reference needs to read it back: GEMM1
of a gated activation pairs gate and up rows per tile, as its gate layout says; GEMM2 has plain row tiles.
"""
from __future__ import annotations

import torch

from cute_kernels import w4a16_pack as wp

from .. import _checks
from . import formats

# op format (w_dtype) -> (tile kind, gate layout)
TILED_FORMATS = {
    "mxfp4_tiled_rows": ("rows", None),
    "mxfp4_tiled_gate_up": ("gate_up", "concat"),
    "mxfp4_tiled_gate_up_interleaved": ("gate_up", "interleaved"),
}
# The tiled formats' scales live in their chunks: each has mxfp4's 1x32 groups and no scale tensor.
GROUP = (1, wp.GROUP)


def is_tiled(w_dtype: str) -> bool:
    """Whether an op's weight format name is one of the load-time tiled mxfp4 formats."""
    return w_dtype in TILED_FORMATS


def gemm_formats(gates: str) -> tuple[str, str]:
    """(GEMM1's, GEMM2's) op format of a layer tiled with WeightQuant.tiled = gates ("concat" or "interleaved")."""
    return ("mxfp4_tiled_gate_up_interleaved" if gates == "interleaved" else "mxfp4_tiled_gate_up"), "mxfp4_tiled_rows"


def weight_op_args(wq) -> tuple[str, str, list[int]]:
    """(GEMM1's w_dtype, GEMM2's w_dtype, w_group) as the ops take them for a WeightQuant or None."""
    if wq is None:
        return "none", "none", [-1, -1]
    if wq.tiled is not None:
        return (*gemm_formats(wq.tiled), list(GROUP))
    return wq.dtype, wq.dtype, list(wq.group.astuple())


def gates_read(gated: bool, interleaved: bool) -> str | None:
    """How an activation reads GEMM1's gate and up rows: "concat", "interleaved", or None (no gate)."""
    return ("interleaved" if interleaved else "concat") if gated else None


def check_gemm1_format(w_dtype: str, gated: bool, interleaved: bool) -> None:
    """GEMM1 on tiled weights: their tiles must pair the gate and up rows as the activation reads them."""
    if not is_tiled(w_dtype):
        return
    kind, gate_layout = TILED_FORMATS[w_dtype]
    want = gates_read(gated, interleaved)
    if kind != "gate_up" or gate_layout != want:
        need = f"a gate_up format with {want} gates" if want else "no tiled format (tiles pair gate and up rows; this activation has no gate)"
        raise ValueError(f"w_dtype: GEMM1 of an activation reading its gates as {want} needs {need}, got {w_dtype!r}")


def check_gemm2_format(w_dtype: str) -> None:
    """GEMM2 on tiled weights reads plain row tiles."""
    if is_tiled(w_dtype) and w_dtype != "mxfp4_tiled_rows":
        raise ValueError(f"w_dtype: GEMM2's tiled weights are 'mxfp4_tiled_rows', got {w_dtype!r}")


def check_tiled(name: str, w: torch.Tensor, w_dtype: str, k: int) -> None:
    """w: uint8 [E, N, B] tiled as w_dtype says, for GEMMs of K = k; ValueError/TypeError naming `name` otherwise."""
    kind, _ = TILED_FORMATS[w_dtype]
    _checks.expect_dtype(name, w, (torch.uint8,))
    _checks.expect_ndim(name, w, 3, f"[E, N, B] {w_dtype}")
    n = w.shape[1]
    if kind == "gate_up" and n % 2:
        raise ValueError(f"{name}: {w_dtype} pairs gate and up rows; N must be even, got shape {tuple(w.shape)}")
    if k % wp.GROUP or k < wp.GROUP:
        raise ValueError(f"{name}: {w_dtype} wants K a positive multiple of {wp.GROUP}, got K={k}")
    _, b = wp.tiled_chunks(kind, n, k)
    if w.shape[2] != b:
        raise ValueError(
            f"{name}: {w_dtype} of N={n}, K={k} is [E, {n}, {b}] bytes (tile_mxfp4_weights), got shape {tuple(w.shape)}"
        )


def untile(w: torch.Tensor, w_dtype: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled w [E, N, B] -> (codes uint8 [E, N, K/2], e8m0 scales uint8 [E, N, K/32]) as they were tiled. No host
    sync (the padding is not checked): the ops' reference reads tiled weights through it."""
    kind, gate_layout = TILED_FORMATS[w_dtype]
    return wp.untile_mxfp4_experts(w, kind=kind, gate_layout=gate_layout, k=k, check=False)


# Experts per packing launch when tiling on CUDA: bounds the packed temporary (gpt-oss-120b's w13: 144 MB).
_TILE_STEP = 16


def tile(codes: torch.Tensor, scales: torch.Tensor, w_dtype: str) -> torch.Tensor:
    """mxfp4 codes [E, N, K/2] and scales [E, N, K/32] -> uint8 [E, N, B] tiled as w_dtype says. On CUDA by the
    per-call path's Triton packer (w4_pack_kernel.py, bit for bit w4a16_pack's; ~1 ms per gpt-oss GEMM's 128
    experts on an H200); elsewhere by w4a16_pack's torch packer, which takes about a second per gpt-oss expert
    on a CPU core: tile on the GPU."""
    kind, gate_layout = TILED_FORMATS[w_dtype]
    if codes.device.type != "cuda":
        return wp.tile_mxfp4_experts(codes, scales, kind=kind, gate_layout=gate_layout)
    from ..w4_pack_kernel import pack_slots  # Triton: imported where it runs

    def pack(lo: int, hi: int) -> torch.Tensor:
        idx = torch.arange(lo, hi, dtype=torch.int32, device=codes.device)
        rows = torch.arange(hi - lo + 1, dtype=torch.int32, device=codes.device)  # every slot in use: all packed
        return pack_slots(codes, scales, idx, rows, kind=kind, gate_layout=gate_layout)

    return wp.tile_mxfp4_experts(codes, scales, kind=kind, gate_layout=gate_layout, pack=pack, step=_TILE_STEP)


def dequantize(w: torch.Tensor, w_dtype: str, k: int) -> torch.Tensor:
    """Tiled w [E, N, B] -> float32 [E, N, K]: the mxfp4 values it holds."""
    codes, scales = untile(w, w_dtype, k)
    return formats.dequantize(codes, "mxfp4", GROUP, scales, None, None)
