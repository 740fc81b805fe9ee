"""tiles.choose_tiles: every choice is a compiled variant, swapped tiles only where an expert's
rows fit one of them in enough waves or, with a long K, where they stream the fewest weight rows on the
busiest SM, and the few-waves rule fills the last wave. Below LONG_K (SHORT_K) the rule is the one
before the split-K tile existed. interface.variants, what precompile builds, holds every kernel the
launchers can request."""
from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("cutlass")

from cute_kernels import interface, tiles  # noqa: E402
from cute_kernels.moe_gemm import Epilogue  # noqa: E402
from moe_ops.bench import SHAPES  # noqa: E402

LAYOUTS = ("concat", "interleaved", "none")
SHORT_K = 2048


def test_every_choice_is_a_variant():
    # precompile() builds tile_shapes(layout); a choice outside it would compile inside a launch.
    rng = random.Random(0)
    for _ in range(3000):
        layout = rng.choice(LAYOUTS)
        n_out = 64 * rng.randint(1, 300)
        m, k, e, sms = rng.randint(1, 20000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256)), rng.choice((78, 114, 132))
        k_dim = 64 * rng.randint(1, 200)
        tile = tiles.choose_tiles(layout, n_out, m, k, e, sms, k_dim=k_dim)
        assert tile in tiles.tile_shapes(layout), (layout, n_out, m, k, e, sms, k_dim)


def _waves(layout, n_out, m, k, e, sms, tile):
    tile_m, tile_n = tile
    active = min(e, m * k)
    return active * math.ceil(math.ceil(m * k / active) / tile_m) * math.ceil(n_out / tile_n) / sms


@pytest.mark.parametrize("name", list(SHAPES))
def test_few_waves_stream_the_fewest_rows(name):
    # At M = 1 every shape streams weights (64-row tiles) in few waves of tiles; the rule takes the
    # tile_n whose busiest SM streams the fewest weight rows (ceil(waves) x tile_n), the largest on ties.
    # With the shape's own K and with a short one (SHORT_K): at the real K some shapes take swapped or
    # split-K tiles instead, so each shape must reach the rule at one of the two (checked counts them).
    e, k, h, i = SHAPES[name]
    checked = 0
    for layout, n_out, k_dim in (("interleaved" if name.startswith("gpt-oss") else "concat", i, h), ("none", h, i)):
        for kk in (k_dim, SHORT_K):
            tile = tiles.choose_tiles(layout, n_out, 1, k, e, 132, k_dim=kk)
            if tile in (tiles.SWAP_TILE, tiles.SPLIT_K_TILE):
                continue  # test_swapped_tiles_where_rows_fit_in_enough_waves, test_split_k_tile_...
            assert tile[0] == 64
            rows = lambda n: math.ceil(_waves(layout, n_out, 1, k, e, 132, (64, n))) * n  # noqa: E731
            if _waves(layout, n_out, 1, k, e, 132, tile) < tiles.FEW_WAVES:
                fewest = min(rows(n) for n in tiles.STREAM_TILE_N[layout])
                assert rows(tile[1]) == fewest
                assert tile[1] == max(n for n in tiles.STREAM_TILE_N[layout] if rows(n) == fewest)
                checked += 1
    assert checked > 0, f"{name}: no GEMM reached the few-waves rule"


