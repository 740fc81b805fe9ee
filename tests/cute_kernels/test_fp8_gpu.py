"""The kernels with float8_e4m3fn operands (moe_ops/fp8_kernels.py's GEMMs) on a Hopper GPU, against a
float64 reference of the same codes and scales.

Outputs are poisoned with NaN first, so an element the kernel fails to write fails the test. K = 576 and
320 are not multiples of the fp8 k-tile (128): the last k-tile is half past K and must read as zeros.
Run on the GPU host: python -m pytest -m gpu tests/cute_kernels/test_fp8_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from moe_ops.plan import routing_plan

from .gpu_cases import rel_err, routing

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
# The bf16 output's rounding (2**-9 relative per element, about 1.7e-3 in norm) with room for fp32 sums.
TOL = 6e-3


@pytest.fixture(scope="module")
def interface():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    from cute_kernels import interface

    return interface


def _codes(shape, scale_shape):
    """Random e4m3 codes over most of their range and float32 scales (never zeros)."""
    codes = (torch.randn(shape, device="cuda") * 100).clamp(-448, 448).to(FP8)
    return codes, torch.rand(scale_shape, device="cuda") * 0.01 + 0.001


def _values(codes, scale):
    """codes with one scale per row (or one per tensor; per expert, [E, ...], for 3-D codes) in float64."""
    shape = (codes.shape[0], -1, 1) if codes.dim() == 3 else (-1, 1)
    return codes.double() * scale.double().reshape(shape)


def _block_values(codes, scale):
    """codes [..., R, C] with one scale per 128 x 128 block ([..., cdiv(R, 128), cdiv(C, 128)]; rows of
    1 x 128 groups: [R, cdiv(C, 128)] with R rows of their own) in float64."""
    rows, cols = codes.shape[-2:]
    full = scale.double()
    if full.shape[-2] != rows:
        full = full.repeat_interleave(128, dim=-2)[..., :rows, :]
    full = full.repeat_interleave(128, dim=-1)[..., :cols]
    return codes.double() * full


def _gemm64(a, w, offsets, rows):
    """Row r of the grouped GEMM in float64: a[rows[r]] @ w[e(r)].T for the expert e(r) whose rows hold r."""
    out = torch.zeros(rows.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[rows[lo:hi].long()] @ w[e].T
    return out


def _check_every_tile(interface, activation, layout, bias, scale_shapes, block):
    """The layer (M = 200, E = 16, k = 3, H = 576, I = 320: K and N not multiples of 128, ragged experts)
    through gate_up and down_reduce on fp8 codes with every tile shape the kernels take for these scales
    (fp8_tile_shapes), against float64. scale_shapes(m, e, n, h, i, rows): the shapes of x's, w13's,
    w2's and GEMM2's input's scales; block: 1x128 / 128x128 block scales (else per row or per tensor)."""
    m, e, k, h, i = 200, 16, 3, 576, 320
    n = i if layout == "none" else 2 * i
    tw, ti = routing(m, e, k, skew=0.3)
    offsets, gather, inverse = routing_plan(ti, e, None)
    rows, valid = gather.shape[0], int(offsets[-1])
    sx, s13_shape, s2_shape, sa2 = scale_shapes(m, e, n, h, i, rows)
    w13, s13 = _codes((e, n, h), s13_shape)
    w2, s2 = _codes((e, h, i), s2_shape)
    x, xs = _codes((m, h), sx)
    a2, a2s = _codes((rows, i), sa2)  # GEMM2's input
    b13 = torch.randn(e, n, device="cuda") if bias else None
    b2 = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) if bias else None
    values = _block_values if block else _values
    pre = _gemm64(values(x, xs), values(w13, s13), offsets, gather)
    y = _gemm64(values(a2, a2s), values(w2, s2), offsets, torch.arange(rows, device="cuda"))
    if bias:
        pre += _pre_bias(b13, offsets, n)
        y += _pre_bias(b2, offsets, h)
    want_h = _activation64(pre, activation, layout)
    want_out = _token_sum64(y, tw, inverse)
    gate, down = interface.fp8_tile_shapes(layout), interface.fp8_tile_shapes("none")
    for j in range(max(len(gate), len(down))):
        tiles = (gate[j % len(gate)], down[j % len(down)])
        got_h = torch.full((rows, i), float("nan"), device="cuda", dtype=torch.bfloat16)
        interface.gate_up(
            x, w13, b13, offsets, gather, activation=activation, alpha=1.702, limit=7.0, gate_layout=layout, out=got_h,
            tiles=tiles[0], a_scale=xs, w_scale=s13, out_dtype=torch.bfloat16, block_scales=block,
        )  # fmt: skip
        assert not got_h[:valid].isnan().any(), ("gate_up left rows unwritten", tiles)
        assert rel_err(got_h[:valid], want_h[:valid]) < TOL, (tiles, rel_err(got_h[:valid], want_h[:valid]))
        got = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        interface.down_reduce(a2, w2, b2, offsets, tw, inverse, out=got, tiles=tiles[1], a_scale=a2s, w_scale=s2,
                              out_dtype=torch.bfloat16, block_scales=block)  # fmt: skip
        assert not got.isnan().any(), ("down_reduce left elements unwritten", tiles)
        assert rel_err(got, want_out) < TOL, (tiles, rel_err(got, want_out))


