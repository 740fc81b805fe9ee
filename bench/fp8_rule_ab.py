"""python bench/fp8_rule_ab.py CASE ...: an fp8 layer of bench/quant_layers.py with two tile rules in one
process, as CUDA graphs whose replays alternate (moe_ops.bench.alternating_times_us, 5 rounds of 10):
"old", choose_tiles with its 128-row tiles narrowed to 128 x 128 (e439cd7), and "new",
interface.choose_fp8_tiles. µs per call, median. Alternating matters at large M: a sweep that times one
tile after another hands the first ones a cooler, faster GPU (bench/NOTES.md v49)."""
from __future__ import annotations

import sys
import warnings

import torch
from quant_layers import CASES

import moe_ops
from cute_kernels import interface
from moe_ops import bench

new = interface.choose_fp8_tiles


def old(layout, n_out, m, k, e, sms, *, k_dim):
    t = interface.choose_tiles(layout, n_out, m, k, e, sms, k_dim=k_dim)
    return (128, min(t[1], 128)) if t[0] == 128 else t


def main() -> None:
    warnings.simplefilter("ignore")
    print(torch.cuda.get_device_name())
    with torch.inference_mode(), moe_ops.value_checks(False):
        for name in sys.argv[1:]:
            run(name)


def run(name: str) -> None:
    """Both rules' times of CASES[name] at M = 1 ... 8192; choose_fp8_tiles is restored afterwards."""
    (experts, k, hidden, inter), scheme = CASES[name]
    layer = moe_ops.FusedMoE(experts, k, hidden, inter, dtype=torch.bfloat16, device="cuda", quant_config=scheme)
    try:
        for m in (1, 16, 128, 1024, 8192):
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

            def call(rule, x=x):
                # The launchers look the rule up per call; a graph keeps the kernels captured with it.
                interface.choose_fp8_tiles = rule
                return layer(x)

            us = bench.alternating_times_us({"old": lambda: call(old), "new": lambda: call(new)}, rounds=5, replays=10)
            o, n = us["old"], us["new"]
            print(f"{name} M={m}: old {o:.1f} new {n:.1f} ({(n / o - 1) * 100:+.1f}%)", flush=True)
    finally:
        interface.choose_fp8_tiles = new
    del layer
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