def test_measured_choices_at_one_token():
    # GEMMs alone at M = 1 on an H200 (bench/NOTES.md v9, v12), and the layer in graph (v20, v21);
    # the rule picks the faster tile here.
    assert tiles.choose_tiles("concat", 768, 1, 8, 128, 132, k_dim=2048) == (64, 96)  # qwen3: 13.9 vs 14.4 µs at 128; in graph 26.5 vs 27.9 split-K
    assert tiles.choose_tiles("none", 2048, 1, 8, 128, 132, k_dim=768) == (64, 128)  # qwen3: 7.5 vs 9.6 µs at 64
    # mixtral: 118.3 vs 127.8 at 64x128 alone (v9); in graph swapped 16x128 172.6 vs 174.4 µs (v20),
    # split-K 165.6 vs 172.3 (v21)
    assert tiles.choose_tiles("concat", 14336, 1, 2, 8, 132, k_dim=4096) == tiles.SPLIT_K_TILE
    assert tiles.choose_tiles("concat", 14336, 1, 2, 8, 132, k_dim=SHORT_K) == tiles.SWAP_TILE
    # deepseek: 117.5 vs 119.6 at 256 alone (v12); in graph split-K 164.8 vs 167.1 (v21)
    assert tiles.choose_tiles("concat", 2048, 1, 8, 256, 132, k_dim=7168) == tiles.SPLIT_K_TILE
    assert tiles.choose_tiles("concat", 2048, 1, 8, 256, 132, k_dim=SHORT_K) == (64, 128)
    # gpt-oss: 36.6 vs 41.4 µs at 128 alone (v12); in graph (concat) split-K 55.3 vs 57.0 (v21)
    assert tiles.choose_tiles("interleaved", 2880, 1, 4, 128, 132, k_dim=2880) == tiles.SPLIT_K_TILE
    assert tiles.choose_tiles("interleaved", 2880, 1, 4, 128, 132, k_dim=SHORT_K) == (64, 96)
    # gpt-oss: 25.9 vs 32.2 µs at 64 alone (v12); in graph, after a split-K GEMM1, 16x128 55.3 vs
    # 56.5 at 64x128 and 56.5 at 16x64 (v21; all three 128 rows on the busiest SM)
    assert tiles.choose_tiles("none", 2880, 1, 4, 128, 132, k_dim=2880) == tiles.SWAP_TILE
    assert tiles.choose_tiles("none", 2880, 1, 4, 128, 132, k_dim=SHORT_K) == (64, 128)


def test_streaming_tiles_pad_the_fewest_columns():
    # With 64-row tiles and waves to spare, GEMM2 takes the tile_n that pads n_out least (the
    # columns of a partial last N tile are MMAs for nothing), the largest on ties.
    rng = random.Random(1)
    checked = 0
    for _ in range(3000):
        n_out = 64 * rng.randint(1, 300)
        m, k, e = rng.randint(1, 20000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256))
        tile = tiles.choose_tiles("none", n_out, m, k, e, 132, k_dim=SHORT_K)
        fits = [n for n in tiles.TILE_N["none"] if _waves("none", n_out, m, k, e, 132, (64, n)) >= 2]
        if tile[0] != 64 or _waves("none", n_out, m, k, e, 132, tile) < tiles.FEW_WAVES or not fits:
            continue
        padded = lambda n: math.ceil(n_out / n) * n  # noqa: E731
        least = min(padded(n) for n in fits)
        assert padded(tile[1]) == least and tile[1] == max(n for n in fits if padded(n) == least), (n_out, m, k, e)
        checked += 1
    assert checked > 100


def test_measured_choices_at_1024_tokens():
    # The compiled layer with each tile forced, CUDA graphs replayed in interleaved rounds in one
    # process on an H200 (bench/NOTES.md v14): the rule keeps the fastest measured here.
    assert tiles.choose_tiles("none", 2880, 1024, 4, 128, 132, k_dim=2880) == (64, 64)  # gpt-oss: 1563 vs 1602 µs at 256
    assert tiles.choose_tiles("none", 4096, 1024, 2, 8, 132, k_dim=14336) == (128, 128)  # mixtral: 1530 vs 1593 at 64x256
    assert tiles.choose_tiles("none", 7168, 1024, 8, 256, 132, k_dim=2048) == (64, 256)  # deepseek: 5492 vs 5472 at 128 (noise)


def _draw(rng):
    """A random (layout, n_out, m, k, e) around the swapped tiles' range, and the rows per expert."""
    layout = rng.choice(LAYOUTS)
    n_out = 64 * rng.randint(1, 300)
    m, k, e = rng.randint(1, 3000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256))
    return layout, n_out, m, k, e, math.ceil(m * k / min(e, m * k))


