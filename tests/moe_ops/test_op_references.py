"""moe_ops::grouped_gemm, moe_ops::weighted_reduce and moe_ops::activation against float64 re-computations
written here in plain torch from each op's docstring (no moe_ops reference kernels or helpers), on fresh
random inputs (tests/conftest.py seeds torch per test). Ragged plans, empty experts and dropped rows are
built by hand so the expectation does not rely on moe_ops.routing_plan either."""
from __future__ import annotations

import math

import pytest
import torch

import moe_ops  # noqa: F401  (registers the ops)
from moe_ops import gemm  # only to patch its path choice and chunk size, never for an expectation

from moe_ops.quant import GroupShape, WeightQuant, quantize_weight

from ..decoders import decode_e2m1_packed, decode_weight  # the tests' own float64 decoders, not moe_ops'
from ..host_reads import no_host_reads

OPS = torch.ops.moe_ops
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    """Elementwise |out - expected| <= rtol * (|expected| + mean |expected|): a relative bound for the
    output dtype, with the mean magnitude as its floor where values cancel to near zero."""
    assert out.shape == expected.shape and out.dtype == dtype, (out.shape, out.dtype, expected.shape, dtype)
    got = out.double()
    assert torch.isfinite(got).all(), "non-finite output"
    bound = RTOL[dtype] * (expected.abs() + (expected.abs().mean() if expected.numel() else 0.0))
    excess = (got - expected).abs() - bound
    assert (excess <= 0).all(), f"max error {(got - expected).abs().max():.3g} exceeds bound at {excess.argmax()}"


def ragged_offsets(num_experts: int, empty: int) -> torch.Tensor:
    """int32 [E + 1] offsets of random 1..5 rows per expert, with `empty` random experts holding 0 rows."""
    counts = torch.randint(1, 6, (num_experts,))
    counts[torch.randperm(num_experts)[:empty]] = 0
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


# ---- grouped_gemm --------------------------------------------------------------------------------


