"""The w4a16 grouped GEMM (cute_kernels/w4a16_grouped.py) on a Hopper GPU against float64 of the decoded mxfp4
weights, on fresh random codes, scales and rows: both tile kinds, every gated activation, gathered rows, biases, empty experts,
N and K off the tile sizes, scales above 2^1 and NaN, CUDA-graph capture, gpt-oss's shapes.

Outputs are poisoned with NaN first, so an element the kernel fails to write fails the test.
Run on the GPU host: python -m pytest -m gpu tests/cute_kernels/test_w4a16_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from moe_ops.activation import ACTIVATIONS, DEFAULTS
from moe_ops.quant import formats
from moe_ops.reference import apply_activation

pytestmark = pytest.mark.gpu

GATED = [kind for kind, (gated, _) in ACTIVATIONS.items() if gated]


@pytest.fixture(scope="module")
def iface():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from cute_kernels import interface

    return interface


def mxfp4(e, n, k, low=122, high=130):
    """Fresh random codes and e8m0 scales in [low, high] (127 is 2^0; above 128 takes the kernel's second multiply)."""
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    return codes, torch.randint(low, high + 1, (e, n, k // 32), dtype=torch.uint8, device="cuda")


def decode64(codes, scales):
    """float64 [E, N, K]: e2m1 value times 2^(s - 127); NaN for s = 255 (exact in float32 at these scales)."""
    return formats.dequantize(codes, "mxfp4", (1, 32), scales).double()


def act64(sums, kind, interleaved):
    """float64 act(gate, up) of [P, 2I] sums at the kind's default parameters."""
    return apply_activation(sums, kind, interleaved=interleaved, **{"alpha": 1.702, "limit": 7.0, **DEFAULTS.get(kind, {})})


def offsets_for(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def grouped_sums(a, w64, offsets, bias=None):
    """float64 [P, N]: each expert's rows times its decoded weights (+ bias [E, N]); and the |a| @ |w| bound."""
    off = offsets.tolist()
    sums = torch.full((a.shape[0], w64.shape[1]), float("nan"), dtype=torch.float64, device=a.device)
    bound = torch.zeros_like(sums)
    for x in range(w64.shape[0]):
        rows = a[off[x] : off[x + 1]].double()
        sums[off[x] : off[x + 1]] = rows @ w64[x].T + (0 if bias is None else bias[x].double())
        bound[off[x] : off[x + 1]] = rows.abs() @ w64[x].abs().T
    return sums, bound


COUNTS = [[1, 0, 0, 0], [3, 0, 17, 1, 0, 40, 2, 9], [0, 0, 130, 0, 7, 0, 0, 33]]


@pytest.mark.parametrize("counts", COUNTS, ids=["M1", "ragged", "empty-experts"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", [(200, 320), (256, 2880)])
@pytest.mark.parametrize("tok", [16, 32, 64, 128])
def test_rows_against_float64(iface, counts, with_bias, n, k, tok):
    from cute_kernels import w4a16_pack as wp

    e = len(counts)
    codes, scales = mxfp4(e, n, k)
    offsets = offsets_for(counts)
    p = int(sum(counts))
    a = torch.randn(p, k, device="cuda").bfloat16()
    bias = torch.randn(e, n, device="cuda") if with_bias else None
    packed = wp.pack_mxfp4_experts(codes, scales, kind="rows")
    out = torch.full((p, n), float("nan"), device="cuda")
    iface.w4a16_grouped_gemm(a, packed, offsets, n=n, bias=bias, out=out, tok=tok)
    want, bound = grouped_sums(a, decode64(codes, scales), offsets, bias)
    # float32 accumulation of exact products: a few ulps of the sum of magnitudes
    assert ((out.double() - want).abs() <= 1e-5 * bound + 1e-6 * want.abs()).all(), (out.double() - want).abs().max()


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("bias_dtype,tok", [(torch.float32, 16), (torch.bfloat16, 32), (torch.bfloat16, 64), (torch.float32, 128)])
def test_gated_against_float64(iface, activation, layout, bias_dtype, tok):
    """GEMM1 with its activation in the epilogue: bf16 act(gate + b_gate, up + b_up) of the float64 sums, the bias
    read as the layer holds it ([E, 2I] in the gate layout, float32 or bf16)."""
    from cute_kernels import w4a16_pack as wp

    counts = COUNTS[1]
    e, inter, k = len(counts), 96, 256
    codes, scales = mxfp4(e, 2 * inter, k)
    offsets = offsets_for(counts)
    p = int(sum(counts))
    a = torch.randn(p, k, device="cuda").bfloat16()
    bias = torch.randn(e, 2 * inter, device="cuda").to(bias_dtype)
    packed = wp.pack_mxfp4_experts(codes, scales, kind="gate_up", gate_layout=layout)
    out = torch.full((p, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    params = {"alpha": 1.702, "limit": 7.0, **DEFAULTS.get(activation, {})}
    iface.w4a16_grouped_gemm(a, packed, offsets, n=2 * inter, activation=activation, **params,
                             bias=bias, gate_layout=layout, out=out, tok=tok)  # fmt: skip
    sums, _ = grouped_sums(a, decode64(codes, scales), offsets, bias)
    want = act64(sums, activation, layout == "interleaved")
    err = (out.double() - want).abs()
    # bf16 rounding of the result (2^-9 relative) and the epilogue's fast sigmoid / erf / tanh
    assert (err <= 8e-3 * want.abs() + 1e-3 * want.abs().max()).all(), (activation, layout, err.max())


@pytest.mark.parametrize("tok", [64, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [202, 256])
def test_offloaded_rows_stores(iface, tok, out_dtype, n):
    """The store warps of 64- and 128-row m-tiles (w4a16_grouped.store_units) on the rows kind with biases: four
    columns a lane in one vector store where n is a multiple of 4 (256), one at a time where rows start off 16 bytes
    (202), in float32 and in bf16 (rows_bf16, the token sums' input)."""
    from cute_kernels import w4a16_pack as wp

    counts = COUNTS[2]
    e, k = len(counts), 320
    codes, scales = mxfp4(e, n, k)
    offsets = offsets_for(counts)
    p = int(sum(counts))
    a = torch.randn(p, k, device="cuda").bfloat16()
    bias = torch.randn(e, n, device="cuda")
    out = torch.full((p, n), float("nan"), device="cuda", dtype=out_dtype)
    iface.w4a16_grouped_gemm(a, wp.pack_mxfp4_experts(codes, scales, kind="rows"), offsets, n=n, bias=bias, out=out,
                             out_dtype=out_dtype, tok=tok)  # fmt: skip
    want, bound = grouped_sums(a, decode64(codes, scales), offsets, bias)
    rounding = 2.0**-8 if out_dtype == torch.bfloat16 else 1e-6
    assert ((out.double() - want).abs() <= 1e-5 * bound + rounding * want.abs()).all(), (out.double() - want).abs().max()


@pytest.mark.parametrize("tok", [64, 128])
@pytest.mark.parametrize("inter", [97, 96])
def test_offloaded_gated_stores(iface, tok, inter):
    """The store warps on gated tiles: bf16 pairs a lane in one 4-byte store where I is even (96), one column at a time
    where it is odd (97), the biases interleaved as gpt-oss holds them."""
    from cute_kernels import w4a16_pack as wp

    counts = COUNTS[2]
    e, k = len(counts), 256
    codes, scales = mxfp4(e, 2 * inter, k)
    offsets = offsets_for(counts)
    p = int(sum(counts))
    a = torch.randn(p, k, device="cuda").bfloat16()
    bias = torch.randn(e, 2 * inter, device="cuda")
    packed = wp.pack_mxfp4_experts(codes, scales, kind="gate_up", gate_layout="interleaved")
    out = torch.full((p, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    iface.w4a16_grouped_gemm(a, packed, offsets, n=2 * inter, activation="swigluoai", bias=bias, gate_layout="interleaved",
                             out=out, tok=tok)  # fmt: skip
    sums, _ = grouped_sums(a, decode64(codes, scales), offsets, bias)
    want = act64(sums, "swigluoai", True)
    err = (out.double() - want).abs()
    assert (err <= 8e-3 * want.abs() + 1e-3 * want.abs().max()).all(), err.max()


def routed(m, counts):
    """int32 [P] gather of a routing with these rows per expert: each grouped row's source token in [0, m), tokens
    repeated and in no order (as a plan's gather is, grouped by expert)."""
    return torch.randint(0, m, (int(sum(counts)),), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("counts", COUNTS, ids=["M1", "ragged", "empty-experts"])
@pytest.mark.parametrize("k", [320, 2880])
@pytest.mark.parametrize("tok", [16, 32, 64, 128])
@pytest.mark.parametrize("in_kernel", [True, False], ids=["in-kernel", "index-select"])
def test_gathered_against_float64(iface, counts, k, tok, in_kernel):
    """GEMM1 reading its rows from the tokens through gather (cp.async in the kernel, or torch's index_select
    and TMA): the result of the grouped rows x[gather], K off the 128-column k-tile (chunks past K zero-filled),
    rows past each expert not written."""
    from cute_kernels import w4a16_pack as wp

    e, inter, m = len(counts), 96, 7
    codes, scales = mxfp4(e, 2 * inter, k)
    offsets = offsets_for(counts)
    gather = routed(m, counts)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(e, 2 * inter, device="cuda").bfloat16()
    packed = wp.pack_mxfp4_experts(codes, scales, kind="gate_up", gate_layout="concat")
    out = torch.full((gather.shape[0], inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    iface.w4a16_grouped_gemm(x, packed, offsets, n=2 * inter, activation="silu", bias=bias, gate_layout="concat",
                             out=out, tok=tok, gather=gather, gather_in_kernel=in_kernel)  # fmt: skip
    sums, _ = grouped_sums(x[gather.long()], decode64(codes, scales), offsets, bias)
    want = act64(sums, "silu", False)
    err = (out.double() - want).abs()
    assert (err <= 8e-3 * want.abs() + 1e-3 * want.abs().max()).all(), err.max()


def test_scales_above_two_and_nan(iface):
    """Scales above 2^1 (e8m0 129..160) take the second multiply; a weight row with a NaN scale (255) gives a NaN
    column and leaves every other column exact."""
    from cute_kernels import w4a16_pack as wp

    counts = [5, 16, 3]
    e, n, k = len(counts), 128, 256
    codes, scales = mxfp4(e, n, k, low=100, high=160)
    scales[1, 7, 3] = 255
    offsets = offsets_for(counts)
    a = torch.randn(sum(counts), k, device="cuda").bfloat16() * 2.0**-20  # keeps 2^33-scaled sums finite in float32
    out = torch.full((sum(counts), n), float("nan"), device="cuda")
    iface.w4a16_grouped_gemm(a, wp.pack_mxfp4_experts(codes, scales, kind="rows"), offsets, n=n, out=out)
    want, bound = grouped_sums(a, decode64(codes, scales), offsets)
    nan_col = torch.zeros_like(out, dtype=torch.bool)
    nan_col[5:21, 7] = True
    assert (out.isnan() == nan_col).all()
    ok = ~nan_col
    assert ((out.double() - want).abs()[ok] <= 1e-5 * bound[ok]).all()


@pytest.mark.parametrize("early,tok2", [(False, None), (True, None), (True, 128)], ids=["waits", "early", "early-tok128"])
def test_cuda_graph_gemm1_then_gemm2(iface, early, tok2):
    """GEMM1 (gathering) then GEMM2 captured in one CUDA graph, each launched as a programmatic dependent of the
    kernel before it: GEMM2 must read GEMM1's complete output on every replay, on new tokens; also with its offsets
    and first weight chunks read before its wait (early_weights), at the rule's m-tile and at 128 rows (the offloaded
    epilogue)."""
    from cute_kernels import w4a16_pack as wp

    counts = COUNTS[1]
    e, hidden, inter, m = len(counts), 256, 192, 19
    c13, s13 = mxfp4(e, 2 * inter, hidden)
    c2, s2 = mxfp4(e, hidden, inter)
    p13 = wp.pack_mxfp4_experts(c13, s13, kind="gate_up", gate_layout="concat")
    p2 = wp.pack_mxfp4_experts(c2, s2, kind="rows")
    offsets, gather = offsets_for(counts), routed(m, counts)
    x = torch.randn(m, hidden, device="cuda").bfloat16()
    h = torch.empty(gather.shape[0], inter, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(gather.shape[0], hidden, device="cuda")

    def layer():
        iface.w4a16_grouped_gemm(x, p13, offsets, n=2 * inter, activation="silu", out=h, gather=gather, gather_in_kernel=True)
        iface.w4a16_grouped_gemm(h, p2, offsets, n=hidden, out=y, tok=tok2, early_weights=early)

    layer()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    for _ in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32).bfloat16())
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        sums, _ = grouped_sums(x[gather.long()], decode64(c13, s13), offsets)
        want_h = act64(sums, "silu", False)
        assert ((h.double() - want_h).abs() <= 8e-3 * want_h.abs() + 1e-3 * want_h.abs().max()).all()
        want_y, bound = grouped_sums(h, decode64(c2, s2), offsets)  # on the kernel's own h: exact products
        assert ((y.double() - want_y).abs() <= 1e-5 * bound).all()


def test_cuda_graph_replays_on_new_rows(iface):
    """Captured in a CUDA graph (the launch goes to torch's current stream), replayed on new values of a."""
    from cute_kernels import w4a16_pack as wp

    counts = COUNTS[1]
    e, n, k = len(counts), 256, 512
    codes, scales = mxfp4(e, n, k)
    packed = wp.pack_mxfp4_experts(codes, scales, kind="rows")
    offsets = offsets_for(counts)
    a = torch.randn(sum(counts), k, device="cuda").bfloat16()
    out = torch.empty(sum(counts), n, device="cuda")
    iface.w4a16_grouped_gemm(a, packed, offsets, n=n, out=out)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iface.w4a16_grouped_gemm(a, packed, offsets, n=n, out=out)
    for _ in range(2):
        a.copy_(torch.randn_like(a, dtype=torch.float32).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, bound = grouped_sums(a, decode64(codes, scales), offsets)
        assert ((out.double() - want).abs() <= 1e-5 * bound).all()


@pytest.mark.parametrize("m", [1, 16, 1024])
def test_gpt_oss_shapes(iface, m):
    """gpt-oss-120b's expert GEMMs (E = 128, top-4, H = I = 2880): GEMM1 with swigluoai on interleaved gate/up rows
    and biases, then GEMM2 with its bias, on a routing of m tokens (1024: 32 rows per expert, 64-row m-tiles)."""
    from cute_kernels import w4a16_pack as wp

    e, top_k, hidden, inter = 128, 4, 2880, 2880
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(m)])
    counts = torch.bincount(ids.flatten(), minlength=e).tolist()
    offsets = offsets_for(counts)
    # the plan's gather: pairs grouped by expert (stable), each row the pair's token
    gather = (torch.sort(ids.flatten(), stable=True).indices // top_k).to(device="cuda", dtype=torch.int32)
    c13, s13 = mxfp4(e, 2 * inter, hidden, 118, 122)
    c2, s2 = mxfp4(e, hidden, inter, 118, 122)
    b13, b2 = torch.randn(e, 2 * inter, device="cuda"), torch.randn(e, hidden, device="cuda").bfloat16()
    x = torch.randn(m, hidden, device="cuda").bfloat16()
    h = iface.w4a16_grouped_gemm(x, wp.pack_mxfp4_experts(c13, s13, kind="gate_up", gate_layout="interleaved"), offsets,
                                 n=2 * inter, activation="swigluoai", bias=b13, gate_layout="interleaved", gather=gather)  # fmt: skip
    y = iface.w4a16_grouped_gemm(h, wp.pack_mxfp4_experts(c2, s2, kind="rows"), offsets, n=hidden, bias=b2)
    sums, _ = grouped_sums(x[gather.long()], decode64(c13, s13), offsets, b13)
    want_h = act64(sums, "swigluoai", True)
    assert ((h.double() - want_h).norm() / want_h.norm()).item() < 4e-3
    want_y, bound = grouped_sums(h, decode64(c2, s2), offsets, b2)  # GEMM2 on the kernel's own bf16 h: exact products
    assert ((y.double() - want_y).abs() <= 1e-5 * bound).all()
