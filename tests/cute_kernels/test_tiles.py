"""interface.choose_tiles: every choice is a compiled variant, swapped tiles only where an expert's
rows fit one of them in enough waves, and the few-waves rule fills the last wave."""
from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("cutlass")

from cute_kernels import interface  # noqa: E402
from moe_ops.bench import SHAPES  # noqa: E402

LAYOUTS = ("concat", "interleaved", "none")


def test_every_choice_is_a_variant():
    # precompile() builds tile_shapes(layout); a choice outside it would compile inside a launch.
    rng = random.Random(0)
    for _ in range(3000):
        layout = rng.choice(LAYOUTS)
        n_out = 64 * rng.randint(1, 300)
        m, k, e, sms = rng.randint(1, 20000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256)), rng.choice((78, 114, 132))
        assert interface.choose_tiles(layout, n_out, m, k, e, sms) in interface.tile_shapes(layout), (layout, n_out, m, k, e, sms)


def _waves(layout, n_out, m, k, e, sms, tile):
    tile_m, tile_n = tile
    active = min(e, m * k)
    return active * math.ceil(math.ceil(m * k / active) / tile_m) * math.ceil(n_out / tile_n) / sms


@pytest.mark.parametrize("name", list(SHAPES))
def test_few_waves_stream_the_fewest_rows(name):
    # At M = 1 every shape streams weights (64-row tiles) in few waves of tiles; the rule takes the
    # tile_n whose busiest SM streams the fewest weight rows (ceil(waves) x tile_n), the largest on ties.
    e, k, h, i = SHAPES[name]
    for layout, n_out in (("interleaved" if name.startswith("gpt-oss") else "concat", i), ("none", h)):
        tile = interface.choose_tiles(layout, n_out, 1, k, e, 132)
        if tile == interface.SWAP_TILE:
            continue  # test_swapped_tiles_where_rows_fit_in_enough_waves
        assert tile[0] == 64
        rows = lambda n: math.ceil(_waves(layout, n_out, 1, k, e, 132, (64, n))) * n  # noqa: E731
        if _waves(layout, n_out, 1, k, e, 132, tile) < interface.FEW_WAVES:
            fewest = min(rows(n) for n in interface.STREAM_TILE_N[layout])
            assert rows(tile[1]) == fewest
            assert tile[1] == max(n for n in interface.STREAM_TILE_N[layout] if rows(n) == fewest)


def test_measured_choices_at_one_token():
    # GEMMs alone at M = 1 on an H200 (bench/NOTES.md v9, v12); the rule picks the faster tile here.
    assert interface.choose_tiles("concat", 768, 1, 8, 128, 132) == (64, 96)  # qwen3: 13.9 vs 14.4 µs at 128
    assert interface.choose_tiles("none", 2048, 1, 8, 128, 132) == (64, 128)  # qwen3: 7.5 vs 9.6 µs at 64
    # mixtral: 118.3 vs 127.8 at 64x128 alone (v9); swapped 16x128, in graph, 172.6 vs 174.4 µs (v20)
    assert interface.choose_tiles("concat", 14336, 1, 2, 8, 132) == (16, 128)
    assert interface.choose_tiles("concat", 2048, 1, 8, 256, 132) == (64, 128)  # deepseek: 117.5 vs 119.6 at 256
    assert interface.choose_tiles("interleaved", 2880, 1, 4, 128, 132) == (64, 96)  # gpt-oss: 36.6 vs 41.4 µs at 128
    assert interface.choose_tiles("none", 2880, 1, 4, 128, 132) == (64, 128)  # gpt-oss: 25.9 vs 32.2 µs at 64


def test_streaming_tiles_pad_the_fewest_columns():
    # With 64-row tiles and waves to spare, GEMM2 takes the tile_n that pads n_out least (the
    # columns of a partial last N tile are MMAs for nothing), the largest on ties.
    rng = random.Random(1)
    checked = 0
    for _ in range(3000):
        n_out = 64 * rng.randint(1, 300)
        m, k, e = rng.randint(1, 20000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256))
        tile = interface.choose_tiles("none", n_out, m, k, e, 132)
        fits = [n for n in interface.TILE_N["none"] if _waves("none", n_out, m, k, e, 132, (64, n)) >= 2]
        if tile[0] != 64 or _waves("none", n_out, m, k, e, 132, tile) < interface.FEW_WAVES or not fits:
            continue
        padded = lambda n: math.ceil(n_out / n) * n  # noqa: E731
        least = min(padded(n) for n in fits)
        assert padded(tile[1]) == least and tile[1] == max(n for n in fits if padded(n) == least), (n_out, m, k, e)
        checked += 1
    assert checked > 100


def test_measured_choices_at_1024_tokens():
    # The compiled layer with each tile forced, CUDA graphs replayed in interleaved rounds in one
    # process on an H200 (bench/NOTES.md v14): the rule keeps the fastest measured here.
    assert interface.choose_tiles("none", 2880, 1024, 4, 128, 132) == (64, 64)  # gpt-oss: 1563 vs 1602 µs at 256
    assert interface.choose_tiles("none", 4096, 1024, 2, 8, 132) == (128, 128)  # mixtral: 1530 vs 1593 at 64x256
    assert interface.choose_tiles("none", 7168, 1024, 8, 256, 132) == (64, 256)  # deepseek: 5492 vs 5472 at 128 (noise)


def _swap_tiles(layout, n_out, m, k, e):
    active = min(e, m * k)
    return active * math.ceil(math.ceil(m * k / active) / 16) * math.ceil(n_out / (64 if layout == "concat" else 128))


def test_swapped_tiles_where_rows_fit_in_enough_waves():
    # SWAP_TILE exactly where an expert averages <= 16 rows and its tiles fill FEW_WAVES waves, never
    # for interleaved gates (the kernel refuses them).
    rng = random.Random(2)
    swapped = 0
    for _ in range(3000):
        layout = rng.choice(LAYOUTS)
        n_out = 64 * rng.randint(1, 300)
        m, k, e = rng.randint(1, 3000), rng.randint(1, 8), rng.choice((8, 16, 64, 128, 256))
        rows = math.ceil(m * k / min(e, m * k))
        want = layout != "interleaved" and rows <= 16 and _swap_tiles(layout, n_out, m, k, e) >= interface.FEW_WAVES * 132
        assert (interface.choose_tiles(layout, n_out, m, k, e, 132) == interface.SWAP_TILE) == want, (layout, n_out, m, k, e)
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
        assert interface.choose_tiles("concat", i, m, k, e, 132) == interface.SWAP_TILE, name
        assert interface.choose_tiles("none", h, m, k, e, 132) == interface.SWAP_TILE, name
    # Not swapped: mixtral M=128 (32 rows per expert, two token tiles re-read the weights: 675 -> 833),
    # gpt-oss and qwen3 at M = 1 (one wave of wide tiles: 57.0 -> 60.7, 26.7 -> 27.7).
    assert interface.choose_tiles("concat", 14336, 128, 2, 8, 132)[0] == 64
    assert interface.choose_tiles("concat", 2880, 1, 4, 128, 132)[0] == 64
    assert interface.choose_tiles("none", 2048, 1, 8, 128, 132)[0] == 64
