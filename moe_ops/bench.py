"""python -m moe_ops.bench: time the compiled MoE layer against plain-PyTorch grouped_mm on the GPU.

For each shape (E, top-k, H, I) and token count M, with uniform random routing and random inputs:
- ours: fused_experts compiled with the lowering installed (gate_up + down_reduce), captured in a CUDA
  graph and replayed;
- torch: the grouped_mm path transformers' "grouped_mm" experts run (sort, histc offsets,
  torch._grouped_mm, SiLU-and-mul, torch._grouped_mm, weight and sum), also replayed in a CUDA graph;
- speed of light: the larger of the active experts' weight bytes over the device's copy bandwidth
  and the FLOPs over its dense bf16 matmul rate, both measured in the same run.
Median of many replays after warm-up, each timed alone (events around one replay, then a sync), so a
replay also counts the host's graph launch: the "floor" (a graph of one tiny kernel, measured in the
same run) is that cost, and "% SoL max" = SoL / (SoL + floor) is what a layer that streamed at the
copy rate with no gap between kernels would reach. A model captured whole pays that launch once per
step, not per layer, so the layer is also timed inside a graph of GRAPH_CALLS calls, each with its own
inputs, back to back ("in graph": the replay median divided by GRAPH_CALLS): the time a layer adds to a
captured model's step. Where M*k <= E/4 consecutive calls route to disjoint experts, so that no call
finds the previous call's weights in L2 (at larger M a call's weights exceed L2 many times over).
"launches" counts the kernels one call of our layer runs (the profiler, outside the graph). Writes results.md (the table, then issue 5's targets met
or missed: bench_targets.py), results.json and results.png to bench/results/<gpu-name>/ (or --out);
`--check RESULTS_JSON` prints the targets of an earlier run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from . import _checks
from .bench_targets import report

SHAPES = {
    "mixtral": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
TOKENS = (1, 16, 128, 1024, 8192)
GRAPH_CALLS = 16


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of fn(), captured after three warm-up calls on a side stream (the
    warm-up compiles and allocates outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def expert_weights(name: str, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) bf16 random weights of shape `name`, scaled so activations stay O(1)."""
    e, _, h, i = SHAPES[name]
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) / i**0.5
    return w13, w2


def layer_inputs(name: str, m: int, device="cuda", exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [M, H] bf16, topk_weights [M, k] float32 summing to 1 per token, topk_ids [M, k] int32) for
    shape `name`: random tokens routed by the top k of a softmax over random logits (uniform routing),
    over the experts not in `exclude` (expert ids, any shape) when given."""
    e, k, h, _ = SHAPES[name]
    x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
    logits = torch.randn(m, e, device=device)
    if exclude is not None:
        logits[:, exclude.reshape(-1).long()] = float("-inf")
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
    topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).contiguous()
    return x, topk_weights, topk_ids.to(torch.int32)


def replay_times_us(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 5) -> list[float]:
    """µs of each of `replays` replays of graph after `warmup` untimed ones, each timed alone
    (events around one replay, then a sync)."""
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def graph_time_us(fn, replays: int, warmup: int = 5) -> float:
    """Median µs of one replay of a CUDA graph of fn() (captured after warm-up), timed with events."""
    return statistics.median(replay_times_us(capture(fn), replays, warmup))


def alternating_times_us(fns: dict, rounds: int = 6, replays: int = 5) -> dict:
    """{key: median µs of one replay} for CUDA graphs of each fns[key](), all captured first, then
    replayed in turn, `replays` each per round: at a power-capped large M a variant timed after
    another meets a hotter, slower GPU, which timing one after the other charges to the later ones
    (bench/NOTES.md v49)."""
    graphs = {key: capture(fn) for key, fn in fns.items()}
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, graph in graphs.items():
            times[key] += replay_times_us(graph, replays, 1)
    return {key: statistics.median(t) for key, t in times.items()}


def graph_inputs(name: str, m: int, calls: int = GRAPH_CALLS, device="cuda") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`calls` sets of layer_inputs(name, m); where M*k <= E/4 each routes to experts the one before
    does not use (the last also avoids the first's: the graph replays in a loop), so that consecutive
    calls share no weights. E/4 leaves at least E/2 experts to choose from."""
    e, k, _, _ = SHAPES[name]
    disjoint = m * k <= e // 4
    sets = []
    for c in range(calls):
        exclude = None
        if disjoint and sets:
            exclude = sets[-1][2] if c < calls - 1 else torch.cat([sets[-1][2].reshape(-1), sets[0][2].reshape(-1)])
        sets.append(layer_inputs(name, m, device, exclude=exclude))
    return sets