def _swap_tiles(layout, n_out, m, k, e):
    active = min(e, m * k)
    return active * math.ceil(math.ceil(m * k / active) / 16) * math.ceil(n_out / (64 if layout == "concat" else 128))


def test_swapped_tiles_where_rows_fit_in_enough_waves():
    # SWAP_TILE exactly where an expert averages <= 16 rows and its tiles fill FEW_WAVES waves, never
    # for interleaved gates (the kernel refuses them).
    rng = random.Random(2)
    swapped = 0
    for _ in range(3000):
        layout, n_out, m, k, e, rows = _draw(rng)
        want = layout != "interleaved" and rows <= 16 and _swap_tiles(layout, n_out, m, k, e) >= tiles.FEW_WAVES * 132
        assert (tiles.choose_tiles(layout, n_out, m, k, e, 132, k_dim=SHORT_K) == tiles.SWAP_TILE) == want, (layout, n_out, m, k, e)
        swapped += want
    assert swapped > 100


def test_measured_swapped_choices():
    # The compiled layer with tiles forced, in graph, interleaved rounds in one process on an H200
    # (bench/NOTES.md v20): µs per call with the tiles before v20, and with both GEMMs swapped.
    measured = {
        ("qwen3-30b-a3b", 16): (191.8, 186.8), ("deepseek-v3", 16): (2020.9, 1981.7), ("gpt-oss-120b", 16): (589.5, 580.9),
        ("qwen3-30b-a3b", 128): (287.2, 284.5), ("deepseek-v3", 128): (5057.3, 4973.3), ("gpt-oss-120b", 128): (1441.7, 1393.1),
    }  # fmt: skip
    for name, m in measured:
        e, k, h, i = SHAPES[name]
        assert tiles.choose_tiles("concat", i, m, k, e, 132, k_dim=h)[0] == 16, name
        assert tiles.choose_tiles("none", h, m, k, e, 132, k_dim=i)[0] == 16, name
    # Not swapped: mixtral M=128 (32 rows per expert, two token tiles re-read the weights: 675 -> 833),
    # qwen3 at M = 1 (one wave of wide tiles: 26.7 -> 27.7; split-K 192 tiles: 26.5 -> 27.9, v21).
    assert tiles.choose_tiles("concat", 14336, 128, 2, 8, 132, k_dim=4096)[0] == 64
    assert tiles.choose_tiles("concat", 768, 1, 8, 128, 132, k_dim=2048)[0] == 64
    assert tiles.choose_tiles("none", 2048, 1, 8, 128, 132, k_dim=768)[0] == 64


def _busiest(layout, n_out, m, k, e, tile):
    # Tiles per SM rounded up, times the tile's weight rows; a gated tile of n rows makes n / 2 columns.
    active = min(e, m * k)
    cols = tile[1] // (1 if layout == "none" else 2)
    return math.ceil(active * math.ceil(math.ceil(m * k / active) / tile[0]) * math.ceil(n_out / cols) / 132) * tile[1]


def test_long_k_swapped_tiles_stream_the_fewest_rows():
    # With <= 16 rows per expert and K >= LONG_K: of the split-K tile, the 128-row swapped tile (not
    # for interleaved gates) and the short-K rule's tile, the one whose busiest SM streams the fewest
    # weight rows; ties to split-K, then 16x128, for the gated GEMM1, to 16x128, then the short-K
    # tile, for GEMM2.
    rng = random.Random(3)
    split = 0
    for _ in range(3000):
        layout, n_out, m, k, e, rows = _draw(rng)
        k_dim = rng.choice((SHORT_K, tiles.LONG_K, 2880, 7168))
        short = tiles.choose_tiles(layout, n_out, m, k, e, 132, k_dim=SHORT_K)
        got = tiles.choose_tiles(layout, n_out, m, k, e, 132, k_dim=k_dim)
        if rows > 16 or k_dim < tiles.LONG_K:
            assert got == short, (layout, n_out, m, k, e, k_dim)
            continue
        swap, fine = tiles.SWAP_TILE, tiles.SPLIT_K_TILE
        order = [fine, swap, short] if layout != "none" else [swap, short, fine]
        if layout == "interleaved":
            order.remove(swap)
        best = min(_busiest(layout, n_out, m, k, e, t) for t in order)
        assert got == next(t for t in order if _busiest(layout, n_out, m, k, e, t) == best), (layout, n_out, m, k, e, k_dim)
        split += got == fine
    assert split > 100


