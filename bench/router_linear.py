"""python bench/router_linear.py [--tokens 1 2 4 8 16 32] [--sweep] [--layers] [--host]: the router's linear at
decode sizes on an sm_90 GPU. F.linear (cuBLAS) against moe_ops::router_linear (router.py: its Triton
kernel where router_kernel.serves), alone and followed by the route kernel as FusedMoE runs
them: µs per call in CUDA graphs of 20 calls, replayed in turn (moe_ops.bench.alternating_times_us),
the largest error over the largest logit against float64, and host µs per eager call (no sync). --sweep
times the kernel's launch shapes around router_kernel.launch_shape's; --layers the bf16 FusedMoE layer
(eager under inference_mode, CUDA graphs of 8 calls) with its Router against an nn.Linear holding the
same weights; --host where an eager call's host time goes. bench/NOTES.md v62 holds its numbers.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton

import moe_ops
from moe_ops import bench, router_kernel
from moe_ops.router import router_linear

# name -> (E, H, top_k, router bias): the routers of the benchmark's shapes (gpt-oss' has a bias).
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 8, False),
    "gpt-oss-120b": (128, 2880, 4, True),
    "mixtral": (8, 4096, 2, False),
    "deepseek-v3": (256, 7168, 8, False),
}
CALLS = 20


def error(got: torch.Tensor, x, w, b) -> float:
    want = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def inputs(name: str, m: int):
    e, h, _, bias = SHAPES[name]
    w = (torch.randn(e, h, device="cuda") / h**0.5).bfloat16()
    b = torch.randn(e, device="cuda").bfloat16() if bias else None
    xs = [torch.randn(m, h, device="cuda").bfloat16() for _ in range(CALLS)]
    return xs, w, b


def linear_rows(names, tokens) -> None:
    print("| shape | M | F.linear µs | kernel µs | F.linear + route | kernel + route | err F.linear | err kernel | host µs F.linear / op |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        k = SHAPES[name][2]
        for m in tokens:
            xs, w, b = inputs(name, m)
            fns = {
                "linear": lambda: [F.linear(x, w, b) for x in xs],
                "op": lambda: [router_linear(x, w, b) for x in xs],
                "linear+route": lambda: [moe_ops.route(F.linear(x, w, b), k) for x in xs],
                "op+route": lambda: [moe_ops.route(router_linear(x, w, b), k) for x in xs],
            }
            t = {key: us / CALLS for key, us in bench.alternating_times_us(fns).items()}
            errs = (error(F.linear(xs[0], w, b), xs[0], w, b), error(router_linear(xs[0], w, b), xs[0], w, b))
            with torch.inference_mode():
                hosts = (host_us(lambda: F.linear(xs[0], w, b)), host_us(lambda: router_linear(xs[0], w, b)))
            print(
                f"| {name} | {m} | {t['linear']:.2f} | {t['op']:.2f} | {t['linear+route']:.2f} | {t['op+route']:.2f} "
                f"| {errs[0]:.1e} | {errs[1]:.1e} | {hosts[0]:.1f} / {hosts[1]:.1f} |",
                flush=True,
            )


def sweep_rows(names, tokens) -> None:
    print("| shape | M | rule (BLOCK_E, BLOCK_H, warps) µs | best (BLOCK_E, BLOCK_H, warps) µs | fastest six |")
    print("|---|---|---|---|---|")
    for name in names:
        e, h, _, _ = SHAPES[name]
        for m in tokens:
            if m not in (1, router_kernel.MAX_TOKENS):  # each BLOCK_M compiles every shape anew
                continue
            xs, w, b = inputs(name, m)
            _, rule_e, rule_h = router_kernel.launch_shape(m, h, e)
            rule = (rule_e, rule_h, router_kernel._WARPS)
            shapes = {rule}
            for block_e in (1, 2, 4):
                for block_h in (1024, 2048, 4096):
                    for warps in (4, 8):
                        if block_e * block_h <= 8192 and block_h <= triton.next_power_of_2(h) and block_e <= e:
                            shapes.add((block_e, block_h, warps))
            fns = {s: (lambda s=s: [router_kernel.router_linear_triton(x, w, b, s) for x in xs]) for s in sorted(shapes)}
            t = {s: us / CALLS for s, us in bench.alternating_times_us(fns, rounds=3, replays=3).items()}
            best = min(t, key=t.get)
            listed = " ".join(f"{s}:{v:.2f}" for s, v in sorted(t.items(), key=lambda kv: kv[1])[:6])
            print(f"| {name} | {m} | {rule} {t[rule]:.2f} | {best} {t[best]:.2f} | {listed} |", flush=True)


def layer_rows(tokens) -> None:
    """bf16 FusedMoE layers, eager under inference_mode and value_checks(False), CUDA graphs of 8 calls:
    the layer's Router against an nn.Linear with the same weights."""
    print("| layer | M | with nn.Linear µs | with Router µs | host µs per eager call, nn.Linear / Router |")
    print("|---|---|---|---|---|")
    for name, (e, k, h, i) in (("qwen3-30b-a3b", (128, 8, 2048, 768)), ("gpt-oss-120b", (128, 4, 2880, 2880)), ("mixtral", (8, 2, 4096, 14336))):
        layer = moe_ops.FusedMoE(e, k, h, i, dtype=torch.bfloat16, device="cuda")
        router = layer.router
        plain = torch.nn.Linear(h, e, bias=False, dtype=torch.bfloat16, device="cuda")
        plain.weight.data.copy_(router.weight.data)
        for m in tokens:
            xs = [torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(8)]

            def run(module):
                def calls():
                    layer.router = module
                    return [layer(x) for x in xs]

                return calls

            with torch.inference_mode(), moe_ops.value_checks(False):
                t = bench.alternating_times_us({"linear": run(plain), "router": run(router)})
                hosts = []
                for module in (plain, router):
                    layer.router = module
                    hosts.append(host_us(lambda: layer(xs[0]), calls=300))
                layer.router = router
            print(f"| {name} | {m} | {t['linear'] / 8:.2f} | {t['router'] / 8:.2f} | {hosts[0]:.0f} / {hosts[1]:.0f} |", flush=True)


def host_rows() -> None:
    """Host µs per eager call at qwen3's M = 1 (inference_mode, no sync): where the op's host time goes."""
    from moe_ops.router import check_router_args
    from moe_ops.router_kernel import router_linear_triton

    xs, w, b = inputs("qwen3-30b-a3b", 1)
    x = xs[0]
    logits = F.linear(x, w)
    fns = {
        "F.linear": lambda: F.linear(x, w),
        "router_linear": lambda: router_linear(x, w),
        "check_router_args": lambda: check_router_args(x, w, None),
        "router_linear_triton": lambda: router_linear_triton(x, w, None),
        "route": lambda: moe_ops.route(logits, 8),
    }
    with torch.inference_mode():
        print(" ".join(f"{key} {host_us(fn):.1f}" for key, fn in fns.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--host", action="store_true")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    torch.manual_seed(0)
    if args.host:
        host_rows()
    linear_rows(args.shapes, args.tokens)
    if args.sweep:
        sweep_rows(args.shapes, args.tokens)
    if args.layers:
        layer_rows(args.tokens)


if __name__ == "__main__":
    main()
