"""Tile shapes of the CuTe DSL kernels: the host-side rules that pick, from the layer's sizes alone (no data
read, no sync), the (tile_m, tile_n) of each bf16 and fp8 grouped GEMM and the m-tile of the w4a16 GEMM, and
the sets of tiles each variant can take (which CI compiles). The numbers behind each rule are in
bench/NOTES.md; bench/tile_sweep.py and bench/tile_ab.py measure them. interface.py launches with them."""
from __future__ import annotations

import functools
import math

# B rows per tile the kernel may use, by gate layout, largest first (see choose_tiles).
TILE_N = {"concat": (256, 128), "interleaved": (256, 128), "none": (256, 128, 64)}
# B rows per 64-row tile: the rule's choices and, when few waves of tiles leave the last one
# part-empty, the alternatives (see choose_tiles).
# 96 only for the gated layouts: their epilogue masks any column; GEMM2's staged stores need n_out
# to be split into 32-column chunks.
STREAM_TILE_N = {"concat": (256, 128, 96), "interleaved": (256, 128, 96), "none": (256, 128, 64)}
FEW_WAVES = 2
# Swapped operands (weights on WGMMA's M side, 16 tokens on its N side; MoeGemmSm90 with tile_m 16):
# its one tile per layout, and the layouts it serves (interleaved gate/up pairs would sit in different
# threads' accumulators).
SWAP_TILE = (16, 128)
SWAP_LAYOUTS = ("concat", "none")
SWAP_ROWS = 16
# Swapped with 64 weight rows (32 output columns with a gate), the consumer warpgroups splitting K:
# every layout. From K = LONG_K on, the swapped tiles are chosen by the weight rows the busiest SM
# streams (see choose_tiles).
SPLIT_K_TILE = (16, 64)
LONG_K = 2560


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0 (host ints)."""
    return -(-a // b)


def _rows_per_expert(pairs: int, num_experts: int) -> tuple[int, int]:
    """(experts with rows, rows each, rounded up) for `pairs` routed pairs spread evenly over
    num_experts (at least one expert, so the tile rules stay defined at M = 0)."""
    active = max(1, min(num_experts, pairs))
    return active, cdiv(pairs, active)


# Pure and called per launch: an eager call's host time counts at small M (bench/NOTES.md v38). Bounded,
# since M takes many values under dynamic shapes.
@functools.lru_cache(maxsize=4096)
def choose_tiles(gate_layout: str, n_out: int, m: int, k: int, num_experts: int, sms: int, *, k_dim: int) -> tuple[int, int]:
    """(tile_m, tile_n) for M tokens routed to k of E experts (assumed spread evenly; a host-side
    shape rule, no data read), from bench/tile_sweep.py on an H200 (bench/NOTES.md, v2 and v3):
    - tile_m 64 while an expert averages fewer than 64 rows (M*k/E < 64): weight streaming, where a
      smaller A tile leaves room for more stages (above ~6 stages the depth stops mattering; v9);
    - gated GEMM1: tile_n 256 from 64 rows per expert on (each gathered A tile then feeds more
      columns), else 128 (more tiles to spread few rows' weight streaming over the SMs);
    - otherwise the largest tile_n that still gives every SM two tiles: one wave leaves SMs idle
      behind ragged experts, more small tiles re-read A; with 64-row tiles, among those the one
      that pads n_out least (gpt-oss GEMM2 at M = 1024: 64 instead of 256, 1602 -> 1563 µs for the
      layer in interleaved CUDA-graph replays, v14);
    - then, while streaming (tile_m 64) in fewer than FEW_WAVES waves: the STREAM_TILE_N option with
      the least ceil(waves) x tile_n (the rows the busiest SM streams: an unfilled last wave is lost
      time), the largest tile_n on ties (each tile adds a pipeline ramp and an epilogue).
    "waves" is m_tiles x ceil(n_out / tile_n) / sms. For GEMM2 that is the kernel's tile count per
    SM; for the gated GEMM1, whose tiles make tile_n / 2 output columns, it is half of it, and the
    choices were measured against that count (GEMM1 and GEMM2 alone at M = 1 on an H200: kernel
    durations, bench/NOTES.md v12, gpt-oss GEMM1 tile_n 128 -> 96, 41.4 -> 36.6 µs, qwen3 GEMM2
    64 -> 128, 9.6 -> 7.5; CUDA-graph replays, v9, mixtral GEMM1 128 -> 256, 127.8 -> 118.3).
    Before all that: SWAP_TILE (weights as WGMMA's M, 16 tokens as its N) while an expert averages at
    most SWAP_ROWS rows and its tiles (kernel tiles, 64 output columns each for the gated layouts,
    128 otherwise) fill at least FEW_WAVES waves; not for interleaved gates (bench/NOTES.md v20: a
    64-row tile re-reads its mostly empty A tile from shared memory in every WGMMA, which caps what
    one CTA streams; with fewer tiles than that the finer 64-row tiles win).
    Last, while an expert averages at most SWAP_ROWS rows and the GEMM's K (k_dim: hidden for GEMM1,
    intermediate for GEMM2) is at least LONG_K: of SPLIT_K_TILE (swapped, 64 weight rows, the
    warpgroups splitting K), SWAP_TILE (whatever its waves) and the tile chosen so far, the one whose
    busiest SM streams the fewest weight rows (_busiest_rows). Measured in graph on H200s
    (bench/NOTES.md v21): split-K GEMM1 at gpt-oss M=1 57.0 -> 55.3 µs and 56.8 -> 56.2 (two
    machines), mixtral M=1 172.3 -> 165.6, deepseek M=1 167.1 -> 164.8; GEMM2 16x128 at gpt-oss M=1
    56.5 -> 55.3 (after the split-K GEMM1, which frees SMs later, GEMM2's 64-row tiles, one per CTA
    and MMA-capped, are what the call waits on). With a shorter K (qwen3: 2048 and 768) the swapped
    tiles were slower at M = 1 and 16 (per-tile costs over fewer k-tiles)."""
    tile = _short_k_tiles(gate_layout, n_out, m, k, num_experts, sms)
    pairs = m * k
    if _rows_per_expert(pairs, num_experts)[1] > SWAP_ROWS or k_dim < LONG_K:
        return tile
    # Ties go to the tile measured faster at equal rows: split-K for the gated GEMM1, the 128-row
    # swapped tile for GEMM2 (bench/NOTES.md v21).
    order = (SPLIT_K_TILE, SWAP_TILE, tile) if gate_layout != "none" else (SWAP_TILE, tile, SPLIT_K_TILE)
    allowed = [t for t in order if t in tile_shapes(gate_layout)]
    return min(allowed, key=lambda t: (_busiest_rows(t, gate_layout, n_out, m, k, num_experts, sms), order.index(t)))


def _busiest_rows(tile: tuple[int, int], gate_layout: str, n_out: int, m: int, k: int, num_experts: int, sms: int) -> int:
    """Weight rows the busiest SM streams with `tile` (experts assumed evenly loaded): tiles per SM,
    rounded up, times the tile's weight rows (a gated tile's rows make half as many output columns)."""
    pairs = m * k
    active, rows = _rows_per_expert(pairs, num_experts)
    tile_m, tile_n = tile
    out_cols = tile_n // (1 if gate_layout == "none" else 2)
    tiles = active * cdiv(rows, tile_m) * cdiv(n_out, out_cols)
    return cdiv(tiles, sms) * tile_n


def _short_k_tiles(gate_layout: str, n_out: int, m: int, k: int, num_experts: int, sms: int) -> tuple[int, int]:
    """choose_tiles' choice where K < LONG_K or an expert averages more than SWAP_ROWS rows."""
    pairs = m * k
    active, rows = _rows_per_expert(pairs, num_experts)
    if gate_layout in SWAP_LAYOUTS and rows <= SWAP_ROWS:
        # Output columns per swapped tile: tile_n weight rows, half of them up rows with [gate; up].
        swap_cols = SWAP_TILE[1] // (2 if gate_layout == "concat" else 1)
        tiles = active * cdiv(rows, SWAP_TILE[0]) * cdiv(n_out, swap_cols)
        if tiles >= FEW_WAVES * sms:
            return SWAP_TILE
    tile_m = 64 if pairs < 64 * num_experts else 128
    m_tiles = active * cdiv(rows, tile_m)
    waves = lambda tile_n: m_tiles * cdiv(n_out, tile_n) / sms  # noqa: E731
    if gate_layout != "none":
        tile_n = 256 if pairs >= 64 * num_experts else 128
    else:
        fits = [n for n in TILE_N[gate_layout] if waves(n) >= 2] or [TILE_N[gate_layout][-1]]
        tile_n = fits[0]
        if tile_m == 64:
            # Each weight column meets about one 64-row tile, so the columns a last partial N tile
            # pads (gpt-oss: 2880 = 11.25 x 256) are MMAs for nothing (bench/NOTES.md, v14).
            tile_n = min(fits, key=lambda n: (cdiv(n_out, n) * n, -n))
    if tile_m == 64 and waves(tile_n) < FEW_WAVES:
        tile_n = min(STREAM_TILE_N[gate_layout], key=lambda n: (math.ceil(waves(n)) * n, -n))
    return tile_m, tile_n