def test_measured_split_k_choices():
    # The layer in graph with tiles forced (bench/NOTES.md v21), µs per call, rule before v21 ->
    # split-K: gpt-oss M=16 GEMM1 and GEMM2 564.7 -> 560.5; deepseek M=16 GEMM1 1958.0 -> 1948.4, M=1
    # GEMM1 167.1 -> 164.8; at M = 128 within 0.3% (gpt-oss 1392.4 -> 1392.0, deepseek 4964.6 -> 4961.2).
    assert tiles.choose_tiles("concat", 2880, 16, 4, 128, 132, k_dim=2880) == tiles.SPLIT_K_TILE
    assert tiles.choose_tiles("none", 2880, 16, 4, 128, 132, k_dim=2880) == tiles.SPLIT_K_TILE
    assert tiles.choose_tiles("concat", 2048, 16, 8, 256, 132, k_dim=7168) == tiles.SPLIT_K_TILE
    # Not split: short K (qwen3 M=16 183.0 -> 184.1 and 184.2; deepseek GEMM2, K 2048, M=16 1958.0 -> 1959.9).
    assert tiles.choose_tiles("concat", 768, 16, 8, 128, 132, k_dim=2048) == tiles.SWAP_TILE
    assert tiles.choose_tiles("none", 2048, 16, 8, 128, 132, k_dim=768) == tiles.SWAP_TILE
    assert tiles.choose_tiles("none", 7168, 16, 8, 256, 132, k_dim=2048) == tiles.SWAP_TILE


def test_swapped_tiles_from_exactly_few_waves():
    # Docstring: SWAP_TILE while an expert averages at most SWAP_ROWS rows and its tiles "fill at least
    # FEW_WAVES waves". Here 16 rows per expert (M = 16, k = 8, E = 8) and concat's 64 output columns
    # per swapped tile: n_out 2112 gives 8 x 33 = 264 tiles, exactly 2 waves on 132 SMs (swapped);
    # 2048 gives 256, under 2 waves (the 64-row tiles).
    assert 8 * math.ceil(2112 / 64) == tiles.FEW_WAVES * 132
    assert tiles.choose_tiles("concat", 2112, 16, 8, 8, 132, k_dim=SHORT_K) == tiles.SWAP_TILE
    assert tiles.choose_tiles("concat", 2048, 16, 8, 8, 132, k_dim=SHORT_K) == (64, 128)


def test_full_tiles_from_exactly_64_rows_per_expert():
    # Docstring: tile_m 64 "while an expert averages fewer than 64 rows (M*k/E < 64)", and the gated
    # GEMM1's tile_n 256 "from 64 rows per expert on". At exactly 64 rows (M*k = 512, E = 8) both
    # rules have switched: 128 x 256; one pair fewer still streams (64-row tiles; few waves, so 96).
    assert tiles.choose_tiles("concat", 64, 512, 1, 8, 132, k_dim=SHORT_K) == (128, 256)
    assert tiles.choose_tiles("concat", 64, 511, 1, 8, 132, k_dim=SHORT_K) == (64, 96)