CASES = [
    # (activation, layout, bias, per-row activation scales, per-channel weight scales)
    ("silu", "concat", False, True, False),
    ("silu", "concat", True, True, True),
    ("swigluoai", "interleaved", True, False, False),
    ("swigluoai", "interleaved", False, True, True),
    ("relu2", "none", False, True, True),
]


@pytest.mark.parametrize("activation,layout,bias,per_row,per_channel", CASES)
def test_every_tile_shape(interface, activation, layout, bias, per_row, per_channel):
    """GEMM1 (gathered codes, scales per token or per tensor, per weight row or per expert) and GEMM2
    (grouped rows, scales per row; per weight row or per expert), every tile shape. Per-channel scales
    check each tile kind's map from accumulator to weight row ([gate; up] parts, interleaved pairs, the
    paired split-K rows)."""

    def shapes(m, e, n, h, i, rows):
        return (m, 1) if per_row else (1,), (e, n, 1) if per_channel else (e, 1, 1), (e, h) if per_channel else (e,), (rows, 1)

    _check_every_tile(interface, activation, layout, bias, shapes, block=False)


BLOCK_CASES = [("silu", "concat", True), ("swigluoai", "interleaved", False), ("relu2", "none", True)]


@pytest.mark.parametrize("activation,layout,bias", BLOCK_CASES)
def test_block_scales_every_tile_shape(interface, activation, layout, bias):
    """Block scales (1x128 activation groups, 128x128 weight blocks: each k-tile's products scaled in the
    main loop), every tile shape the kernels take for them (no 128 x 256); the last weight block and the
    last K block partial."""

    def shapes(m, e, n, h, i, rows):
        kb1, kb2 = -(-h // 128), -(-i // 128)
        return (m, kb1), (e, -(-n // 128), kb1), (e, -(-h // 128), kb2), (rows, kb2)

    _check_every_tile(interface, activation, layout, bias, shapes, block=True)


@pytest.mark.parametrize("gemm,k_dim", [("down_reduce", 14336), ("gate_up", 7168)])
def test_error_does_not_grow_with_k(interface, gemm, k_dim):
    """Long reductions (mixtral's I, DeepSeek-V3's H) of same-sign products, whose partial sums grow
    with K: the hard case for the tensor cores' own fp8 accumulation, which lost 9.8% at K = 14336
    (bench/fp8_accuracy.py). Every tile shape, per-row scales; the error must stay at bf16's rounding."""
    m, e, n = 64, 4, 256
    x = (torch.randn(m, k_dim, device="cuda").abs() * 100).clamp(max=448).to(FP8)
    w = ((torch.randn(e, n, k_dim, device="cuda") + 0.5) * 100).clamp(-448, 448).to(FP8)
    xs, ws = torch.rand(m, 1, device="cuda") * 0.01 + 0.001, torch.rand(e, n, device="cuda") * 0.01 + 0.001
    ids = torch.randint(0, e, (m, 1), device="cuda", dtype=torch.int32)
    offsets, gather, inverse = routing_plan(ids, e, None)
    want = _gemm64(_values(x, xs), _values(w, ws), offsets, gather)[inverse.long()]  # token order
    layout = "none"
    for tiles in interface.fp8_tile_shapes(layout):
        if gemm == "gate_up":
            got = interface.gate_up(
                x, w, None, offsets, gather, activation="relu2", alpha=1.702, limit=7.0, gate_layout=layout, tiles=tiles,
                a_scale=xs, w_scale=ws, out_dtype=torch.bfloat16,
            )[inverse.long()]  # fmt: skip
            ref = torch.relu(want) ** 2
        else:
            grouped, row_scale = torch.empty_like(x), torch.empty_like(xs)
            grouped[inverse.long()], row_scale[inverse.long()] = x, xs
            got = interface.down_reduce(grouped, w, None, offsets, torch.ones(m, 1, device="cuda"), inverse, tiles=tiles,
                                        a_scale=row_scale, w_scale=ws, out_dtype=torch.bfloat16)  # fmt: skip
            ref = want
        assert rel_err(got, ref) < TOL, (tiles, rel_err(got, ref))


def _activation64(h, kind, layout):
    """The three CASES' activations in float64 (the op takes float32 at most): [gate; up] halves or
    interleaved pairs; swigluoai with alpha 1.702 and limit 7 (gpt-oss)."""
    if kind == "relu2":
        return torch.relu(h) ** 2
    g, u = (h[:, 0::2], h[:, 1::2]) if layout == "interleaved" else h.chunk(2, dim=-1)
    if kind == "silu":
        return g * torch.sigmoid(g) * u
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return g * torch.sigmoid(1.702 * g) * (u + 1)


def _pre_bias(bias, offsets, n):
    """Each grouped row's expert's bias row, in float64 (every row belongs to an expert: no expert map)."""
    rows = torch.arange(int(offsets[-1]), device=offsets.device)
    return bias.double()[torch.searchsorted(offsets[1:], rows, right=True)]


def _token_sum64(y, tw, inverse):
    """out[t] = sum_j tw[t, j] * y[inverse[t * k + j]] in float64."""
    m, k = tw.shape
    return (y[inverse.long()].view(m, k, -1) * tw.double().unsqueeze(-1)).sum(1)
