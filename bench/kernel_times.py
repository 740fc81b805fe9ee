"""python bench/kernel_times.py [--shapes ...] [--tokens ...]: where the compiled layer's time goes.

For each benchmark shape and token count: the duration of each kernel one call of the compiled layer
launches (torch.profiler, mean over --calls calls), run eagerly and inside CUDA-graph replays, their
sums, and the replay median that `python -m moe_ops.bench` reports. A replay much longer than its
kernels points at gaps between kernels; kernels slower in replay than eagerly point at the GPU's state
(clocks under sustained load) or memory placement. The GEMMs and the token sum launch as programmatic
dependents (PDL): each starts while the kernel before it finishes and waits for it, so its duration
includes that wait and the durations of one call overlap; the replay median is the layer's time.
Prints a markdown table.
"""
from __future__ import annotations

import argparse

import torch

import lowering
from moe_ops import fused_experts
from moe_ops.bench import SHAPES, TOKENS, capture, expert_weights, graph_time_us, kernel_durations, layer_inputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    lowering.install()
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| shape | M | eager kernels (µs each, launch order) | in replay | eager sum µs | replay sum µs | replay median µs |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        w13, w2 = expert_weights(name)
        layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
        for m in args.tokens:
            x, tw, ids = layer_inputs(name, m)
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                eager = kernel_durations(lambda: layer(x, w13, w2, tw, ids), args.calls)
                in_replay = kernel_durations(capture(lambda: layer(x, w13, w2, tw, ids)).replay, args.calls)
                median = graph_time_us(lambda: layer(x, w13, w2, tw, ids), 40)
            listed = lambda ks: ", ".join(f"{kname[:20]}: {us:.1f}" for kname, us in ks)  # noqa: E731
            total = lambda ks: sum(us for _, us in ks)  # noqa: E731
            print(f"| {name} | {m} | {listed(eager)} | {listed(in_replay)} | {total(eager):.1f} | {total(in_replay):.1f} | {median:.1f} |", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
