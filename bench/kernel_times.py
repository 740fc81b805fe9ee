"""python bench/kernel_times.py [--shapes ...] [--tokens ...]: where the compiled layer's time goes.

For each benchmark shape and token count: the duration of each kernel one call of the compiled layer
launches (torch.profiler, mean over --calls calls), run eagerly and inside CUDA-graph replays, their
sums, and the replay median that `python -m moe_ops.bench` reports. A replay much longer than its
kernels points at gaps between kernels; kernels slower in replay than eagerly point at the GPU's state
(clocks under sustained load) or memory placement. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import lowering
from moe_ops import fused_experts
from moe_ops.bench import SHAPES, TOKENS, graph_time_us


def kernel_durations(fn, calls: int) -> list[tuple[str, float]]:
    """[(kernel name, mean µs)] in launch order for one call of fn() (after a warm-up call), from
    `calls` profiled calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda ev: ev.time_range.start
    )
    if len(events) % calls:
        raise RuntimeError(f"{len(events)} kernels over {calls} calls: not the same kernels every call")
    per_call = len(events) // calls
    return [
        (events[i].name, statistics.mean(ev.time_range.elapsed_us() for ev in events[i::per_call]))
        for i in range(per_call)
    ]


def replay(fn):
    """A function replaying a CUDA graph of fn() (captured after warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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
        e, k, h, i = SHAPES[name]
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
        layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
        for m in args.tokens:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            tw, ids = torch.softmax(torch.randn(m, e, device="cuda"), -1).topk(k, dim=-1)
            tw, ids = (tw / tw.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                eager = kernel_durations(lambda: layer(x, w13, w2, tw, ids), args.calls)
                in_replay = kernel_durations(replay(lambda: layer(x, w13, w2, tw, ids)), args.calls)
                median = graph_time_us(lambda: layer(x, w13, w2, tw, ids), 40)
            listed = lambda ks: ", ".join(f"{kname[:20]}: {us:.1f}" for kname, us in ks)  # noqa: E731
            total = lambda ks: sum(us for _, us in ks)  # noqa: E731
            print(f"| {name} | {m} | {listed(eager)} | {listed(in_replay)} | {total(eager):.1f} | {total(in_replay):.1f} | {median:.1f} |", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
