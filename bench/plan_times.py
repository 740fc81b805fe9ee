"""python bench/plan_times.py [--shapes ...] [--tokens ...]: the routing plan alone, per launch, at the
benchmark's shapes and token counts: launch_config's choice, and each kernel at its own default
(keys: the whole plan in 4096-pair chunks, 8 warps; blocks: BLOCKS_LAUNCH). Each launch is first
checked bit for bit against the reference (moe_ops.plan's torch code), then timed in a CUDA graph of
40 launches (median of 15 replays after 5 untimed, µs per launch). The data behind plan_kernel.launch_config and
KEYS_MAX_PAIRS (bench/NOTES.md v17, v18, v26). Prints a markdown table."""
from __future__ import annotations

import argparse

import torch

from moe_ops import plan_kernel
from moe_ops.bench import SHAPES, TOKENS, graph_time_us, layer_inputs
from moe_ops.plan import routing_plan

LAUNCHES = 40


def per_launch_us(fn, replays: int = 15) -> float:
    """µs per launch: the median replay of a graph of LAUNCHES calls of fn(), over LAUNCHES."""
    return graph_time_us(lambda: [fn() for _ in range(LAUNCHES)], replays) / LAUNCHES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| shape | M | P | rule | rule µs | keys µs | blocks µs |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        e, k, _, _ = SHAPES[name]
        for m in args.tokens:
            _, _, ids = layer_inputs(name, m)
            p = m * k
            # The op's CPU implementation is the reference: run it on a host copy.
            expected = [t.cuda() for t in routing_plan(ids.cpu(), e, None)]
            launches = {
                "rule": plan_kernel.launch_config(p, e),
                "keys": plan_kernel.PlanLaunch("keys", 8, chunk=4096),
                "blocks": plan_kernel.BLOCKS_LAUNCH,
            }
            cells = []
            for launch in launches.values():
                fn = lambda launch=launch: plan_kernel.routing_plan_triton(ids, e, None, launch)  # noqa: E731
                if not all(torch.equal(a, b) for a, b in zip(fn(), expected)):
                    raise AssertionError(f"{name} M={m}: {launch} differs from the reference")
                cells.append(f"{per_launch_us(fn):.1f}")
            rule = launches["rule"]
            print(f"| {name} | {m} | {p} | {rule.method} {rule.num_warps}w | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