def expected_gemm(x: torch.Tensor, w: torch.Tensor, bias, offsets: torch.Tensor) -> torch.Tensor:
    """float64: rows [offsets[e], offsets[e+1]) times w[e].T (+ bias[e]); rows from offsets[E] on are zero."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = x[lo:hi] @ w[e].T + (bias[e] if bias is not None else 0.0)
    return out


def gemm_inputs(dtype, gather: bool, dropped: int, empty: int, num_experts=5, k=48, n=40):
    """(a, gather_idx or None, offsets, x64): x64 are the float64 rows the GEMM reads. Without gather the
    dropped rows of `a` hold NaN (the docstring promises zero output rows whatever they hold)."""
    offsets = ragged_offsets(num_experts, empty)
    rows = int(offsets[-1]) + dropped
    if gather:
        a = torch.randn(int(torch.randint(1, 7, ())), k).to(dtype)
        gather_idx = torch.randint(0, a.shape[0], (rows,), dtype=torch.int32)
        return a, gather_idx, offsets, a.double()[gather_idx.long()]
    a = torch.randn(rows, k).to(dtype)
    a[int(offsets[-1]) :] = float("nan")
    return a, None, offsets, a.double()


def call_gemm(a, w, bias, offsets, gather_idx, out_dtype, w_scale=None, w_dtype="none", w_group=(-1, -1)):
    return OPS.grouped_gemm(a, None, None, "none", [-1, -1], w, w_scale, None, None, w_dtype, list(w_group),
                            bias, offsets, gather_idx, out_dtype)  # fmt: skip


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dropped,empty,k", [(0, 0, 48), (3, 2, 48), (3, 2, 45), (1, 5, 45)])
def test_grouped_gemm(dtype, out_dtype, gather, bias, dropped, empty, k):
    """Unquantized grouped GEMM over a ragged plan (some experts empty, some rows dropped; K = 45 rows are not
    16-byte aligned) equals the float64 per-expert product (+ bias), zero rows from offsets[E] on, in out_dtype."""
    a, gather_idx, offsets, x = gemm_inputs(dtype, gather, dropped, empty, k=k)
    w = (torch.randn(5, 40, a.shape[1]) / a.shape[1] ** 0.5).to(dtype)
    b = torch.randn(5, 40).to(dtype) if bias else None
    out = call_gemm(a, w, b, offsets, gather_idx, out_dtype)
    expected = expected_gemm(x, w.double(), b.double() if bias else None, offsets)
    assert_close(out, expected, out_dtype)
    assert (out[int(offsets[-1]) :] == 0).all(), "rows from offsets[E] on must be zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_cols", [-1, 16])
@pytest.mark.parametrize("gather", [False, True])
def test_grouped_gemm_int8_weights(dtype, group_cols, gather):
    """int8 weights with float32 scales per row (group [1, -1]) or per 1x16 group, decoded here as
    q[e, n, c] * scale[e, n, c // 16], against the float64 product with unquantized activations."""
    a, gather_idx, offsets, x = gemm_inputs(dtype, gather, dropped=2, empty=1)
    num_experts, n, k = 5, 40, a.shape[1]
    q = torch.randint(-127, 128, (num_experts, n, k), dtype=torch.int8)
    scale = torch.rand(num_experts, n, 1 if group_cols == -1 else k // group_cols) * 0.01 + 1e-3
    b = torch.randn(num_experts, n)
    out = call_gemm(a, q, b, offsets, gather_idx, dtype, scale, "int8", (1, group_cols))
    step = k if group_cols == -1 else group_cols
    w64 = q.double() * scale.double()[:, :, torch.arange(k) // step]
    assert_close(out, expected_gemm(x, w64, b.double(), offsets), dtype)


# ---- grouped_gemm: torch._grouped_mm or the batched product, chunks, argument checks ---------------


def _cuda_like_grouped_mm(calls: list):
    """torch._grouped_mm as CUDA runs it, recording each call's dtype in `calls`: besides the strides (each
    matrix row- or column-major, its other stride a multiple of 16 bytes) it rejects a start address off a
    16-byte boundary, which the CPU build does not check, and it leaves the rows from offs[-1] on unwritten
    (NaN here; the CPU build happens to zero them)."""
    real = torch._grouped_mm

    def grouped_mm(a, b, offs=None, **kwargs):
        for name, t in (("a", a), ("b", b)):
            assert t.data_ptr() % 16 == 0, f"{name}: expected data_ptr to be aligned to 16 bytes"
            (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
            unit = 16 // t.element_size()
            if col_stride == 1 and row_stride >= max(1, cols):
                assert row_stride % unit == 0, f"{name}: strides should be multiple of 16 bytes"
            elif row_stride == 1 and col_stride >= max(1, rows):
                assert col_stride % unit == 0, f"{name}: strides should be multiple of 16 bytes"
            else:
                raise AssertionError(f"{name}: invalid strides {t.stride()} for sizes {tuple(t.shape)}")
        calls.append(a.dtype)
        out = real(a, b, offs=offs, **kwargs)
        out[int(offs[-1]) :] = float("nan")
        return out

    return grouped_mm


# name -> (rows [R, K] from new(*shape), weights [E, N, K] from new(*shape), whether torch._grouped_mm takes
# them). K = 36: 144-byte rows, 16-byte aligned though K is not a multiple of 16; E, N = 4, 40.
NATIVE_LAYOUTS = {
    "row_major": (lambda new, r: new(r, 36), lambda new: new(4, 40, 36), True),
    "column_major_w": (lambda new, r: new(r, 36), lambda new: new(4, 36, 40).transpose(1, 2), True),
    "expert_sliced_w": (lambda new, r: new(r, 36), lambda new: new(5, 40, 36)[1:], True),
    "a_off_16_bytes": (lambda new, r: new(r * 36 + 1)[1:].view(r, 36), lambda new: new(4, 40, 36), False),
    "w_off_16_bytes": (lambda new, r: new(r, 36), lambda new: new(4 * 40 * 36 + 1)[1:].view(4, 40, 36), False),
    "a_every_other_column": (lambda new, r: new(r, 72)[:, ::2], lambda new: new(4, 40, 36), False),
    "w_every_other_column": (lambda new, r: new(r, 36), lambda new: new(4, 40, 72)[:, :, ::2], False),
}


@pytest.mark.parametrize("layout", list(NATIVE_LAYOUTS))
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_grouped_gemm_takes_grouped_mm_only_where_cuda_would_accept_it(layout, offsets_dtype, monkeypatch):
    """float32 rows and weights take torch._grouped_mm (one call) when both are 16-byte aligned, weights
    row- or column-major, and the batched product otherwise: a start off a 16-byte boundary (CUDA raises on
    it, the CPU build does not) or a column step (invalid strides everywhere), with int32 or int64 offsets
    (converted: _grouped_mm takes int32 only). Either way the values are
    the float64 product plus bias, and the rows from offsets[E] on, which _grouped_mm leaves unwritten on
    CUDA (NaN in the stand-in), are zero."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _cuda_like_grouped_mm(calls))
    make_a, make_w, native = NATIVE_LAYOUTS[layout]
    new = lambda *shape: torch.randn(*shape) / 4  # noqa: E731  (scaled in place: a copy would lose the layout)
    offsets = ragged_offsets(4, 1).to(offsets_dtype)  # torch._grouped_mm takes int32 offsets only
    used = int(offsets[-1])
    a, w = make_a(new, used + 2), make_w(new)
    a[used:] = float("nan")
    bias = torch.randn(4, 40)
    out = call_gemm(a, w, bias, offsets, None, torch.float32)
    assert_close(out, expected_gemm(a.double(), w.double(), bias.double(), offsets), torch.float32)
    assert (out[used:] == 0).all(), "rows from offsets[E] on must be zero"
    assert calls == ([torch.float32] if native else []), f"torch._grouped_mm calls: {calls}"


@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_bf16_weights_take_grouped_mm_as_on_cuda(rows_dtype, monkeypatch):
    """With CUDA's native set (bf16 only; simulated on the CPU, whose torch._grouped_mm also takes bf16),
    bf16 rows with bf16 weights are multiplied by torch._grouped_mm in bf16 (exact: the rows were bf16
    already), not by the float32 batched product; float32 rows with bf16 weights take the batched product
    and are not rounded to bf16."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _cuda_like_grouped_mm(calls))
    monkeypatch.setattr(gemm, "_NATIVE_GROUPED_MM", {("cpu", torch.bfloat16)})
    a, _, offsets, x = gemm_inputs(rows_dtype, gather=False, dropped=2, empty=1)
    w = (torch.randn(5, 40, a.shape[1]) / a.shape[1] ** 0.5).bfloat16()
    out = call_gemm(a, w, None, offsets, None, rows_dtype)
    assert_close(out, expected_gemm(x, w.double(), None, offsets), rows_dtype)
    assert (out[int(offsets[-1]) :] == 0).all()
    assert calls == ([torch.bfloat16] if rows_dtype == torch.bfloat16 else [])


def test_grouped_mm_on_cuda_only_where_it_has_kernels(monkeypatch):
    """torch._grouped_mm serves CUDA bf16 only on GPUs with its own kernels (sm_90, sm_100): elsewhere
    ATen's fallback copies the offsets to the host, a sync per call that a CUDA graph capture refuses,
    and the reference takes the batched product instead."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    cuda = torch.device("cuda", 0)
    for major, want in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(gemm.devices, "_capability", lambda index, major=major: (major, 0))
        assert gemm.native_grouped_mm(cuda, torch.bfloat16) is want, major
        assert gemm.native_grouped_mm(cuda, torch.float32) is False
    assert gemm.native_grouped_mm(torch.device("cpu"), torch.float32) is True
    assert gemm.native_grouped_mm(torch.device("cpu"), torch.bfloat16) is False


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_bf16_with_a_float32_output_is_not_rounded_to_bf16(bias, monkeypatch):
    """CUDA's native bf16 grouped GEMM returns its float32 sums rounded to bf16 (a float32 output would take
    its fallback, which reads the offsets on the host). Asked for a float32 output, bf16 rows and weights
    take the float32 batched product instead and match float64 to float32 rounding (CUDA's native set
    simulated on the CPU, whose bf16 torch._grouped_mm rounds alike). They came back bf16-rounded."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _cuda_like_grouped_mm(calls))
    monkeypatch.setattr(gemm, "_NATIVE_GROUPED_MM", {("cpu", torch.bfloat16)})
    a, _, offsets, x = gemm_inputs(torch.bfloat16, gather=False, dropped=2, empty=1)
    w = (torch.randn(5, 40, a.shape[1]) / a.shape[1] ** 0.5).bfloat16()
    b = torch.randn(5, 40) if bias else None
    out = call_gemm(a, w, b, offsets, None, torch.float32)
    assert out.dtype == torch.float32 and calls == []
    assert_close(out, expected_gemm(x, w.double(), b.double() if bias else None, offsets), torch.float32)


@pytest.mark.parametrize("chunk_rows", [0, 1, 3])
def test_grouped_gemm_batched_product_in_row_chunks(chunk_rows, monkeypatch):
    """The batched product (K = 45: rows not 16-byte aligned) materialises one dequantized [N, K] weight per
    row, at most _CHUNK_BYTES of them at a time. With _CHUNK_BYTES set to `chunk_rows` rows' worth (0: one
    byte, less than a single row's weight, so one row at a time), a ragged plan over several chunks, with
    bias, an empty expert and dropped rows, equals the float64 product, and no batched product covers more
    rows than that."""
    num_experts, n, k = 4, 40, 45
    monkeypatch.setattr(gemm, "_CHUNK_BYTES", max(1, chunk_rows * n * k * 4))
    batches, real_bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda x, y: (batches.append(x.shape[0]), real_bmm(x, y))[1])
    a, gather_idx, offsets, x = gemm_inputs(torch.float32, gather=True, dropped=3, empty=1, num_experts=num_experts, k=k)
    w = torch.randn(num_experts, n, k) / k**0.5
    bias = torch.randn(num_experts, n)
    out = call_gemm(a, w, bias, offsets, gather_idx, torch.float32)
    assert_close(out, expected_gemm(x, w.double(), bias.double(), offsets), torch.float32)
    assert (out[int(offsets[-1]) :] == 0).all()
    assert sum(batches) == out.shape[0] and max(batches) <= max(chunk_rows, 1), batches


# Every weight format in a group shape it takes (small blocks and groups for K = 64).
WEIGHT_QUANTS = {
    "fp8 per-tensor": WeightQuant("fp8", GroupShape(-1, -1)),
    "fp8 per-row": WeightQuant("fp8", GroupShape(1, -1)),
    "fp8 16x16": WeightQuant("fp8", GroupShape(16, 16)),
    "int8 1x16": WeightQuant("int8", GroupShape(1, 16)),
    "int4 1x16 zero": WeightQuant("int4", GroupShape(1, 16), zero_point=True),
    "nvfp4": WeightQuant("nvfp4", GroupShape(1, 16)),
    "mxfp4": WeightQuant("mxfp4", GroupShape(1, 32)),
}


# (rows, whether torch._grouped_mm takes float32 (the CPU: True), _WHOLE_DEQUANT_BYTES in experts' worth)
DEQUANT_PATHS = {
    "decode": (3, True, 64),
    "rows<E": (12, True, 64),
    "rows>=E": (40, True, 0),
    "rows>=E batched": (40, False, 16),
    "rows>=E batched, weight over the limit": (40, False, 15),
}


@pytest.mark.parametrize("path", list(DEQUANT_PATHS))
@pytest.mark.parametrize("name", list(WEIGHT_QUANTS))
def test_grouped_gemm_dequantizes_only_the_experts_it_reads(name, path, monkeypatch):
    """Quantized weights with fewer rows than experts (decoding: M * k rows against E experts) are
    dequantized per chunk of rows, the experts of those rows only, with their scales, global scales and
    zero points gathered alongside: never the whole [E, N, K] weight in float32. With at least as many
    rows as experts the whole weight is dequantized once, a chunk of experts at a time (the CPU's
    torch._grouped_mm takes it whatever its size; CUDA's batched product only up to
    _WHOLE_DEQUANT_BYTES, past which it dequantizes per chunk of rows). Either way the output is the
    float64 product with the tests' own decoding."""
    num_experts, n, k, chunk_rows = 16, 24, 64, 4
    rows, native, whole_experts = DEQUANT_PATHS[path]
    wq = WEIGHT_QUANTS[name]
    monkeypatch.setattr(gemm, "_CHUNK_BYTES", chunk_rows * n * k * 4)
    monkeypatch.setattr(gemm, "_WHOLE_DEQUANT_BYTES", whole_experts * n * k * 4)
    if not native:  # as on CUDA: float32 has no torch._grouped_mm there
        monkeypatch.setattr(gemm, "_NATIVE_GROUPED_MM", {("cuda", torch.bfloat16)})
    experts_decoded, real = [], gemm.formats.dequantize
    monkeypatch.setattr(gemm.formats, "dequantize", lambda q, *a: (experts_decoded.append(q.shape[0]), real(q, *a))[1])
    stored = quantize_weight(torch.randn(num_experts, n, k), wq)
    ids = torch.randint(0, num_experts, (rows,))
    counts = torch.bincount(ids, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    a = torch.randn(rows + 2, k)  # two dropped rows, past offsets[E]
    gather_idx = torch.randint(0, rows + 2, (rows + 2,), dtype=torch.int32)
    bias = torch.randn(num_experts, n)
    with no_host_reads():  # the experts are gathered on the device: no sync, capturable in a CUDA graph
        out = OPS.grouped_gemm(
            a, None, None, "none", [-1, -1], stored["q"], stored["scale"], stored["global_scale"], stored["zero"],
            wq.dtype, list(wq.group.astuple()), bias, offsets, gather_idx, torch.float32,
        )  # fmt: skip
    w64 = decode_weight(stored["q"], wq, stored["scale"], stored["global_scale"], stored["zero"])
    expected = expected_gemm(a.double()[gather_idx.long()], w64, bias.double(), offsets)
    assert_close(out, expected, torch.float32)
    assert experts_decoded and max(experts_decoded) <= chunk_rows, experts_decoded
    whole = rows >= num_experts and (native or whole_experts >= num_experts)
    # Whole: each expert once, in order; per chunk of rows: one per row, dropped rows included.
    assert sum(experts_decoded) == (num_experts if whole else rows + 2), experts_decoded


@pytest.mark.parametrize("k", [32, 45])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_without_experts(k, bias):
    """E = 0 (a rank without local experts): every row is dropped, so the output is zero, with or without a
    bias [0, N], on torch._grouped_mm's path (K = 32) and on the batched one (K = 45, rows not 16-byte
    aligned), which must not clamp a row's expert to E - 1 = -1 of an empty weight."""
    a = torch.randn(int(torch.randint(1, 7, ())), k)
    b = torch.randn(0, 40) if bias else None
    out = call_gemm(a, torch.randn(0, 40, k), b, torch.zeros(1, dtype=torch.int32), None, torch.float32)
    assert out.shape == (a.shape[0], 40) and (out == 0).all()


@pytest.mark.parametrize("global_scale", ["one", "per_expert"])
def test_grouped_gemm_nvfp4_weights_with_one_or_per_expert_global_scale(global_scale):
    """nvfp4 weights take one global scale for all experts ([1]) or one per expert ([E]); decoded here as
    e2m1(nibble) * fp8 group scale (1x16) * global scale, element 2j in the low nibble of byte j."""
    q = torch.randint(0, 256, (4, 40, 16), dtype=torch.uint8)  # [E, N, K/2]: K = 32
    scale = torch.rand(4, 40, 2).to(torch.float8_e4m3fn)
    global_scale = torch.rand(1 if global_scale == "one" else 4) + 0.5
    w64 = decode_e2m1_packed(q) * scale.double().repeat_interleave(16, -1) * global_scale.double().view(-1, 1, 1)
    a, offsets = torch.randn(3, 32), torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32)
    out = OPS.grouped_gemm(a, None, None, "none", [-1, -1], q, scale, global_scale, None, "nvfp4", [1, 16], None, offsets, None,
                           torch.float32)  # fmt: skip
    assert_close(out, expected_gemm(a.double(), w64, None, offsets), torch.float32)


# ---- weighted_reduce -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("dropped", [0, 1, 5])
def test_weighted_reduce(dtype, k, dropped):
    """out[m] = sum_j topk_weights[m, j] * y[inverse[m*k + j]] over a random inverse permutation; pairs whose
    row is at or past offsets[E] contribute nothing, though those rows of y hold NaN."""
    m, h = int(torch.randint(2, 9, ())), 24
    pairs = m * k
    dropped = min(dropped, pairs - 1)
    used = pairs - dropped
    cuts = torch.randint(0, used + 1, (3,)).sort().values  # 4 experts, ragged, possibly empty
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([used])]).to(torch.int32)
    inverse = torch.randperm(pairs).to(torch.int32)
    y = torch.randn(pairs, h).to(dtype)
    y[used:] = float("nan")
    weights = torch.rand(m, k)
    out = OPS.weighted_reduce(y, weights, inverse, offsets)
    contrib = y.double()[inverse.long()] * weights.double().reshape(-1, 1)
    contrib[inverse.long() >= used] = 0.0
    assert_close(out, contrib.view(m, k, h).sum(1), dtype)


