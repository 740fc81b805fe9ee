"""python bench/w4a16_gemm.py [--tok 16 32 64 128] [--tokens 1 16 128 ...]: the w4a16 grouped GEMM (cute_kernels/w4a16_grouped.py) at gpt-oss-120b's expert
shapes (E = 128, top-4, H = I = 2880), mxfp4 weights packed once, in CUDA graphs of GRAPH_CALLS launches.

For M tokens (default 1, 16, 128; random top-4 routing, each expert's rows contiguous as the routing plan leaves them):
GEMM1 (2I x H, its rows read from the M tokens through the plan's gather: in the kernel at decode sizes, else copied
by index_select first, as interface.w4a16_gathers_in_kernel rules; swigluoai on interleaved gate/up rows, biases, bf16 out), GEMM2 (H x I, bias, float32 out), and
the packed bytes each reads (active experts only) over its time; beside them torch.sum over the same number of
bytes in one buffer (a read that does nothing else). Prints µs per launch (median of ROUNDS graph replays), for
each m-tile of --tok (default: the interface's rule).
"""
from __future__ import annotations

import argparse

import torch

from cute_kernels import interface
from cute_kernels import w4a16_pack as wp
from moe_ops.bench import graph_time_us

E, TOP_K, H, I = 128, 4, 2880, 2880
GRAPH_CALLS, ROUNDS = 20, 15


def graph_time(fn) -> float:
    """µs per call of fn: the median replay of a graph of GRAPH_CALLS calls, over ROUNDS replays."""
    return graph_time_us(lambda: [fn() for _ in range(GRAPH_CALLS)], ROUNDS) / GRAPH_CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tok", type=int, nargs="+", default=[None], help="m-tile rows (16, 32, 64, 128); default: the rule")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    codes13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
    scales13 = torch.randint(118, 123, (E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
    codes2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=dev)
    scales2 = torch.randint(118, 123, (E, H, I // 32), dtype=torch.uint8, device=dev)
    p13 = wp.pack_mxfp4_experts(codes13, scales13, kind="gate_up", gate_layout="interleaved")
    p2 = wp.pack_mxfp4_experts(codes2, scales2, kind="rows")
    b13 = torch.randn(E, 2 * I, device=dev)
    b2 = torch.randn(E, H, device=dev)
    dev_name = torch.cuda.get_device_name()
    print(f"{dev_name}; gpt-oss-120b experts in mxfp4, packed; µs per launch in CUDA graphs")
    print("| M | tok | active experts | GEMM1 µs | GEMM1 TB/s | GEMM2 µs | GEMM2 TB/s | sum of GEMM2's bytes µs |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.tokens:
        ids = torch.stack([torch.randperm(E, device=dev)[:TOP_K] for _ in range(m)])
        counts = torch.bincount(ids.flatten(), minlength=E)
        offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0))).int()
        active = int((counts > 0).sum())
        p = m * TOP_K
        gather = (torch.sort(ids.flatten(), stable=True).indices // TOP_K).int()  # the plan's: pairs grouped by expert
        x = torch.randn(m, H, device=dev).bfloat16()
        h = torch.empty(p, I, device=dev, dtype=torch.bfloat16)
        y = torch.empty(p, H, device=dev)
        bytes1 = active * p13[0].numel() * 4
        bytes2 = active * p2[0].numel() * 4
        flat = torch.randn(bytes2 // 4, device=dev)  # float32: torch.sum of int32 widens to int64, far slower
        t_sum = graph_time(lambda: flat.sum())
        for tok in args.tok:  # one routing for every m-tile compared
            t1 = graph_time(lambda: interface.w4a16_grouped_gemm(
                x, p13, offsets, n=2 * I, activation="swigluoai", bias=b13, gate_layout="interleaved", out=h, tok=tok,
                gather=gather))
            t2 = graph_time(lambda: interface.w4a16_grouped_gemm(h, p2, offsets, n=H, bias=b2, out=y, tok=tok))
            tok = interface.choose_w4a16_tok(p, E) if tok is None else tok
            print(f"| {m} | {tok} | {active} | {t1:.1f} | {bytes1 / t1 / 1e6:.2f} | {t2:.1f} | {bytes2 / t2 / 1e6:.2f} | {t_sum:.1f} |", flush=True)

if __name__ == "__main__":
    main()
