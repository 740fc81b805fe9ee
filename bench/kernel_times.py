"""python bench/kernel_times.py [--shapes ...] [--tokens ...]: where the compiled layer's time goes.

For each benchmark shape and token count: the duration of each kernel one call of the compiled layer
launches (torch.profiler, mean over --calls calls), run eagerly and inside CUDA-graph replays, their
sums, and the replay median that `python -m moe_ops.bench` reports. A replay much longer than its
kernels points at gaps between kernels; kernels slower in replay than eagerly point at the GPU's state
(clocks under sustained load) or memory placement. The GEMMs and the token sum launch as programmatic
dependents (PDL): each starts while the kernel before it finishes and waits for it, so its duration
includes that wait and the durations of one call overlap; the replay median is the layer's time.
Prints a markdown table.

--timeline: instead, the layer as `python -m moe_ops.bench` times it "in graph" (a graph of
GRAPH_CALLS calls, each with its own inputs): each kernel's start and end in µs after its call's first
kernel started (medians over the calls of a few profiled replays), where the next call starts, and the
in-graph µs per call.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import lowering
from moe_ops import fused_experts
from moe_ops.bench import SHAPES, TOKENS, capture, expert_weights, graph_inputs, graph_time_us, kernel_durations, layer_inputs


def call_timeline(fns, replays: int = 4) -> tuple[list[tuple[str, float, float]], float]:
    """For a CUDA graph that runs each of fns once, in order, all launching the same kernels:
    ([(kernel name, start, end)] in launch order, µs after the call's first kernel started, medians
    over the calls of `replays` profiled replays; µs from a call's first kernel to the next call's)."""
    graph = capture(lambda: [fn() for fn in fns])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda ev: ev.time_range.start
    )
    calls = replays * len(fns)
    if len(events) % calls:
        raise RuntimeError(f"{len(events)} kernels over {calls} calls: not the same kernels every call")
    n = len(events) // calls
    starts = [events[c * n].time_range.start for c in range(calls)]
    timeline = [
        (events[j].name, statistics.median(events[c * n + j].time_range.start - starts[c] for c in range(calls)),
         statistics.median(events[c * n + j].time_range.end - starts[c] for c in range(calls)))
        for j in range(n)
    ]  # fmt: skip
    # Within a replay only: between replays the host's launch of the next one intervenes.
    period = statistics.median(b - a for c, (a, b) in enumerate(zip(starts, starts[1:])) if (c + 1) % len(fns))
    return timeline, period


def timeline_main(shapes, tokens) -> None:
    print("| shape | M | kernels: start-end µs after the call's first kernel (launch order) | next call starts | in graph µs per call |")
    print("|---|---|---|---|---|")
    for name in shapes:
        w13, w2 = expert_weights(name)
        layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
        for m in tokens:
            sets = graph_inputs(name, m)
            fns = [lambda x=x, tw=tw, ids=ids: layer(x, w13, w2, tw, ids) for x, tw, ids in sets]
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                timeline, period = call_timeline(fns)
                per_call = graph_time_us(lambda: [fn() for fn in fns], 40) / len(fns)
            listed = ", ".join(f"{kname[:20]}: {a:.2f}-{b:.2f}" for kname, a, b in timeline)
            print(f"| {name} | {m} | {listed} | {period:.2f} | {per_call:.1f} |", flush=True)
            del sets, fns
        del w13, w2
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--timeline", action="store_true", help="kernel start and end times inside a graph of many calls")
    args = parser.parse_args(argv)
    lowering.install()
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.timeline:
        timeline_main(args.shapes, args.tokens)
        return
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