@pytest.mark.parametrize("bad", [-1, -7, "rows"], ids=["minus_one", "negative", "past_end"])
def test_grouped_gemm_out_of_range_gather_reads_nothing(bad):
    """gather_idx entries outside [0, M) read nothing (compiled callers are not value-checked): their rows
    come out zero, the others as with valid indices. Dropping either bound of the check went unnoticed
    (a negative index read row 0 or wrapped; one past the end read a clamped row)."""
    a = torch.randn(6, 32)
    w = torch.randn(3, 40, 32)
    offsets = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    gather_idx = torch.randint(0, a.shape[0], (10,), dtype=torch.int32)
    bad_rows = torch.tensor([1, 5, 9])
    gather_idx[bad_rows] = a.shape[0] if bad == "rows" else bad
    out = call_gemm(a, w, None, offsets, gather_idx, torch.float32)  # the op checks no values
    x64 = a.double()[gather_idx.long().clamp(0, a.shape[0] - 1)]
    x64[bad_rows] = 0.0
    assert_close(out, expected_gemm(x64, w.double(), None, offsets), torch.float32)
    assert (out[bad_rows] == 0).all()


@pytest.mark.parametrize("bad", [-1, "past_end"])
def test_weighted_reduce_negative_inverse_contributes_nothing(bad):
    """A negative inverse entry, or one past the last row of y (a hand-written plan; the op checks no
    values), contributes nothing, as a row at or past offsets[E] does; without the lower bound it read
    row 0, and an index of M*k must not read (or fault on) a row beyond y."""
    m, k, h = 4, 2, 24
    y = torch.randn(m * k, h)
    inverse = torch.randperm(m * k).to(torch.int32)
    inverse[3] = m * k if bad == "past_end" else bad
    offsets = torch.tensor([0, 5, m * k], dtype=torch.int32)
    weights = torch.rand(m, k)
    out = OPS.weighted_reduce(y, weights, inverse, offsets)
    contrib = y.double()[inverse.long().clamp(0, m * k - 1)] * weights.double().reshape(-1, 1)
    contrib[3] = 0.0
    assert_close(out, contrib.view(m, k, h).sum(1), torch.float32)


