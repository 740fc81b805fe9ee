"""mxfp4 experts re-laid for the w4a16 kernels in one Triton launch, for the expert slots in use (w4_kernels.py).

    pack_slots(codes [E, N, K/2], scales [E, N, K/32], idx [S], slot_offsets [S + 1], kind, gate_layout)
        -> int32 [S, tiles, k_tiles, WORDS]

Slot s holds expert idx[s]'s chunks exactly as cute_kernels.w4a16_pack.pack_mxfp4_experts lays them out (bit for
bit); a slot without rows (slot_offsets[s + 1] == slot_offsets[s]) is left unwritten, as the kernels read no
weight of it (off CUDA, outside Triton's interpreter, torch packs every slot). One program per (slot, tile, k-tile) chunk: each of its 2048 code words gathers its 8 codes from 4
bytes of one weight row (K columns k0 + 8i and k0 + 8i + 1 sit in byte k0 / 2 + 4i) and places their bits where
w4a16_pack.SOURCE_BITS says; its 128 scale words take a row's 4 scales of the k-tile. Rows past N (the row map's
-1) and K past the weights are zero codes with scale 0. The kernel computes each tile row's weight row (_weight_row,
w4a16_pack.row_map's rule) rather than reading a row-map tensor: such a tensor would have to be uploaded or built per
call, and an upload inside a CUDA graph capture fails.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cute_kernels import w4a16_pack as wp

from .plan_kernel import on_device


@triton.jit
def _place(code, i: tl.constexpr, j: tl.constexpr):
    """e2m1 code (uint32, 0..15) of output i, half j -> its bits in the word: the sign (bit 3) at 15 + 16 j -
    SIGN_SHIFT[i], and (E1, E0, M), three adjacent bits, ending at 6 + 16 j - MAG_SHIFT[i] (MAG_SHIFT = 0, 3, 6,
    -3; SIGN_SHIFT = i). Two shifts of masked codes."""
    mag_shift: tl.constexpr = 3 * i - 12 * (i // 3)
    return ((code & 8) << (12 + 16 * j - i)) | ((code & 7) << (6 + 16 * j - mag_shift))


@triton.jit
def _weight_row(tile, tile_row, n, GATE_UP: tl.constexpr, CONCAT: tl.constexpr):
    """w4a16_pack.row_map[tile, tile_row]: "rows" tiles hold 128 consecutive rows; a "gate_up" tile holds 64
    intermediate columns c, their gate rows then their up rows (c and I + c concatenated, 2c and 2c + 1
    interleaved). -1 past the weights."""
    if GATE_UP:
        inter = n // 2
        c = tile * 64 + tile_row % 64
        up = tile_row // 64
        if CONCAT:
            row = c + up * inter
        else:
            row = 2 * c + up
        return tl.where(c < inter, row, -1)
    else:
        row = tile * 128 + tile_row
        return tl.where(row < n, row, -1)


@triton.jit
def _pack_chunk(
    codes, scales, idx, slot_offsets, out, n, k_bytes, k_groups, tiles, k_tiles,
    CODE_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr, WORDS: tl.constexpr,
    GATE_UP: tl.constexpr, CONCAT: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    chunk = tl.program_id(1)  # tile * k_tiles + k-tile
    if tl.load(slot_offsets + slot + 1) > tl.load(slot_offsets + slot):
        expert = tl.load(idx + slot).to(tl.int64)
        tile = chunk // k_tiles
        kt = chunk - tile * k_tiles
        dst = out + (slot.to(tl.int64) * tiles * k_tiles + chunk) * WORDS
        # code word w = (((warpgroup * 4 + warp) * 2 + h) * 32 + lane) * 4 + group
        w = tl.arange(0, CODE_WORDS)
        group = w % 4
        lane = (w // 4) % 32
        tile_row = 64 * (w // 1024) + 16 * ((w // 256) % 4) + lane // 4 + 8 * ((w // 128) % 2)
        row = _weight_row(tile, tile_row, n, GATE_UP, CONCAT)
        byte0 = kt * 64 + group * 16 + lane % 4
        base = codes + (expert * n + row.to(tl.int64)) * k_bytes
        word = tl.zeros((CODE_WORDS,), dtype=tl.uint32)
        for i in tl.static_range(4):
            ok = (row >= 0) & (byte0 + 4 * i < k_bytes)
            b = tl.load(base + byte0 + 4 * i, mask=ok, other=0).to(tl.uint32)
            word |= _place(b & 15, i, 0)
            word |= _place(b >> 4, i, 1)
        tl.store(dst + w, word.to(tl.int32, bitcast=True))
        # scale word v = (16-row group * 2 + h) * 8 + r: tile row 16 * group + r + 8 h; byte b = group b of the k-tile
        v = tl.arange(0, SCALE_WORDS)
        srow = _weight_row(tile, 16 * (v // 16) + v % 8 + 8 * ((v // 8) % 2), n, GATE_UP, CONCAT)
        sbase = scales + (expert * n + srow.to(tl.int64)) * k_groups
        sword = tl.zeros((SCALE_WORDS,), dtype=tl.uint32)
        for b in tl.static_range(4):
            col = kt * 4 + b
            s = tl.load(sbase + col, mask=(srow >= 0) & (v * 0 + col < k_groups), other=0).to(tl.uint32)
            sword |= s << (8 * b)
        tl.store(dst + CODE_WORDS + v, sword.to(tl.int32, bitcast=True))


def pack_slots(codes: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor, slot_offsets: torch.Tensor, *, kind: str,
               gate_layout: str | None = None) -> torch.Tensor:  # fmt: skip
    """See the module docstring. codes, scales: uint8 mxfp4 experts; idx int32 [S], slot_offsets int32 [S + 1]
    (expert_slots.py). Returns int32 [S, tiles, k_tiles, WORDS]; slots without rows unwritten."""
    e, n, k = wp.check_experts(codes, scales, kind, gate_layout)
    if codes.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        # Off CUDA (the tests' stand-in kernels) torch packs every slot, as expert_slots computes there.
        return wp.pack_mxfp4_experts(codes[idx.long()], scales[idx.long()], kind=kind, gate_layout=gate_layout)
    slots = idx.shape[0]
    k_tiles = -(-k // wp.KT)
    tiles = wp.tiles_of(kind, n)
    out = torch.empty((slots, tiles, k_tiles, wp.WORDS), dtype=torch.int32, device=codes.device)
    if slots == 0:
        return out
    # ~2 TB/s moved (H200) whatever the launch: 4 or 8 warps, 1 to 23 k-tiles per program (bench/NOTES.md v55)
    with on_device(codes.device):
        _pack_chunk[(slots, tiles * k_tiles)](
            codes, scales, idx, slot_offsets, out, n, k // 2, k // wp.GROUP, tiles, k_tiles,
            CODE_WORDS=wp.CODE_WORDS, SCALE_WORDS=wp.SCALE_WORDS, WORDS=wp.WORDS,
            GATE_UP=kind == "gate_up", CONCAT=gate_layout == "concat", num_warps=4,
        )  # fmt: skip
    return out
