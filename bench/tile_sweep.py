"""python bench/tile_sweep.py [M ...]: time GEMM1 (gate_up) and GEMM2 + token sum (down_reduce) alone, in
CUDA graphs, for every (tile_m, tile_n) the kernels offer, at the benchmark's shapes and token counts;
and the memory probes behind the speed-of-light bound. The data behind interface.choose_tiles. Prints
a markdown table."""
from __future__ import annotations

import sys

import torch

from cute_kernels import interface
from moe_ops.bench import SHAPES, TOKENS, expert_weights, graph_time_us, layer_inputs
from moe_ops.plan import routing_plan


def memory_probes() -> None:
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    gib = src.numel() * 4
    for name, fn, nbytes in (
        ("memcpy (copy_)", lambda: dst.copy_(src), 2 * gib),
        ("elementwise (mul out=)", lambda: torch.mul(src, 1.0, out=dst), 2 * gib),
        ("read-only (sum)", lambda: src.sum(), gib),
    ):
        us = graph_time_us(fn, 30)
        print(f"{name}: {nbytes / us / 1e6:.2f} TB/s ({us:.0f} µs)")


def main(tokens) -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    memory_probes()
    print("| shape | M | gate_up µs by tile_m x tile_n | down_reduce µs by tile_m x tile_n | rule (gate, down) |")
    print("|---|---|---|---|---|")
    sms = interface.num_sms(0)
    fmt = lambda d: ", ".join(f"{tm}x{tn}: {us:.0f}" for (tm, tn), us in d.items())  # noqa: E731
    for name, (e, k, h, i) in SHAPES.items():
        w13, w2 = expert_weights(name)
        for m in tokens:
            x, tw, ids = layer_inputs(name, m)
            offsets, gather, inverse = routing_plan(ids, e, None)
            inter = torch.empty(m * k, i, device="cuda", dtype=torch.bfloat16)
            gu = {
                tiles: graph_time_us(lambda: interface.gate_up(
                    x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0,
                    gate_layout="concat", out=inter, tiles=tiles), 30)
                for tiles in interface.tile_shapes("concat")
            }  # fmt: skip
            dr = {
                tiles: graph_time_us(lambda: interface.down_reduce(inter, w2, None, offsets, tw, inverse, tiles=tiles), 30)
                for tiles in interface.tile_shapes("none")
            }
            rule = (interface.choose_tiles("concat", i, m, k, e, sms, k_dim=h), interface.choose_tiles("none", h, m, k, e, sms, k_dim=i))
            print(f"| {name} | {m} | {fmt(gu)} | {fmt(dr)} | {rule} |", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or list(TOKENS))
