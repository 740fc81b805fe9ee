"""python bench/tile_ab.py SHAPE M [LAYOUT:MxN[,LAYOUT:MxN] ...]: the compiled layer with choose_tiles'
choice and with each given tile forced for one GEMM, or for both (LAYOUT "none" is GEMM2; GEMM1 is
"concat" in the benchmark's SiLU layer, every shape), all captured as CUDA graphs in this one process
and replayed in interleaved rounds, so the variants share the machine, its clocks and the memory
layout (bench/NOTES.md v14, item 3). Prints the median and quartiles of each variant's replay times in
µs. A variant may be any tile the kernel builds (MoeGemmSm90 says which), not only those choose_tiles
can pick.
--in-graph: each variant is a graph of GRAPH_CALLS calls with their own inputs, timed per call, as
`python -m moe_ops.bench`'s "in graph" column.

    python bench/tile_ab.py gpt-oss-120b 1024 none:64x256 none:64x128
    python bench/tile_ab.py gpt-oss-120b 1 concat:64x192 --in-graph
    python bench/tile_ab.py qwen3-30b-a3b 1 concat:16x256,none:16x128 --in-graph
"""
from __future__ import annotations

import argparse
import statistics

import torch

import lowering
from cute_kernels import interface, tiles
from moe_ops import fused_experts
from cute_kernels.moe_gemm import Epilogue, MoeGemmSm90
from moe_ops.bench import SHAPES, capture, expert_weights, graph_inputs, layer_inputs, replay_times_us


def parse_variant(text: str) -> dict[str, tuple[int, int]]:
    """{layout: (tile_m, tile_n)} from "LAYOUT:MxN[,LAYOUT:MxN]"."""
    variant = {}
    for item in text.split(","):
        layout, _, tile = item.partition(":")
        tm, _, tn = tile.partition("x")
        if layout not in tiles.TILE_N or not (tm.isdigit() and tn.isdigit()):
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected LAYOUT:MxN with LAYOUT in {sorted(tiles.TILE_N)}")
        tm, tn = int(tm), int(tn)
        # The kernel's own constructor says which tiles it builds (no compile happens here).
        epi = Epilogue("none", "none") if layout == "none" else Epilogue("silu", layout)
        try:
            MoeGemmSm90(epi, tile_n=tn, tile_m=tm, gather=layout != "none")
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {e}; the rule's {layout} tiles are {interface.tile_shapes(layout)}")
        variant[layout] = (tm, tn)
    return variant


def interleaved_times(graphs: list[torch.cuda.CUDAGraph], rounds: int, per_round: int) -> list[list[float]]:
    """µs of each timed replay, per graph; each round warms and times every graph in turn."""
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for g, out in zip(graphs, times):
            out.extend(replay_times_us(g, per_round, warmup=3))
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("tokens", type=int)
    parser.add_argument("variants", nargs="*", type=parse_variant)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--in-graph", action="store_true", help="time per call in graphs of many calls")
    args = parser.parse_args(argv)
    lowering.install()
    w13, w2 = expert_weights(args.shape)
    sets = graph_inputs(args.shape, args.tokens) if args.in_graph else [layer_inputs(args.shape, args.tokens)]
    layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
    rule = interface.choose_tiles
    graphs, asked = [], []
    try:
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            for variant in [None, *args.variants]:
                seen: dict[str, tuple[int, int]] = {}

                # The custom ops ask choose_tiles at each call, so the forced tile is what gets captured.
                def forced(layout, *rest, variant=variant, seen=seen, **kw):
                    seen[layout] = variant[layout] if variant is not None and layout in variant else rule(layout, *rest, **kw)
                    return seen[layout]

                interface.choose_tiles = forced
                graphs.append(capture(lambda: [layer(x, w13, w2, tw, ids) for x, tw, ids in sets]))
                if variant is not None and not set(variant) <= set(seen):
                    raise SystemExit(f"variant {sorted(variant)}: the layer's GEMMs ask for the layouts {sorted(seen)}; it would time the rule")
                asked.append(seen)
    finally:
        interface.choose_tiles = rule
    print(torch.cuda.get_device_name(), torch.__version__, f"{args.shape} M={args.tokens}, rule: {asked[0]}")
    per = f" per call of a graph of {len(sets)}" if args.in_graph else ""
    for variant, t in zip([None, *args.variants], interleaved_times(graphs, args.rounds, 5)):
        t = [us / len(sets) for us in t]
        q1, _, q3 = statistics.quantiles(t, n=4)
        name = "rule" if variant is None else ",".join(f"{layout}:{tm}x{tn}" for layout, (tm, tn) in variant.items())
        print(f"{name}: {statistics.median(t):.1f} µs{per} (quartiles {q1:.1f}-{q3:.1f})")


if __name__ == "__main__":
    main()
