"""The CuTe DSL kernels on a Hopper GPU against moe_ops' reference ops (bf16 and fp16, float32 accumulation).

Outputs are poisoned with NaN before each run, so an element the kernel fails to write fails the test.
Run on the GPU host: python -m pytest -m gpu tests/cute_kernels
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from cute_kernels import tiles  # host-side rules only: imports no CuTe DSL
from moe_ops.bench import SHAPES, TOKENS  # the benchmarked models' (E, top-k, H, I) and token counts

from .gpu_cases import reference, rel_err, routing, weights

pytestmark = pytest.mark.gpu
TOL = 1e-2


@pytest.fixture(scope="module")
def interface():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from cute_kernels import interface

    return interface


def run_layer(interface, x, w13, w2, tw, plan, activation="silu", alpha=1.702, limit=7.0, layout="concat", b13=None, b2=None, tiles=(None, None), early=True):
    offsets, gather, inverse = plan
    e, n, h = w13.shape
    inter_dim = w2.shape[2]
    inter = torch.full((gather.shape[0], inter_dim), float("nan"), device=x.device, dtype=x.dtype)
    out = torch.full((tw.shape[0], h), float("nan"), device=x.device, dtype=x.dtype)
    interface.gate_up(x, w13, b13, offsets, gather, activation=activation, alpha=alpha, limit=limit, gate_layout=layout, out=inter, tiles=tiles[0])
    # gate_up, launched just before, writes neither w2 nor the offsets: GEMM2 may load weights early.
    interface.down_reduce(inter, w2, b2, offsets, tw, inverse, out=out, tiles=tiles[1], weights_early=early)
    return inter, out


def check(interface, m, e, k, h, i, skew=0.0, activation="silu", layout="concat", bias=False, w=None, tiles=(None, None), early=True,
          dtype=torch.bfloat16, bias_dtype=None, alpha=1.702, limit=7.0):  # fmt: skip
    """The layer through the kernels against the reference ops, in `dtype` (biases in bias_dtype, else
    dtype), with the activation's alpha and limit; returns the output's relative error."""
    w13, w2 = w if w is not None else weights(e, h, i, dtype=dtype, gated=activation != "relu2")
    x = torch.randn(m, h, device="cuda", dtype=dtype)
    tw, ti = routing(m, e, k, skew=skew)
    b13 = torch.randn(e, w13.shape[1], device="cuda", dtype=bias_dtype or dtype) / 10 if bias else None
    b2 = torch.randn(e, h, device="cuda", dtype=bias_dtype or dtype) / 10 if bias else None
    ref_inter, ref_out, plan = reference(x, w13, w2, tw, ti, activation, alpha, limit, layout == "interleaved", b13=b13, b2=b2)
    inter, out = run_layer(
        interface, x, w13, w2, tw, plan, activation, alpha, limit, layout=layout, b13=b13, b2=b2, tiles=tiles, early=early
    )
    valid = int(plan[0][-1])
    assert not inter[:valid].isnan().any(), "gate_up left rows unwritten"
    assert not out.isnan().any(), "down_reduce left elements unwritten"
    assert rel_err(inter[:valid], ref_inter[:valid]) < TOL
    err = rel_err(out, ref_out)
    assert err < TOL, f"relative error {err:.3e}"
    return err


@pytest.mark.parametrize("name", list(SHAPES))
def test_model_shapes(interface, name):
    e, k, h, i = SHAPES[name]
    w = weights(e, h, i)
    errs = {m: check(interface, m, e, k, h, i, w=w) for m in TOKENS}
    print(name, {m: f"{v:.1e}" for m, v in errs.items()})


# Fresh shapes each run, drawn at collection from their own seed (the per-test MOE_OPS_SEED of
# tests/conftest.py only draws the data); each case prints it with its shape, and MOE_OPS_SHAPE_SEED=<seed>
# draws the same shapes again.
SHAPE_SEED = int(os.environ.get("MOE_OPS_SHAPE_SEED", 0)) or int.from_bytes(os.urandom(4), "little")


def _random_cases(n=16):
    rng = random.Random(SHAPE_SEED)
    cases = []
    for _ in range(n):
        e = rng.choice([1, 2, 3, 7, 16, 60, 128, 256])
        k = rng.randint(1, min(8, e))
        h = 64 * rng.randint(1, 48)
        i = 64 * rng.randint(1, 40)
        m = rng.choice([0, 1, 2, 5, 33, 257, 1000, 4096, 16384])
        cases.append((m, e, k, h, i, rng.choice([0.0, 0.0, 0.9])))
    return cases


@pytest.mark.parametrize("case", _random_cases())
def test_random_shapes(interface, case):
    m, e, k, h, i, skew = case
    print(f"(m, e, k, h, i, skew) = {case} (MOE_OPS_SHAPE_SEED={SHAPE_SEED})")
    check(interface, m, e, k, h, i, skew=skew)


@pytest.mark.parametrize(
    "activation,layout,bias",
    [("silu", "concat", False), ("gelu", "concat", True), ("gelu_tanh", "interleaved", False),
     ("swigluoai", "interleaved", True), ("swigluoai", "concat", False), ("relu2", "none", True)],
)  # fmt: skip
def test_epilogues(interface, activation, layout, bias):
    check(interface, 300, 16, 4, 576, 320, activation=activation, layout=layout, bias=bias)


@pytest.mark.parametrize(
    "activation,layout,bias",
    [("silu_clamped", "concat", True), ("silu_clamped", "interleaved", False), ("swigluoai", "interleaved", True),
     ("swigluoai", "concat", False)],
)  # fmt: skip
def test_clamped_epilogues_where_the_clamps_bind(interface, activation, layout, bias):
    """The two clamped kinds with limit 0.5 and alpha 1.2: the gate and up sums (~N(0, 1) here) are
    mostly clamped, which the default limit of 7 never does, so each kind's clamps and (swigluoai's)
    alpha and + 1 are what the comparison checks; the reference itself moves by far more than TOL
    between the two limits."""
    check(interface, 300, 16, 4, 576, 320, activation=activation, layout=layout, bias=bias, alpha=1.2, limit=0.5)
    w13, w2 = weights(8, 256, 128)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(40, 8, 2)
    interleaved = layout == "interleaved"
    clamped = reference(x, w13, w2, tw, ti, activation, 1.2, 0.5, interleaved)[1]
    assert rel_err(clamped, reference(x, w13, w2, tw, ti, activation, 1.2, 7.0, interleaved)[1]) > 10 * TOL


@pytest.mark.parametrize("layout,bias", [("concat", True), ("interleaved", False)])
def test_softcapped_epilogue_where_the_caps_bend(interface, layout, bias):
    """Inkling-2's swiglu_softcapped with caps 0.5 (gate) and 0.75 (up) on sums of ~N(0, 1): most values
    are bent, so both caps and the sigmoid of the raw gate are what the comparison checks; the
    reference moves by far more than TOL between these caps and Inkling-2's own (4 and 25). Large sums
    (x times 30) drive tanh and the sigmoid to their limits without a NaN."""
    check(interface, 300, 16, 4, 576, 320, activation="swiglu_softcapped", layout=layout, bias=bias, alpha=0.5, limit=0.75)
    w13, w2 = weights(8, 256, 128)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(40, 8, 2)
    interleaved = layout == "interleaved"
    capped = reference(x, w13, w2, tw, ti, "swiglu_softcapped", 0.5, 0.75, interleaved)[1]
    assert rel_err(capped, reference(x, w13, w2, tw, ti, "swiglu_softcapped", 4.0, 25.0, interleaved)[1]) > 10 * TOL
    check(interface, 40, 8, 2, 256, 128, activation="swiglu_softcapped", layout=layout, alpha=0.5, limit=0.75,
          w=(w13 * 30, w2))  # fmt: skip


@pytest.mark.parametrize(
    "activation,layout,bias,alpha,limit",
    [("silu", "concat", True, 1.702, 7.0), ("swigluoai", "interleaved", True, 1.702, 7.0), ("relu2", "none", False, 1.702, 7.0),
     ("silu_clamped", "concat", False, 1.702, 0.5), ("swiglu_softcapped", "interleaved", False, 0.5, 0.75)],
)  # fmt: skip
def test_every_tile_shape(interface, activation, layout, bias, alpha, limit):
    """Every (tile_m, tile_n) choose_tiles can pick, for GEMM1 and GEMM2, with ragged experts (some
    above and some below a 64-row tile); GEMM2 with and without its early weight loads. silu_clamped
    with a limit that binds and swiglu_softcapped with caps that bend: each tile shape's epilogue
    (swapped, split-K, 64- and 128-row) computes the activation in its own code."""
    gate, down = interface.tile_shapes(layout), interface.tile_shapes("none")
    for j in range(max(len(gate), len(down))):
        tiles = (gate[j % len(gate)], down[j % len(down)])
        for early in (True, False):
            check(interface, 200, 16, 3, 576, 320, activation=activation, layout=layout, bias=bias, tiles=tiles, early=early,
                  alpha=alpha, limit=limit)  # fmt: skip


@pytest.mark.parametrize(
    "activation,layout,bias_dtype",
    [("silu", "concat", None), ("gelu", "interleaved", torch.float16), ("swigluoai", "interleaved", torch.float32),
     ("relu2", "none", torch.float16)],
)  # fmt: skip
def test_float16(interface, activation, layout, bias_dtype):
    """fp16 activations and weights (their own kernel variants: f16 WGMMAs, f16 conversions in the
    epilogues and the token sum), biases in fp16 or fp32: the rule's 64-row tiles (M = 1, 40) and
    128-row tiles (M = 1000), then the swapped tiles (weights on WGMMA's M side) at M = 40."""
    e, k, h, i = 16, 4, 576, 320
    w = weights(e, h, i, dtype=torch.float16, gated=activation != "relu2")
    kw = dict(activation=activation, layout=layout, bias=bias_dtype is not None, w=w, dtype=torch.float16, bias_dtype=bias_dtype)
    for m in (1, 40, 1000):
        check(interface, m, e, k, h, i, **kw)
    swapped = tiles.SWAP_TILE if layout in tiles.SWAP_LAYOUTS else tiles.SPLIT_K_TILE
    check(interface, 40, e, k, h, i, tiles=(swapped, tiles.SWAP_TILE), **kw)


@pytest.mark.parametrize("i", [64, 128, 320])
def test_deferred_stores(interface, i):
    """GEMM2's 128-row tiles store each tile's outputs under the next tile's first k-tiles, one chunk
    per k-tile: with K = I of 1, 2 and 5 k-tiles against 4 chunks, over several tiles per CTA (32
    n-tiles x 8 m-tiles on at most 132 SMs), with and without the early weights."""
    for early in (True, False):
        check(interface, 2000, 4, 2, 8192, i, activation="relu2", layout="none", tiles=((128, 256), (128, 256)), early=early)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_expert_ids_hint_changes_nothing(interface, layout):
    """GEMM1's weight hint at M = 1 (moe_gemm.py) only asks L2 for bytes: for every tile GEMM1 can
    use, the intermediate is bit-identical with the token's ids (int32 and int64), with wrong ids
    (other experts, duplicates, out of range) and without any, and matches the reference."""
    e, k, h, i = 16, 4, 2816, 320  # h >= LONG_K, so M = 1 may pick the swapped split-K tiles
    w13, _ = weights(e, h, i)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(1, e, k)
    ref_inter, _, (offsets, gather, _) = reference(x, w13, weights(e, h, i)[1], tw, ti, interleaved=layout == "interleaved")
    hints = {
        "int32": ti, "int64": ti.long(), "other experts": (ti + 1) % e, "duplicates": ti[:, :1].repeat(1, k),
        "out of range": ti + e, "negative": -ti - 1,
    }  # fmt: skip
    for tile in tiles.tile_shapes(layout):
        kw = dict(activation="silu", alpha=1.702, limit=7.0, gate_layout=layout, tiles=tile)
        plain = interface.gate_up(x, w13, None, offsets, gather, **kw)
        assert rel_err(plain, ref_inter) < TOL, tile
        for name, ids in hints.items():
            hinted = interface.gate_up(x, w13, None, offsets, gather, expert_ids=ids, **kw)
            assert torch.equal(hinted, plain), (tile, name)


def test_experts_without_tokens(interface):
    # 64 experts, 5 tokens: most experts receive nothing.
    check(interface, 5, 64, 2, 512, 256)


@pytest.mark.parametrize("k", [9, 12, 13])
def test_top_k_past_the_early_pairs(interface, k):
    # The token sum reads the first 8 pairs of a token before its wait and the rest after it, 4 at a
    # time: a partial last group (9, 13) and whole groups (12).
    check(interface, 37, 16, k, 512, 256)


def test_dropped_pairs_contribute_nothing(interface):
    """Pairs whose expert lives on another rank (expert_map -1) sort past offsets[E]: GEMM2 never writes
    their grouped rows and the token sum must not read them; the first dropped pair's row is offsets[E]
    itself, which a bound of <= instead of < would read. None of the other cases drops a pair. GEMM2's
    rows are allocated inside down_reduce: a block of their size filled with NaN is freed just before,
    so that the caching allocator most likely hands it back and a row read unwritten shows as NaN."""
    e_global, e, k, h, i, m = 16, 8, 4, 512, 256, 37
    expert_map = torch.full((e_global,), -1, dtype=torch.int32, device="cuda")
    expert_map[::2] = torch.arange(e, dtype=torch.int32, device="cuda")  # the even experts are local
    w13, w2 = weights(e, h, i)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(m, e_global, k)
    _, ref_out, (offsets, gather, inverse) = reference(x, w13, w2, tw, ti, expert_map=expert_map)
    assert 0 < int(offsets[-1]) < m * k, "no pair dropped, or every pair"
    inter = interface.gate_up(x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0, gate_layout="concat")
    out = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.full((m * k, h), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed at once: GEMM2's rows' block
    interface.down_reduce(inter, w2, None, offsets, tw, inverse, out=out)
    assert not out.isnan().any(), "a dropped pair's row was read, or an element left unwritten"
    assert rel_err(out, ref_out) < TOL


def test_deterministic(interface):
    e, k, h, i, m = 32, 4, 1024, 512, 777
    w13, w2 = weights(e, h, i)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(m, e, k)
    _, _, plan = reference(x, w13, w2, tw, ti)
    outs = [run_layer(interface, x, w13, w2, tw, plan)[1] for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("early", [True, False])
def test_cuda_graph_replay_matches_eager(interface, early):
    """New routing each replay: a GEMM2 reading stale offsets (early weight loads) would differ."""
    from moe_ops.plan import routing_plan

    e, k, h, i, m = 16, 2, 512, 256, 64
    w13, w2 = weights(e, h, i)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(m, e, k)

    def layer():
        plan = routing_plan(ti, e, None)
        inter = interface.gate_up(x, w13, None, plan[0], plan[1], activation="silu", alpha=1.702, limit=7.0, gate_layout="concat")
        return interface.down_reduce(inter, w2, None, plan[0], tw, plan[2], weights_early=early)

    layer()  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for _ in range(4):
        new_w, new_ids = routing(m, e, k)
        tw.copy_(new_w)
        ti.copy_(new_ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer()), "graph replay differs from eager"
        assert rel_err(out, reference(x, w13, w2, tw, ti)[1]) < TOL, "graph replay differs from the reference ops"


@pytest.mark.parametrize("producer", ["current_stream", "other_stream"])
def test_launches_wait_for_inputs_written_late(interface, producer):
    """New inputs are copied in behind a long sleep, and the layer must read them, not the old ones.
    current_stream: the copies and the layer on one side stream; the plan, both GEMMs and the token sum must
    run on that stream, after the copies (a launch on any other stream would run at once and read the old
    inputs, and would escape a CUDA-graph capture the same way). other_stream: two-batch overlap; the copies
    on a producer stream that the layer's stream waits for through an event. The plan and the GEMMs launch
    as programmatic dependents of the kernel before them on their own stream (a short sleep that ends long
    before the producer); the event must still hold them back."""
    from moe_ops.plan import routing_plan

    e, k, h, i, m = 16, 2, 512, 256, 64
    w13, w2 = weights(e, h, i)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(m, e, k)
    new_x, (new_tw, new_ti) = torch.randn_like(x), routing(m, e, k)

    def layer():
        plan = routing_plan(ti, e, None)
        inter = interface.gate_up(x, w13, None, plan[0], plan[1], activation="silu", alpha=1.702, limit=7.0, gate_layout="concat")
        return interface.down_reduce(inter, w2, None, plan[0], tw, plan[2], weights_early=True)

    def write_new_inputs():
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles
        x.copy_(new_x)
        tw.copy_(new_tw)
        ti.copy_(new_ti)

    old_out = layer()  # also compiles
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    if producer == "current_stream":
        with torch.cuda.stream(side):
            write_new_inputs()
            out = layer()
    else:
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(1000)
        with torch.cuda.stream(side):
            write_new_inputs()
        consumer.wait_stream(side)
        with torch.cuda.stream(consumer):
            out = layer()
    torch.cuda.synchronize()
    assert rel_err(out, reference(new_x, w13, w2, new_tw, new_ti)[1]) < TOL
    assert rel_err(old_out, out) > 0.1  # new inputs, a different output: the check above can fail


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m,e,k,h,i",
    [(1, 16, 8, 4096, 256), (37, 8, 2, 576, 320), (300, 16, 4, 8192, 128), (5, 4, 3, 64, 64), (0, 4, 2, 256, 128)],
)
def test_post_expert_norm(interface, m, e, k, h, i, norm_dtype):
    """down_reduce with a post-expert norm (norm_token_sum.py) against the reference ops on the same
    intermediate: GEMM2, moe_ops::post_expert_norm, weighted_reduce. Widths of one to four 16-byte chunks
    per thread (a partial last one at H = 576 and 64, the most at H = MAX_H = 8192), k up to 8, M = 0 to
    300, one expert on another rank (dropped pairs). Deterministic, and far from the same sum without
    the norm."""
    from moe_ops.expert_norm import post_expert_norm
    from moe_ops.gemm import grouped_gemm
    from moe_ops.plan import routing_plan
    from moe_ops.reduce import weighted_reduce

    w13, w2 = weights(e, h, i)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(m, e, k)
    expert_map = torch.arange(e, device="cuda", dtype=torch.int32)
    expert_map[1] = -1
    offsets, gather, inverse = routing_plan(ti, e, expert_map)
    nw = (torch.randn(h, device="cuda") * 0.3).to(norm_dtype)
    inter = interface.gate_up(x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0, gate_layout="concat")
    out = interface.down_reduce(inter, w2, None, offsets, tw, inverse, norm_weight=nw, norm_eps=1e-6)
    y = grouped_gemm(inter, None, None, "none", [-1, -1], w2, None, None, None, "none", [-1, -1], None, offsets, None, x.dtype)
    want = weighted_reduce(post_expert_norm(y, nw, 1e-6), tw, inverse, offsets)
    assert not out.isnan().any()
    assert rel_err(out, want) < TOL, rel_err(out, want)
    assert torch.equal(out, interface.down_reduce(inter, w2, None, offsets, tw, inverse, norm_weight=nw, norm_eps=1e-6))
    if m:
        plain = interface.down_reduce(inter, w2, None, offsets, tw, inverse)
        assert rel_err(plain, want) > 10 * TOL
