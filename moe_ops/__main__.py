"""python -m moe_ops: route and run a small Qwen3-MoE-shaped layer (random weights) eagerly and under
torch.compile(fullgraph=True, dynamic=True) with the lowering installed, on CUDA also the compiled layer
captured in a CUDA graph and replayed (how a served model runs it), check each against the float64
reference, print a table, then what the lowering fused and which backend runs it (on a Hopper GPU the
CuTe DSL kernels; elsewhere the fused ops' reference). Runs on the GPU when there is one (bf16), else
on the CPU (float32)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import FusedMoE, _checks
from .bench import capture
from .reference import moe_float64, relative_error, tolerance

# Qwen3-30B-A3B routes 8 of 128 experts; hidden and intermediate sizes are scaled down 4x.
DEFAULT = dict(num_experts=128, top_k=8, hidden_size=512, intermediate_size=192)


def _time(fn, x, repeats: int) -> float:
    """Median wall time of fn(x) in ms, synchronizing around each call."""
    times = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graphed(fn, x: torch.Tensor):
    """fn(x) captured in a CUDA graph (the benchmark's capture, on x's GPU): a callable that replays it
    for this x (its captured input) and returns the graph's output."""
    out = {}
    with torch.cuda.device(x.device):
        graph = capture(lambda: out.update(y=fn(x)))

    def replay(given: torch.Tensor) -> torch.Tensor:
        assert given is x, "the graph replays the input it captured"
        graph.replay()
        return out["y"]

    return replay


def _modes(layer, compiled, x: torch.Tensor):
    """(mode, callable) pairs the demo runs on x; the graph row only on CUDA with tokens to route (an
    empty call launches nothing to capture)."""
    modes = [("eager", layer), ("compiled", compiled)]
    if x.is_cuda and x.shape[0]:
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            modes.append(("compiled + CUDA graph", _graphed(compiled, x)))
    return modes


def main(argv=None) -> int:
    """The demo: prints the error table and what was fused; returns 0 when every relative L2 error is
    within the dtype's tolerance, else 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=_checks.argparse_int(0), nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=_checks.argparse_int(1), default=5)
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: {args.device} asked for, but torch.cuda.is_available() is False")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import lowering  # the demo shows the compiler's side too; moe_ops itself does not need it

    torch.manual_seed(0)
    layer = FusedMoE(**DEFAULT, dtype=dtype, device=device)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    w13, w2 = layer.float_weights()
    tol = tolerance(dtype)
    print(f"moe_ops demo: {layer.extra_repr()}, {dtype}, on {device}")
    print("| mode | tokens | shape (E, k, H, I) | dtype | max rel. error | rel. L2 error | time (ms) |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    shape = f"({DEFAULT['num_experts']}, {DEFAULT['top_k']}, {DEFAULT['hidden_size']}, {DEFAULT['intermediate_size']})"
    with lowering.recording() as fused:
        for m in args.tokens:
            x = torch.randn(m, DEFAULT["hidden_size"], device=device, dtype=dtype)
            with torch.no_grad():
                tw, ti = layer.routing_for(x)
                ref = moe_float64(x, w13, w2, tw, ti, intermediate_dtype=dtype if dtype != torch.float32 else None)
                for mode, fn in _modes(layer, compiled, x):
                    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                        out = fn(x)
                        ms = _time(fn, x, args.repeats)
                    err = relative_error(out, ref)
                    worst = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item() if m else 0.0
                    failed |= not err <= tol
                    print(f"| {mode} | {m} | {shape} | {str(dtype).removeprefix('torch.')} | {worst:.2e} | {err:.2e} | {ms:.2f} |")
    print(f"compiled graphs: {len(fused.graphs)} for {len(args.tokens)} token counts; what the lowering did to each MoE layer:")
    print(fused.table())
    print(f"tolerance {tol:.0e} (relative L2 error against the float64 reference): {'FAILED' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
