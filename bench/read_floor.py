"""python bench/read_floor.py [SHAPE ...]: how close a layer can come to its M = 1 speed of light.

At M = 1 the layer reads each routed expert's W1 [2I, H] and W2 [H, I] once. This times, in CUDA
graphs of GRAPH_CALLS calls (each call its own routing, consecutive calls on disjoint experts, as
`python -m moe_ops.bench`'s "in graph" column), kernels that do nothing but read those bytes:
- read_1: one Triton launch reading every routed expert's W1 and W2 slices (no dependency, no MMA);
- read_2: the same bytes in two launches in stream order, W1's then W2's;
- read_2 pdl: read_2 with W2's launch a programmatic dependent that waits for W1's (as GEMM2 does);
- sum: torch.sum over one contiguous buffer of the same size (16 buffers in rotation);
against the compiled layer, all interleaved in one process (bench/NOTES.md v14 item 3). Each read
kernel is tried over a small sweep of configurations (CONFIGS) and reported at each, after each
configuration's rate over a 1 GiB buffer (where the reader, not the size, sets it). Prints µs per call,
the bytes' rate and % of SoL (bytes over the copy bandwidth measured here, as the benchmark's SoL).
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import lowering
from moe_ops import fused_experts
from moe_ops.bench import GRAPH_CALLS, SHAPES, capture, expert_weights, graph_inputs, measure_ceilings
from tile_ab import interleaved_times


@triton.jit
def _read_slices(
    a, b, ids, out, a_elems, b_elems, a_stride, b_stride, a_programs,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    """Programs [0, a_programs) read CHUNK-element pieces of a[ids[j]] (a_elems each; the last piece
    masked), the rest of b[ids[j]]; every program adds its sum into out[0] so the loads stay live.
    TRIGGER lets a programmatic dependent launch at once; WAIT waits for the kernel before (PDL)."""
    if TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if pid < a_programs:
        per = tl.cdiv(a_elems, CHUNK)
        e = tl.load(ids + pid // per).to(tl.int64)
        start = (pid % per) * CHUNK
        base, n = a + e * a_stride + start, a_elems - start
    else:
        q = pid - a_programs
        per = tl.cdiv(b_elems, CHUNK)
        e = tl.load(ids + q // per).to(tl.int64)
        start = (q % per) * CHUNK
        base, n = b + e * b_stride + start, b_elems - start
    if WAIT:
        gdc_wait()
    for off in range(0, CHUNK, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc += tl.load(base + idx, mask=(idx < n) & (idx < CHUNK), other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.atomic_add(out, tl.sum(acc))


def read(w13, w2, ids, out, chunk, parts, block=2048, warps=8, pdl=False):
    """Read w13[ids] and w2[ids] in one launch (parts=1) or two (parts=2, W1 first), programs of
    `chunk` elements loading `block` at a time with `warps` warps. pdl (parts=2): W2's launch is a
    programmatic dependent of W1's, launched at once and waiting for it before its loads, as the
    layer's GEMM2 waits for GEMM1."""
    a_elems, b_elems = w13[0].numel(), w2[0].numel()
    k = ids.numel()
    na, nb = k * triton.cdiv(a_elems, chunk), k * triton.cdiv(b_elems, chunk)
    args = dict(CHUNK=chunk, BLOCK=block, num_warps=warps)
    common = (w13, w2, ids, out, a_elems, b_elems, w13.stride(0), w2.stride(0))
    if parts == 1:
        _read_slices[(na + nb,)](*common, na, TRIGGER=False, WAIT=False, **args)
    else:
        _read_slices[(na,)](*common, na, TRIGGER=pdl, WAIT=False, **args)
        _read_slices[(nb,)](*common, 0, TRIGGER=False, WAIT=pdl, **args, **({"launch_pdl": True} if pdl else {}))


# (elements per program, elements per load step, warps): a small sweep, since the floor is the best.
CONFIGS = [(c, b, w) for c in (8192, 16384, 32768) for b, w in ((1024, 4), (2048, 8), (4096, 4), (8192, 8)) if b <= c]


def steady_rates(configs) -> list[float]:
    """TB/s of read_1 at each configuration over one contiguous 1 GiB buffer (its ramp and tail
    negligible), one read per graph: whether the reader itself can stream at the copy rate."""
    big = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16).view(1, -1)
    tiny = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    zero, out = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, device="cuda")
    graphs = [capture(lambda c=c, b=b, w=w: read(big, tiny, zero, out, c, 1, b, w)) for c, b, w in configs]
    return [big.numel() * 2 / statistics.median(t) / 1e6 for t in interleaved_times(graphs, 4, 5)]


def main(shapes) -> None:
    lowering.install()
    bandwidth, _ = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rates = steady_rates(CONFIGS)
    print("read_1 over 1 GiB: " + ", ".join(f"{c}/{b}/{w}w {r:.2f} TB/s" for (c, b, w), r in zip(CONFIGS, rates)), flush=True)
    for shape in shapes:
        k = SHAPES[shape][1]
        w13, w2 = expert_weights(shape)
        sets = graph_inputs(shape, 1)
        ids = [s[2].reshape(-1).to(torch.int32) for s in sets]
        nbytes = k * (w13[0].numel() + w2[0].numel()) * 2
        out = torch.zeros(1, device="cuda")
        layer = torch.compile(fused_experts, fullgraph=True, dynamic=True)
        bufs = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_CALLS)]
        variants = {}
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            variants["layer"] = capture(lambda: [layer(x, w13, w2, tw, d) for x, tw, d in sets])
        for chunk, block, warps in CONFIGS:
            for name, parts, pdl in (("read_1", 1, False), ("read_2", 2, False), ("read_2 pdl", 2, True)):
                variants[f"{name} {chunk}/{block}/{warps}w"] = capture(
                    lambda c=chunk, p=parts, b=block, w=warps, q=pdl: [read(w13, w2, d, out, c, p, b, w, q) for d in ids]
                )
        variants["sum"] = capture(lambda: [b.sum() for b in bufs])
        sol = nbytes / bandwidth * 1e6
        print(f"{shape} M=1: {nbytes / 1e6:.1f} MB, SoL {sol:.1f} µs", flush=True)
        for name, t in zip(variants, interleaved_times(list(variants.values()), 8, 5)):
            t = [us / GRAPH_CALLS for us in t]
            q1, med, q3 = statistics.quantiles(t, n=4)
            print(f"  {name}: {med:.2f} µs/call ({q1:.2f}-{q3:.2f}), {nbytes / med / 1e6:.2f} TB/s, {100 * sol / med:.0f}% of SoL", flush=True)
        del w13, w2, sets, bufs, variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b", "gpt-oss-120b"])