def test_tile_n_that_gives_exactly_two_waves_fits():
    # Docstring: "the largest tile_n that still gives every SM two tiles", i.e. waves >= 2. With 8
    # experts of 64 rows in 64-row tiles (M*k = 511, just under 64 per expert), n_out 4224 = 33 x 128
    # makes 8 x 33 = 264 tiles of 128 columns, exactly two per SM on 132: 128 fits (and pads nothing,
    # like 64). At n_out 4096 (32 x 128, 256 tiles) only 64 gives two waves.
    assert 8 * (4224 // 128) == 2 * 132
    assert tiles.choose_tiles("none", 4224, 511, 1, 8, 132, k_dim=SHORT_K) == (64, 128)
    assert tiles.choose_tiles("none", 4096, 511, 1, 8, 132, k_dim=SHORT_K) == (64, 64)


@pytest.mark.parametrize("bias", [None, torch.float32])
def test_variants_cover_every_request(bias):
    # precompile() compiles variants(), and test_compile checks each one's code: every kernel gate_up
    # and down_reduce can ask for must be there (else it compiles inside a launch, unchecked). That is
    # each activation with each gate layout gate_up_support accepts, gathered, with every tile of that
    # layout; and GEMM2 with every "none" tile, with and without early weights.
    dtype = torch.bfloat16
    got = interface.variants(dtype, bias_dtypes=(bias,))
    assert len(got) == len(set(got))
    want = set()
    for act in interface.ACTIVATIONS:
        for layout in LAYOUTS:
            ok, _ = interface.gate_up_support(
                dtype=dtype, weight_dtype=dtype, activation=act, gate_layout=layout, has_bias=bias is not None,
                hidden=128, intermediate=128, num_experts=8,
            )  # fmt: skip
            if ok:
                epi = Epilogue(act, layout, has_bias=bias is not None)
                want |= {(epi, True, bias or dtype, *tile, False) for tile in tiles.tile_shapes(layout)}
    gemm2 = Epilogue("none", "none", has_bias=bias is not None)
    want |= {(gemm2, False, bias or dtype, *tile, early) for tile in tiles.tile_shapes("none") for early in (True, False)}
    assert {v[0].gate_layout for v in want} == set(LAYOUTS)
    assert not want - set(got), sorted(map(str, want - set(got)))
    assert not set(got) - want, sorted(map(str, set(got) - want))


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_launchers_choose_tiles_for_their_own_k(monkeypatch, op):
    """The launchers ask choose_tiles about the GEMM they run: GEMM1 reads K = H (its N is I), GEMM2
    reads K = I (its N is H). With the two swapped a long-K split tile is picked for a short K (or
    missed for a long one): no wrong number, a slower kernel that no other CPU test sees. The GPU
    calls are stubbed: device checks pass, nothing compiles or launches."""
    e, k, m, hidden, inter = 8, 2, 4, 4096, 256
    asked = []
    real = interface.choose_tiles

    def recording(*args, **kwargs):
        asked.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(interface, "choose_tiles", recording)
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "stubbed"))
    monkeypatch.setattr(interface, "num_sms", lambda index: 132)
    monkeypatch.setattr(interface, "_gemm", lambda *args, **kwargs: None)
    monkeypatch.setattr(interface, "_launch_gemm", lambda *args, **kwargs: None)
    monkeypatch.setattr(interface, "_token_sum", lambda dtype: None)
    monkeypatch.setattr(interface, "_ptr", lambda t: None)
    monkeypatch.setattr(interface, "_launch", lambda *args: None)
    bf16 = torch.bfloat16
    offsets = torch.tensor([0, m * k] + [m * k] * (e - 1), dtype=torch.int32)
    if op == "gate_up":
        interface.gate_up(torch.randn(m, hidden, dtype=bf16), torch.randn(e, 2 * inter, hidden, dtype=bf16), None, offsets,
                          torch.arange(m * k, dtype=torch.int32) // k, activation="silu", alpha=1.702, limit=7.0,
                          gate_layout="concat")  # fmt: skip
        n_out, k_dim = inter, hidden
    else:
        interface.down_reduce(torch.randn(m * k, inter, dtype=bf16), torch.randn(e, hidden, inter, dtype=bf16), None, offsets,
                              torch.rand(m, k), torch.arange(m * k, dtype=torch.int32))  # fmt: skip
        n_out, k_dim = hidden, inter
    ((args, kwargs),) = asked
    assert args[1] == n_out and kwargs == {"k_dim": k_dim}