@pytest.mark.parametrize("k", [4, 32])
def test_weighted_reduce_sums_in_choice_order(k):
    """The docstring's order: float32 products added one choice at a time, j = 0, 1, ..., k-1, so the
    result is bit for bit that sum (the deterministic order a kernel can match), not a tree or vectorised
    reduction over j (which rounds differently from about k = 32 on)."""
    m, h = 16, 96
    y = torch.randn(m * k, h) * torch.exp(torch.randn(m * k, 1) * 3)  # magnitudes far apart: order matters
    weights = torch.rand(m, k)
    inverse = torch.randperm(m * k).to(torch.int32)
    out = OPS.weighted_reduce(y, weights, inverse, torch.tensor([0, m * k], dtype=torch.int32))
    products = (y[inverse.long()] * weights.reshape(-1, 1)).view(m, k, h)
    want = products[:, 0].clone()
    for j in range(1, k):
        want += products[:, j]
    assert torch.equal(out, want)


def test_weighted_reduce_without_choices():
    """k = 0 choices per token (topk_weights [M, 0], no grouped rows): every token's sum is empty, so the
    output is zero [M, H] in y's dtype."""
    m, h = int(torch.randint(1, 9, ())), 24
    y = torch.randn(0, h).bfloat16()
    out = OPS.weighted_reduce(y, torch.rand(m, 0), torch.zeros(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    assert out.shape == (m, h) and out.dtype == torch.bfloat16 and (out == 0).all()


# ---- activation ----------------------------------------------------------------------------------


def _swigluoai(g, u, alpha, limit):
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1 + torch.exp(-alpha * g)) * (u + 1)


def _silu_clamped(g, u, alpha, limit):
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1 + torch.exp(-g)) * u