def fp8_tile_shapes(gate_layout: str) -> list[tuple[int, int]]:
    """The (tile_m, tile_n) the fp8 kernels take for a layout: tile_shapes' but the 128-row tiles of more
    than 128 B rows (promotion's temporaries double the accumulators: MoeGemmSm90)."""
    return [t for t in tile_shapes(gate_layout) if not (t[0] == 128 and t[1] > 128)]


# choose_tiles' choice -> the fp8 kernels', keyed on (gated GEMM1, choice), from bench/tile_sweep.py
# --fp8 on an H200 (the GEMM alone in a CUDA graph, µs) and checked on whole layers against plain
# narrowing to 128 x 128 (bench/fp8_rule_ab.py: M = 1024 2-8% faster, M = 8192 -4% to +1%; NOTES v49).
FP8_TILES = {
    # 128 x 256 is not taken. Gated GEMM1: 64 x 256 (mixtral M = 1024 523 against 128 x 128's 556,
    # qwen3 127 against 133); GEMM2: 128 x 128 (mixtral M = 1024 259 against 64 x 256's 300).
    (True, (128, 256)): (64, 256),
    (False, (128, 256)): (128, 128),
}
# GEMM2's 64 x 64 tiles, chosen for bf16 to pad n_out least, with more than SWAP_ROWS rows per expert:
# 64 x 128 (gpt-oss M = 1024 315 against 376, mixtral M = 128 120 against 128). With fewer rows 64 x 64
# stays (mixtral M = 1: 39 against 45).
FP8_WIDE_GEMM2 = {(64, 64): (64, 128)}


