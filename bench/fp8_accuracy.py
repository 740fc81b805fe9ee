"""python bench/fp8_accuracy.py [--k 512 2048 ...]: the error of the fp8 grouped GEMMs against float64 as
the reduction length K grows, on an sm_90 GPU.

Hopper's fp8 WGMMA adds into its accumulator with fewer bits than fp32, so summing all of K there ("fast
accumulation") loses accuracy as K grows; the kernels add each 128-element k-tile's products to fp32
registers instead (promotion; before e439cd7 the per-row/per-tensor kernels did not, bench/NOTES.md
v48). Both fp8 kernels, per row ("fp8 row": per-row activation and per-expert weight scales) and with
block scales ("fp8 block": the same scales as 1x128 and 128x128 blocks), run down_reduce (k = 1, so the
output is the GEMM's rows) on the same e4m3 codes; the bf16 kernel runs on the codes decoded to bf16
(exact), unscaled. Each error is the norm of (kernel - float64) over the norm of float64, next to the
bf16 output's own rounding ("floor").

Data: "centred" codes are zero-mean, so partial sums stay near sqrt(K) products; "positive" codes (all
activations >= 0, weights with mean 1/2 of their spread) let partial sums grow with K, the hard case
for an accumulator that drops the low bits of each addend.
"""
from __future__ import annotations

import argparse

import torch

from cute_kernels import interface
from moe_ops.plan import routing_plan

FP8 = torch.float8_e4m3fn
DATA = {
    "centred": (lambda shape: torch.randn(shape, device="cuda"), lambda shape: torch.randn(shape, device="cuda")),
    "positive": (lambda shape: torch.randn(shape, device="cuda").abs(), lambda shape: torch.randn(shape, device="cuda") + 0.5),
}


def codes(values: torch.Tensor) -> torch.Tensor:
    """values spread over most of e4m3's range (|x| <= 448), as a quantizer leaves them."""
    return (values * 100).clamp(-448, 448).to(FP8)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def measure(k: int, data: str, m: int, n: int, e: int) -> dict[str, float]:
    """Errors of the per-row fp8, block-scale fp8 and bf16 kernels for one K (see module)."""
    make_a, make_w = DATA[data]
    a, w = codes(make_a((m, k))), codes(make_w((e, n, k)))
    a_row = torch.rand(m, 1, device="cuda") * 0.01 + 0.001
    w_exp = torch.rand(e, device="cuda") * 0.01 + 0.001
    ids = torch.randint(0, e, (m, 1), device="cuda", dtype=torch.int32)
    offsets, _, inverse = routing_plan(ids, e, None)
    topk_weights = torch.ones(m, 1, device="cuda")
    # a's rows in grouped order: down_reduce reads row r of `a` as grouped row r.
    grouped = torch.empty_like(a)
    grouped[inverse.long()] = a
    a_scale = torch.empty_like(a_row)
    a_scale[inverse.long()] = a_row
    expert = ids[:, 0].long()
    ref_codes = torch.empty(m, n, dtype=torch.float64, device="cuda")  # token order
    for j in range(e):
        mine = expert == j
        ref_codes[mine] = a[mine].double() @ w[j].double().T
    ref = ref_codes * a_row.double() * w_exp.double()[expert, None]
    kb, nb = -(-k // 128), -(-n // 128)
    common = dict(offsets=offsets, topk_weights=topk_weights, inverse=inverse, out_dtype=torch.bfloat16)
    row = interface.down_reduce(grouped, w, None, a_scale=a_scale, w_scale=w_exp, **common)
    block = interface.down_reduce(
        grouped, w, None, a_scale=a_scale.expand(m, kb).contiguous(),
        w_scale=w_exp[:, None, None].expand(e, nb, kb).contiguous(), block_scales=True, **common,
    )  # fmt: skip
    plain = interface.down_reduce(grouped.to(torch.bfloat16), w.to(torch.bfloat16), None, offsets, topk_weights, inverse)
    return {
        "fp8 row": rel_err(row, ref),
        "fp8 block": rel_err(block, ref),
        "bf16": rel_err(plain, ref_codes),
        "floor": rel_err(ref.to(torch.bfloat16), ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[512, 2048, 4096, 7168, 14336])
    parser.add_argument("--m", type=int, default=512, help="tokens (rows), each routed to one expert")
    parser.add_argument("--n", type=int, default=1024, help="output columns (hidden)")
    parser.add_argument("--experts", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; M={args.m} N={args.n} E={args.experts}")
    print(f"{'data':<9} {'K':>6} " + " ".join(f"{name:>10}" for name in ("fp8 row", "fp8 block", "bf16", "floor")))
    for data in DATA:
        for k in args.k:
            errs = measure(k, data, args.m, args.n, args.experts)
            print(f"{data:<9} {k:>6} " + " ".join(f"{v:>10.2e}" for v in errs.values()))


if __name__ == "__main__":
    main()
