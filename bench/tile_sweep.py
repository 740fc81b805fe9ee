"""python bench/tile_sweep.py [--fp8] [M ...]: time GEMM1 (gate_up) and GEMM2 + token sum (down_reduce)
alone, in CUDA graphs, for every (tile_m, tile_n) the kernels offer, at the benchmark's shapes and
token counts; and the memory probes behind the speed-of-light bound. The data behind
interface.choose_tiles. --fp8: e4m3 operands with per-row scales, the tiles the fp8 kernels take
(interface.fp8_tile_shapes), and the rule's fp8 choice (choose_fp8_tiles). Prints a markdown table."""
from __future__ import annotations

import sys

import torch

from cute_kernels import interface
from moe_ops.bench import SHAPES, TOKENS, alternating_times_us, expert_weights, graph_time_us, layer_inputs
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


FP8 = torch.float8_e4m3fn


def _codes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of t's values spread over most of e4m3's range, one leading index at a time (a
    DeepSeek-V3 w13 is 15 GB in bf16). The sweep times the kernels: the values only need to vary."""
    out = torch.empty(t.shape, dtype=FP8, device=t.device)
    for j in range(t.shape[0]):
        out[j] = (t[j].float() * (400 / t[j].float().abs().amax().clamp_min(1e-6))).clamp(-448, 448)
    return out


def main(tokens, fp8: bool) -> None:
    print(torch.cuda.get_device_name(), torch.__version__, "fp8 operands, per-row scales" if fp8 else "bf16")
    if not fp8:
        memory_probes()
    print("| shape | M | gate_up µs by tile_m x tile_n | down_reduce µs by tile_m x tile_n | rule (gate, down) |")
    print("|---|---|---|---|---|")
    sms = interface.num_sms(0)
    fmt = lambda d: ", ".join(f"{tm}x{tn}: {us:.0f}" for (tm, tn), us in d.items())  # noqa: E731
    tiles_of, rule_of = (interface.fp8_tile_shapes, interface.choose_fp8_tiles) if fp8 else (interface.tile_shapes, interface.choose_tiles)
    for name, (e, k, h, i) in SHAPES.items():
        w13, w2 = expert_weights(name)
        fp8_args = {}, {}
        if fp8:
            w13, w2 = _codes(w13), _codes(w2)
            s13, s2 = torch.rand(e, 2 * i, device="cuda") * 1e-3, torch.rand(e, h, device="cuda") * 1e-3
        for m in tokens:
            x, tw, ids = layer_inputs(name, m)
            offsets, gather, inverse = routing_plan(ids, e, None)
            inter = torch.empty(m * k, i, device="cuda", dtype=torch.bfloat16)
            a2 = inter
            if fp8:
                x, a2 = _codes(x), _codes(torch.randn(m * k, i, device="cuda"))
                fp8_args = (
                    {"a_scale": torch.rand(m, 1, device="cuda") * 1e-2, "w_scale": s13, "out_dtype": torch.bfloat16},
                    {"a_scale": torch.rand(m * k, 1, device="cuda") * 1e-2, "w_scale": s2, "out_dtype": torch.bfloat16},
                )
            # Each tile's graph, replayed in turn with the others (alternating_times_us).
            gu = alternating_times_us({
                tiles: lambda tiles=tiles: interface.gate_up(
                    x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0,
                    gate_layout="concat", out=inter, tiles=tiles, **fp8_args[0])
                for tiles in tiles_of("concat")
            })  # fmt: skip
            dr = alternating_times_us({
                tiles: lambda tiles=tiles: interface.down_reduce(a2, w2, None, offsets, tw, inverse, tiles=tiles, **fp8_args[1])
                for tiles in tiles_of("none")
            })  # fmt: skip
            rule = tuple(
                rule_of(layout, n, m, k, e, sms, k_dim=kd)
                for layout, n, kd in (("concat", i, h), ("none", h, i))
            )
            print(f"| {name} | {m} | {fmt(gu)} | {fmt(dr)} | {rule} |", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    args = sys.argv[1:]
    fp8 = "--fp8" in args
    main([int(t) for t in args if t != "--fp8"] or list(TOKENS), fp8)