def expert_weight_bytes(name: str) -> int:
    """Bytes of one expert's bf16 weights for shape `name`: its gate and up rows [2I, H] and down rows [H, I]."""
    _, _, h, i = SHAPES[name]
    return 3 * i * h * 2


def layer_flops(name: str, m: int) -> int:
    """FLOPs of one layer call on m tokens of shape `name`: M*k routed pairs, each a [1, H] x [H, 2I]
    and a [1, I] x [I, H] product (2 FLOPs per multiply-add); routing, activation and reduction are
    negligible beside them."""
    _, k, h, i = SHAPES[name]
    return 2 * m * k * 3 * i * h


def speed_of_light_us(name: str, m: int, active: int, bandwidth: float, rate: float) -> float:
    """The speed-of-light time in µs of one call of shape `name` on m tokens routed to `active` distinct
    experts: the larger of reading each active expert's weights once at `bandwidth` bytes/s and doing
    the layer's FLOPs at `rate` FLOP/s (issue 5's SoL column, which used 4.25e12 and 790e12)."""
    return max(active * expert_weight_bytes(name) / bandwidth, layer_flops(name, m) / rate) * 1e6


def active_experts(topk_ids: torch.Tensor) -> int:
    """How many distinct experts topk_ids routes to (a host sync: benchmark setup only)."""
    return int(torch.unique(topk_ids).numel())


def kernel_durations(fn, calls: int) -> list[tuple[str, float]]:
    """[(kernel name, mean µs)] in launch order for one call of fn() (after a warm-up call), from
    `calls` calls under the profiler."""
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


def kernel_launches(fn) -> list[str]:
    """The names of the GPU kernels one call of fn() launches (after a warm-up call), by the profiler."""
    return [name for name, _ in kernel_durations(fn, 1)]