def choose_fp8_tiles(gate_layout: str, n_out: int, m: int, k: int, num_experts: int, sms: int, *, k_dim: int) -> tuple[int, int]:
    """choose_tiles for the fp8 kernels (one of fp8_tile_shapes): its choice where the fp8 kernels take
    it and measured no slower, else FP8_TILES' or FP8_WIDE_GEMM2's."""
    tiles = choose_tiles(gate_layout, n_out, m, k, num_experts, sms, k_dim=k_dim)
    tiles = FP8_TILES.get((gate_layout != "none", tiles), tiles)
    if gate_layout == "none" and _rows_per_expert(m * k, num_experts)[1] > SWAP_ROWS:
        tiles = FP8_WIDE_GEMM2.get(tiles, tiles)
    return tiles


def tile_shapes(gate_layout: str) -> list[tuple[int, int]]:
    """The (tile_m, tile_n) choose_tiles can return for a layout."""
    swapped = ([SWAP_TILE] if gate_layout in SWAP_LAYOUTS else []) + [SPLIT_K_TILE]
    return [(128, n) for n in TILE_N[gate_layout]] + [(64, n) for n in STREAM_TILE_N[gate_layout]] + swapped


# w4a16 (w4a16_grouped.py): where GEMM1 gathers, and the m-tile.

# GEMM1 gathers its rows in the kernel (cp.async) while P <= W4A16_GATHER_ROWS_PER_EXPERT * E; above, a torch
# index_select writes the grouped rows and the kernel reads them by TMA. gpt-oss's layer on an H200 (bench/NOTES.md
# v58): in the kernel 51.9 -> 50.1 µs at M = 1 (P = 4), 294 -> 277 at M = 16 (P = 64); but 671 -> 702 at M = 128
# (P = 512) and 4.7-5.7% slower at M = 1024 and 4096, where the cp.async rows cost more than the copy they save.
W4A16_GATHER_ROWS_PER_EXPERT = 1


def w4a16_gathers_in_kernel(p: int, num_experts: int) -> bool:
    """Whether GEMM1 gathers its P rows in the kernel (host ints: no sync); see W4A16_GATHER_ROWS_PER_EXPERT."""
    return p <= W4A16_GATHER_ROWS_PER_EXPERT * max(1, num_experts)


# Rows per expert (P / E) from which each m-tile is the fastest, largest first. At gpt-oss's shapes on an H200
# (bench/NOTES.md v57): 16-row tiles 15-17% faster than 32 at 8 rows per expert, 32-row 17-20% faster at 16 and
# 1.4x at 32; 64-row 4% faster than 32 at 32 rows per expert, 1.2x at 64 and 1.27x at 128, 30% slower at 16;
# 128-row (v59) 4% slower than 64 at 64 rows per expert, 1.16-1.18x faster at 72 and 1.26-1.53x at 80-96 (one
# m-tile where 64-row tiles take two), 1.08x at 128 and 1.13-1.18x at 256.
W4A16_TOK_FROM_ROWS = ((128, 68), (64, 32), (32, 12))




def choose_w4a16_tok(p: int, num_experts: int) -> int:
    """The w4a16 kernel's m-tile for P grouped rows over E experts (host ints: no sync): the largest of
    W4A16_TOK_FROM_ROWS whose rows per expert the average P / E reaches (the decode is paid once per m-tile), else 16."""
    for tok, rows in W4A16_TOK_FROM_ROWS:
        if p >= rows * max(1, num_experts):
            return tok
    return 16
