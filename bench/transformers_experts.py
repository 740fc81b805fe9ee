"""python bench/transformers_experts.py [--tokens 1 128 8192]: a transformers gpt-oss experts module at
gpt-oss-120b's shape (E 128, k 4, H = I = 2880, bf16, random weights and biases), compiled with the
lowering, as a transformers user runs it:
- "moe_ops, as loaded": experts_implementation "moe_ops" on the [E, K, N] weights transformers keeps,
  which moe_ops reads as column-major views; the kernels decline them, so the fused ops run the reference;
- "moe_ops, row_major_experts": the same after moe_ops.integrations.transformers.row_major_experts;
- "transformers grouped_mm": transformers' own "grouped_mm" implementation, compiled without the lowering;
- "moe_ops, quantize_experts mxfp4": after moe_ops.integrations.transformers.quantize_experts to mxfp4 (tiled
  for the w4a16 kernels on CUDA), as for gpt-oss loaded without transformers' hub kernels (dequantized to bf16).
µs per call in CUDA graphs of GRAPH_CALLS calls, each call its own routing (as the benchmark's "in
graph" column), median of the replays.

--eager: the module run as a transformers model runs without torch.compile or CUDA graphs, where a decode
step is host-bound: bf16 after row_major_experts through "moe_ops" (with its id check, and inside
moe_ops.value_checks(False)) against transformers' "batched_mm" and "grouped_mm"; µs per call of bursts
of EAGER_CALLS calls with a sync after each, the implementations alternating burst by burst (the GPU
host's CPU time drifts), median of the rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import transformers

import lowering
from moe_ops import value_checks
from moe_ops.bench import GRAPH_CALLS, SHAPES, capture, graph_inputs, replay_times_us
from moe_ops.integrations.transformers import quantize_experts, row_major_experts
from moe_ops.quant import GroupShape, QuantScheme, WeightQuant

SHAPE = "gpt-oss-120b"
EAGER_CALLS = 40


def experts_module() -> torch.nn.Module:
    e, k, h, i = SHAPES[SHAPE]
    cfg = transformers.GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    with torch.device("cuda"):
        experts = GptOssExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, h**-0.5)
        experts.down_proj.normal_(0, i**-0.5)
        experts.gate_up_proj_bias.normal_(0, 0.1)
        experts.down_proj_bias.normal_(0, 0.1)
    return experts


def time_us(experts, implementation: str, fuse: bool, m: int, replays: int) -> float:
    """Median µs per call of experts(x, ids, weights) compiled (fullgraph) and captured; NaN, with the
    error printed, where it does not compile or capture."""
    try:
        return _time_us(experts, implementation, fuse, m, replays)
    except Exception as e:  # a peer that cannot be captured is reported, not fatal
        print(f"{implementation} at M = {m}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return float("nan")


def _time_us(experts, implementation: str, fuse: bool, m: int, replays: int) -> float:
    experts.config._experts_implementation = implementation
    sets = [(x, w.to(torch.bfloat16), ids.long()) for x, w, ids in graph_inputs(SHAPE, m)]
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True)
    with torch.no_grad(), (lowering.enabled() if fuse else contextlib.nullcontext()):
        def calls():
            for x, w, ids in sets:
                compiled(x, ids, w)

        graph = capture(calls)
        return statistics.median(replay_times_us(graph, replays)) / GRAPH_CALLS


def eager_times_us(experts, m: int, rounds: int) -> dict[str, float]:
    """--eager: {implementation: median µs per eager call} at M = m, the implementations alternating."""
    x, w, ids = graph_inputs(SHAPE, m)[0]
    w, ids = w.to(torch.bfloat16), ids.long()
    runs = {
        "moe_ops": ("moe_ops", contextlib.nullcontext),
        "moe_ops, value_checks(False)": ("moe_ops", lambda: value_checks(False)),
        "transformers batched_mm": ("batched_mm", contextlib.nullcontext),
        "transformers grouped_mm": ("grouped_mm", contextlib.nullcontext),
    }

    def burst(implementation, context) -> float:
        experts.config._experts_implementation = implementation
        with context():
            experts(x, ids, w)  # first call of a switched implementation outside the timing
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(EAGER_CALLS):
                experts(x, ids, w)
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / EAGER_CALLS * 1e6

    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(rounds):
            for name, (implementation, context) in runs.items():
                times[name].append(burst(implementation, context))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default 1 128 8192; --eager 1 4 16)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="time eager calls instead (see above)")
    parser.add_argument("--rounds", type=int, default=9, help="--eager: alternating rounds")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or ([1, 4, 16] if args.eager else [1, 128, 8192])
    experts = experts_module()
    if args.eager:
        row_major_experts(torch.nn.ModuleDict({"experts": experts}))
        rows = {m: eager_times_us(experts, m, args.rounds) for m in args.tokens}
        print_table(rows, f"eager, bursts of {EAGER_CALLS} calls with a sync after each, median of {args.rounds} rounds")
        return
    rows = {m: {} for m in args.tokens}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in args.tokens:
            rows[m]["moe_ops, as loaded"] = time_us(experts, "moe_ops", True, m, args.replays)
    print("warnings while running as loaded:", sorted({str(w.message) for w in caught if "moe_ops::" in str(w.message)}))
    print("row_major_experts:", row_major_experts(torch.nn.ModuleDict({"experts": experts})))
    for m in args.tokens:
        rows[m]["moe_ops, row_major_experts"] = time_us(experts, "moe_ops", True, m, args.replays)
        rows[m]["transformers grouped_mm"] = time_us(experts, "grouped_mm", False, m, args.replays)
    print("quantize_experts:", quantize_experts(torch.nn.ModuleDict({"experts": experts}), QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32)))))
    for m in args.tokens:
        rows[m]["moe_ops, quantize_experts mxfp4"] = time_us(experts, "moe_ops", True, m, args.replays)
    print_table(rows, "compiled, in CUDA graphs")


def print_table(rows: dict[int, dict[str, float]], how: str) -> None:
    names = list(next(iter(rows.values())))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; {how}; µs per call")
    print("| M | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for m, row in rows.items():
        print(f"| {m} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