def replay_floor_us(replays: int = 50) -> float:
    """The least of three graph_time_us medians of a graph of one tiny kernel: what a replay costs
    before any work (the host's graph launch and the GPU's start of the graph; 9-19 µs on the lent
    H200 hosts, bench/NOTES.md v11-v12). The least makes "% SoL max" an upper bound."""
    t = torch.zeros(4, device="cuda")
    return min(graph_time_us(lambda: t.add_(1), replays) for _ in range(3))


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, dense bf16 matmul rate in FLOP/s).

    The copy is the faster of two 1 GiB copies: torch's copy_ (a device-to-device memcpy) and an
    elementwise kernel writing src * 1. On the lent H200 the memcpy reached 2.70 TB/s and the
    elementwise copy 4.21 (bench/tile_sweep.py): the memcpy alone would overstate % SoL by half."""
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_us = min(
        graph_time_us(lambda: dst.copy_(src), 50),
        graph_time_us(lambda: torch.mul(src, 1.0, out=dst), 50),
    )
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = graph_time_us(lambda: a @ b, 50)
    bandwidth = 2 * src.numel() * 4 / (copy_us * 1e-6)
    rate = 2 * 8192**3 / (mm_us * 1e-6)
    del src, dst, a, b
    return bandwidth, rate


def torch_grouped_mm_layer(x, w13, w2, topk_weights, topk_ids):
    """transformers' grouped_mm experts: the plain-PyTorch baseline."""
    m, k = topk_ids.shape
    num_experts, n13, _ = w13.shape
    inter = n13 // 2
    ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(ids)
    counts = torch.histc(sorted_ids.int(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offsets)
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(m, k, -1).float().sum(1).to(x.dtype)


_COMPILE_PROBE = """
import json, sys, time
t = [time.perf_counter()]
import torch
t.append(time.perf_counter())
torch.empty(1, device="cuda")  # the CUDA context
t.append(time.perf_counter())
from cute_kernels import interface
from moe_ops.plan import routing_plan
t.append(time.perf_counter())
e, k, h, i = map(int, sys.argv[1:5])
# Values do not matter for timing; empty tensors keep 22 GB of randn (deepseek) out of the figures.
x = torch.empty(16, h, device="cuda", dtype=torch.bfloat16).normal_()
w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16)
w2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16)
tw = torch.rand(16, k, device="cuda")
ids = torch.randint(0, e, (16, k), device="cuda", dtype=torch.int32)
torch.cuda.synchronize()
t.append(time.perf_counter())
offsets, gather, inverse = routing_plan(ids, e, None)
torch.cuda.synchronize()
t.append(time.perf_counter())
inter = interface.gate_up(x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0, gate_layout="concat")
interface.down_reduce(inter, w2, None, offsets, tw, inverse)
torch.cuda.synchronize()
t.append(time.perf_counter())
d = [b - a for a, b in zip(t, t[1:])]
print(json.dumps(dict(torch_s=d[0], cuda_init_s=d[1], import_s=d[2], plan_s=d[4], kernels_s=d[5],
                      how=sorted({v[0] for v in interface.cc.timings.values()}))))
"""


def compile_times(name: str) -> dict:
    """Seconds to get one layer's kernels (GEMM1, GEMM2, token sum, and the Triton routing plan) for
    shape `name` ready in a fresh process, cold (empty disk caches: the CuTe DSL and Triton compile)
    and warm (loaded from them), split into: import torch, CUDA context, import of this package (the
    CuTe DSL, Triton), the plan's first call, the GEMMs' first calls. "start_s" sums all but torch's
    import: what a process that already uses torch on the GPU waits for before the layer runs."""
    import tempfile

    e, k, h, i = SHAPES[name]
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, MOE_OPS_CUTE_CACHE=f"{cache}/cute", TRITON_CACHE_DIR=f"{cache}/triton")
        # With PYTHONDONTWRITEBYTECODE=1 (set on the lent GPU host, whose torch has no bytecode) every
        # process compiled ~800 modules from source, about 3 s; the probes write bytecode as a normal
        # Python does, the cold one into a fresh cache.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = f"{cache}/pycache"
        for run_name in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, str(e), str(k), str(h), str(i)],
                                  capture_output=True, text=True, env=env, check=True)  # fmt: skip
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["start_s"] = r["cuda_init_s"] + r["import_s"] + r["plan_s"] + r["kernels_s"]
            out[run_name] = r
    return out


def git_commit() -> str:
    """The commit the records name: $MOE_OPS_COMMIT when set (a tree copied without .git), else HEAD,
    with "-dirty" appended when tracked files differ from it (a tree copied onto a checkout of an
    older commit, as on the lent GPU host, would otherwise be named by that older commit)."""
    if os.environ.get("MOE_OPS_COMMIT"):
        return os.environ["MOE_OPS_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed.strip() else "")


def records_commit() -> str:
    """git_commit() for a run's records, said on stderr when it ends in "-dirty": a tree copied onto
    another checkout (the lent GPU host's) is not the commit it names, and MOE_OPS_COMMIT names it."""
    commit = git_commit()
    if commit.endswith("-dirty"):
        print(
            f"moe_ops.bench: tracked files differ from HEAD {short_commit(commit)}; the records will name it so. "
            "Set MOE_OPS_COMMIT=<the commit this tree holds> to name it (a tree copied onto another checkout).",
            file=sys.stderr,
        )
    return commit


def short_commit(commit: str) -> str:
    """A record's commit as the table prints it: 12 hex digits, and "-dirty" if the record says so."""
    return commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")


def progress(i: int, n: int, label: str) -> None:
    """Redraws the progress bar on stderr: point i of n, labelled."""
    width = 30
    done = width * i // n
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<40}", end="" if i < n else "\n", file=sys.stderr, flush=True)