def _swiglu_softcapped(g, u, alpha, limit):
    return alpha * torch.tanh(g / alpha) / (1 + torch.exp(-g)) * (limit * torch.tanh(u / limit))


# float64, from each kind's definition: SwiGLU, exact and tanh GELU gates, gpt-oss's clamped SwiGLU (gate
# clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)), the same
# clamps on plain SwiGLU (DeepSeek-V4: no alpha, no + 1), Inkling-2's softcapped SwiGLU (the gate factor
# and up softcapped at alpha and limit, the sigmoid of the raw gate), relu^2.
EXPECTED_ACTIVATION = {
    "silu": lambda g, u, alpha, limit: g / (1 + torch.exp(-g)) * u,
    "gelu": lambda g, u, alpha, limit: 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u,
    "gelu_tanh": lambda g, u, alpha, limit: 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u,
    "swigluoai": _swigluoai,
    "silu_clamped": _silu_clamped,
    "swiglu_softcapped": _swiglu_softcapped,
    "relu2": lambda g, u, alpha, limit: g.clamp(min=0) ** 2,
}


def test_activation_parameters_default_per_kind():
    """An omitted alpha or limit takes the kind's own default (DEFAULTS): Inkling-2's softcaps for
    swiglu_softcapped, not gpt-oss's numbers; a given one is kept. Kinds reading neither keep
    swigluoai's, which the kernels' compile keys also use for them."""
    from moe_ops.activation import DEFAULTS, PARAMETERS

    assert (moe_ops.Activation("swiglu_softcapped").alpha, moe_ops.Activation("swiglu_softcapped").limit) == (4.0, 25.0)
    assert (moe_ops.Activation("swigluoai").alpha, moe_ops.Activation("swigluoai").limit) == (1.702, 7.0)
    assert moe_ops.Activation("silu_clamped").limit == 7.0
    assert moe_ops.Activation("swiglu_softcapped", limit=30.0) == moe_ops.Activation("swiglu_softcapped", alpha=4.0, limit=30.0)
    assert moe_ops.Activation("silu") == moe_ops.Activation("silu", alpha=1.702, limit=7.0)
    assert set(PARAMETERS) == set(DEFAULTS) <= set(moe_ops.ACTIVATIONS)


