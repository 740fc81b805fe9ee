"""python bench/quant_layers.py [--kernels] [--tokens 1 16 128 1024] [CASE ...]: quantized FusedMoE layers
on an sm_90 GPU, eager under inference_mode and value_checks(False), as the quantized paths run them
(moe_ops/dequant_kernels.py, fp8_kernels.py), and bf16 layers of the same shapes. Prints µs per call
as CUDA-graph replays of one call (median); with --kernels also each call's GPU kernels by the
profiler (µs per call and launches per call, the eight longest). bench/NOTES.md v45-v47 hold its
numbers.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import warnings

import torch

import moe_ops
from moe_ops import bench
from moe_ops.quant import ActivationQuant, GroupShape, QuantScheme, WeightQuant

CASES = {
    "qwen3-fp8-block": ((128, 8, 2048, 768), QuantScheme(ActivationQuant("fp8", GroupShape(1, 128)), WeightQuant("fp8", GroupShape(128, 128)))),
    "gpt-oss-mxfp4": ((128, 4, 2880, 2880), QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32)))),
    # The same layer after FusedMoE.tile_weights(): the w4a16 kernels read its weights as they are; "-bias":
    # with gpt-oss's expert biases (the other cases have none).
    "gpt-oss-mxfp4-tiled": ((128, 4, 2880, 2880), QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32)))),
    "gpt-oss-mxfp4-tiled-bias": ((128, 4, 2880, 2880), QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32)))),
    "qwen3-fp8-per-tensor": ((128, 8, 2048, 768), QuantScheme(ActivationQuant("fp8", GroupShape(-1, -1)), WeightQuant("fp8", GroupShape(-1, -1)))),
    "qwen3-fp8-per-tensor-static": ((128, 8, 2048, 768), QuantScheme(ActivationQuant("fp8", GroupShape(-1, -1), static=True), WeightQuant("fp8", GroupShape(-1, -1)))),
    "qwen3-fp8-per-token": ((128, 8, 2048, 768), QuantScheme(ActivationQuant("fp8", GroupShape(1, -1)), WeightQuant("fp8", GroupShape(1, -1)))),
    "mixtral-fp8-per-tensor": ((8, 2, 4096, 14336), QuantScheme(ActivationQuant("fp8", GroupShape(-1, -1)), WeightQuant("fp8", GroupShape(-1, -1)))),
    "gpt-oss-fp8-per-token": ((128, 4, 2880, 2880), QuantScheme(ActivationQuant("fp8", GroupShape(1, -1)), WeightQuant("fp8", GroupShape(1, -1)))),
    # The unquantized layers of the same shapes, for comparison.
    "qwen3-bf16": ((128, 8, 2048, 768), None),
    "mixtral-bf16": ((8, 2, 4096, 14336), None),
    "gpt-oss-bf16": ((128, 4, 2880, 2880), None),
    "gpt-oss-bf16-bias": ((128, 4, 2880, 2880), None),
}  # fmt: skip


def graph_us(fn, replays: int = 20) -> float:
    graph = bench.capture(fn)
    return statistics.median(bench.replay_times_us(graph, replays, 2))


def kernels(fn, calls: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, µs per call, launches per call) of fn's GPU kernels, longest first."""
    per = collections.defaultdict(lambda: [0.0, 0])
    for name, us in bench.kernel_durations(fn, calls):
        per[name[:70]][0] += us
        per[name[:70]][1] += 1
    return sorted(((name, us, n) for name, (us, n) in per.items()), key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)} (default: all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"CASE: got {unknown}; allowed: {', '.join(CASES)}")
    warnings.simplefilter("ignore")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    with torch.inference_mode(), moe_ops.value_checks(False):
        for name in args.cases or list(CASES):
            (experts, k, hidden, inter), scheme = CASES[name]
            layer = moe_ops.FusedMoE(
                experts, k, hidden, inter, dtype=torch.bfloat16, device="cuda", quant_config=scheme, expert_bias=name.endswith("-bias"),
            )  # fmt: skip
            if "-tiled" in name:
                layer.tile_weights()
            for m in args.tokens:
                x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
                print(f"{name} M={m}: {graph_us(lambda: layer(x)):.1f} us per call in graph", flush=True)
                if args.kernels:
                    for kernel, us, launches in kernels(lambda: layer(x))[:8]:
                        print(f"    {us:8.1f} us  x{launches}  {kernel}")
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