def run(shapes, tokens, replays: int) -> list[dict]:
    """Times every (shape, M) point on the current GPU: one record per point (the keys of results.json)."""
    import lowering
    from moe_ops import fused_experts

    lowering.install()
    bandwidth, rate = measure_ceilings()
    floor_us = replay_floor_us()
    gpu = torch.cuda.get_device_name()
    commit = records_commit()
    records, total, done = [], len(shapes) * len(tokens), 0
    for name in shapes:
        e, k, h, i = SHAPES[name]
        w13, w2 = expert_weights(name)
        # One compile per shape: the token dimension is dynamic, 1 included (backed_size_oblivious).
        layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
        for m in tokens:
            progress(done, total, f"{name} M={m}")
            x, topk_weights, topk_ids = layer_inputs(name, m)
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                ours_us = graph_time_us(lambda: layer(x, w13, w2, topk_weights, topk_ids), replays)
                launches = len(kernel_launches(lambda: layer(x, w13, w2, topk_weights, topk_ids)))
                sets = graph_inputs(name, m)
                graph_us = graph_time_us(lambda: [layer(xs, w13, w2, tw, ids) for xs, tw, ids in sets], replays) / len(sets)
            torch_us = graph_time_us(lambda: torch_grouped_mm_layer(x, w13, w2, topk_weights, topk_ids), replays)
            flops, expert_bytes = layer_flops(name, m), expert_weight_bytes(name)
            active = active_experts(topk_ids)
            weight_bytes = active * expert_bytes
            sol_us = speed_of_light_us(name, m, active, bandwidth, rate)
            graph_sol_us = statistics.mean(speed_of_light_us(name, m, active_experts(ids), bandwidth, rate) for _, _, ids in sets)
            del sets
            records.append(dict(
                shape=name, E=e, k=k, H=h, I=i, M=m, ours_us=ours_us, torch_us=torch_us, sol_us=sol_us,
                active_experts=active, launches=launches, bandwidth_Bps=bandwidth, matmul_flops=rate, gpu=gpu,
                torch=torch.__version__, commit=commit,
                tflops=flops / (ours_us * 1e-6) / 1e12, weight_TBps=weight_bytes / (ours_us * 1e-6) / 1e12,
                pct_sol=100 * sol_us / ours_us, replay_floor_us=floor_us, pct_sol_max=100 * sol_us / (sol_us + floor_us),
                graph_calls=GRAPH_CALLS, ours_graph_us=graph_us, graph_sol_us=graph_sol_us, pct_sol_graph=100 * graph_sol_us / graph_us,
            ))  # fmt: skip
            done += 1
        progress(done, total, name)
        del w13, w2
        torch.cuda.empty_cache()
    return records