def test_activation_kinds_covered():
    """The parametrization below covers every kind the op accepts (moe_ops.ACTIVATIONS), each gated kind in
    both layouts."""
    covered = {(kind, inter) for kind, inter in ACT_CASES}
    wanted = {(kind, inter) for kind, (gated, _) in moe_ops.ACTIVATIONS.items() for inter in (False, True)[: 1 + gated]}
    assert covered == wanted


ACT_CASES = [
    (kind, inter) for kind in ("silu", "gelu", "gelu_tanh", "swigluoai", "silu_clamped", "swiglu_softcapped") for inter in (False, True)
]
ACT_CASES.append(("relu2", False))


def _gate_up64(x: torch.Tensor, kind: str, interleaved: bool):
    """x [R, W] in float64 as (gate, up): [gate | up] halves or alternating columns; relu2: (x, None)."""
    x64 = x.double()
    if kind == "relu2":
        return x64, None
    return (x64[:, 0::2], x64[:, 1::2]) if interleaved else x64.chunk(2, dim=1)


@pytest.mark.parametrize("kind,interleaved", ACT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation(kind, interleaved, dtype):
    """Gated kinds split [R, 2I] into gate/up halves ([gate | up] or alternating columns) and return [R, I];
    relu2 maps [R, I] to [R, I]; random alpha and limit (only the clamped and softcapped kinds read them)
    clamp or cap some values."""
    rows, width = int(torch.randint(1, 9, ())), 32
    alpha, limit = 0.5 + 2 * torch.rand(()).item(), 1 + 3 * torch.rand(()).item()
    x = (torch.randn(rows, width) * 3).to(dtype)
    out = OPS.activation(x, kind, alpha, limit, interleaved)
    g, u = _gate_up64(x, kind, interleaved)
    assert_close(out, EXPECTED_ACTIVATION[kind](g, u, alpha, limit), dtype)


@pytest.mark.parametrize("kind,interleaved", ACT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activation_is_rounded_once(kind, interleaved, dtype):
    """The op computes a half-precision input in float32 and rounds only the result, so every element is
    within half a unit in the last place (plus float32's own error) of the float64 value. Computing in
    the input dtype rounds the gate's nonlinearity and the product separately: up to about one ulp off,
    an error RTOL's looser bound above does not see."""
    alpha, limit = 1.702, 7.0
    x = (torch.randn(64, 256) * 3).to(dtype)
    out = OPS.activation(x, kind, alpha, limit, interleaved).double()
    g, u = _gate_up64(x, kind, interleaved)
    want = EXPECTED_ACTIVATION[kind](g, u, alpha, limit)
    finfo = torch.finfo(dtype)
    # half an ulp of want's binade [2**(e-1), 2**e) (frexp: want = m * 2**e, 0.5 <= |m| < 1), floored at half the
    # subnormal step
    half_ulp = torch.ldexp(torch.full_like(want, finfo.eps), torch.frexp(want).exponent - 2)
    half_ulp = half_ulp.clamp(min=finfo.smallest_normal * finfo.eps / 2)
    err = (out - want).abs()
    # float32's own error: relative to the result, or to |gate| * |up| where GELU's 1 + erf(gate) cancels
    f32 = 1e-6 * (want.abs() + (g.abs() * (1 + u.abs()) if u is not None else 0))
    assert (err <= half_ulp + f32).all(), f"max error {((err - f32) / half_ulp).max():.3f} half-ulps"