def table(records: list[dict]) -> str:
    """The markdown table of results.md: a header line with the run's ceilings, then one row per record."""
    r0 = records[0]
    lines = [
        f"GPU: {r0['gpu']}; torch {r0['torch']}; commit {short_commit(r0['commit'])}; measured copy bandwidth "
        f"{r0['bandwidth_Bps'] / 1e12:.2f} TB/s, dense bf16 matmul {r0['matmul_flops'] / 1e12:.0f} TFLOP/s; "
        f"replay floor (a graph of one tiny kernel) {r0['replay_floor_us']:.1f} µs; "
        f"in graph: µs per call in a graph of {r0['graph_calls']} calls, each with its own inputs, and % of their mean SoL",
        "",
        "| shape (E, k, H, I) | M | ours µs | torch µs | speedup | SoL µs | % SoL | % SoL max | in graph µs | % SoL in graph | TFLOP/s | weight TB/s | launches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['shape']} ({r['E']}, {r['k']}, {r['H']}, {r['I']}) | {r['M']} | {r['ours_us']:.1f} | {r['torch_us']:.1f} | "
            f"{r['torch_us'] / r['ours_us']:.2f}x | {r['sol_us']:.1f} | {r['pct_sol']:.0f}% | {r['pct_sol_max']:.0f}% | "
            f"{r['ours_graph_us']:.1f} | {r['pct_sol_graph']:.0f}% | {r['tflops']:.0f} | {r['weight_TBps']:.2f} | {r['launches']} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """Writes results.png (µs and % of SoL per point) to path; skipped with a message without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib unavailable: no plot", file=sys.stderr)
        return
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in dict.fromkeys(r["shape"] for r in records):
        rs = [r for r in records if r["shape"] == name]
        ms = [r["M"] for r in rs]
        (line,) = ax_t.plot(ms, [r["ours_us"] for r in rs], "o-", label=f"{name} ours")
        ax_t.plot(ms, [r["torch_us"] for r in rs], "x--", color=line.get_color(), label=f"{name} torch")
        ax_s.plot(ms, [r["pct_sol"] for r in rs], "o-", color=line.get_color(), label=name)
    for ax in (ax_t, ax_s):
        ax.set_xscale("log")
        ax.set_xlabel("tokens M")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("µs per layer (CUDA graph replay, median)")
    ax_s.set_ylabel("% of speed of light (ours)")
    ax_t.legend(fontsize=7)
    ax_s.legend(fontsize=7)
    fig.suptitle(f"MoE layer, bf16, {records[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    """The command line (python -m moe_ops.bench); returns the exit status (2 without a CUDA GPU, else 0)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=_checks.argparse_int(1), default=list(TOKENS))
    parser.add_argument("--replays", type=_checks.argparse_int(1), default=100)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/<gpu-name>/")
    parser.add_argument("--compile-times", action="store_true", help="only time a fresh process's start per shape, cold and from the disk caches")
    parser.add_argument("--check", type=Path, default=None, metavar="RESULTS_JSON", help="only print issue 5's targets for an earlier run's results.json (no GPU needed)")
    args = parser.parse_args(argv)
    for name in ("shapes", "tokens"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            # a point measured twice would count twice in the targets' geometric mean
            parser.error(f"--{name}: {values} repeats a value; give each once")
    if args.check is not None:
        given = [f"--{n.replace('_', '-')}" for n in ("shapes", "tokens", "replays", "out", "compile_times")
                 if getattr(args, n) != parser.get_default(n)]  # fmt: skip
        if given:
            parser.error(f"--check reads an earlier run's results only; {', '.join(given)} would be ignored")
        try:
            records = json.loads(args.check.read_text())
            print(report(records))
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--check {args.check}: {type(e).__name__}: {e}")
        return 0
    if not torch.cuda.is_available():
        print("moe_ops.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.compile_times:
        for name in args.shapes:
            t = compile_times(name)
            for run_name, r in t.items():
                print(f"{name} {run_name}: start {r['start_s']:.2f} s = CUDA context {r['cuda_init_s']:.2f} + imports "
                      f"{r['import_s']:.2f} + plan {r['plan_s']:.2f} + GEMMs {r['kernels_s']:.2f} ({', '.join(r['how'])}); "
                      f"import torch {r['torch_s']:.2f} s")  # fmt: skip
        return 0
    records = run(args.shapes, args.tokens, args.replays)
    out = args.out or Path("bench/results") / torch.cuda.get_device_name().replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    text = table(records) + "\n\n" + report(records)
    cmd = "python -m moe_ops.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "results.md").write_text(f"Command: `{cmd.strip()}`\n\n{text}\n")
    (out / "results.json").write_text(json.dumps(records, indent=1))
    plot(records, out / "results.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
