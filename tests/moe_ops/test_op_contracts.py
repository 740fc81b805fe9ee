"""The primitive ops' contracts beyond tests/moe_ops/test_opcheck.py (contiguous inputs) and
test_op_references.py (values on contiguous inputs): every input layout the ops accept (transposed,
sliced, column-major and K-sliced weights, M = 0, experts without rows, k = 1, dropped pairs, int32 and
int64 indices) gives the real impl's values (float64 re-computations written here) and the fake impl's
shape, dtype and strides; bad arguments raise the same ValueError/TypeError in both impls; each op
compiles alone into one dynamic graph; no op reads a tensor value on the host."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops  # noqa: F401  (registers the ops)
from moe_ops import gemm
from moe_ops.quant import formats

from ..host_reads import no_host_reads

OPS = torch.ops.moe_ops
E, N, K = 4, 48, 32  # N, K: 16-byte aligned rows, so float32 weights can take torch._grouped_mm
NONE = [-1, -1]


def call_gemm(a, w, offsets, gather_idx=None, bias=None, out_dtype=torch.float32):
    return OPS.grouped_gemm(a, None, None, "none", NONE, w, None, None, None, "none", NONE, bias, offsets,
                            gather_idx, out_dtype)  # fmt: skip


def gemm_args(a, w, offsets, gather_idx=None, bias=None, out_dtype=torch.float32):
    return [a, None, None, "none", NONE, w, None, None, None, "none", NONE, bias, offsets, gather_idx, out_dtype]


def offsets_of(counts) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def expected_gemm(x64, w64, offsets, bias64=None) -> torch.Tensor:
    """float64: rows [offsets[e], offsets[e+1]) times w[e].T (+ bias[e]); the other rows zero."""
    out = torch.zeros(x64.shape[0], w64.shape[1], dtype=torch.float64)
    for e in range(w64.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = x64[lo:hi] @ w64[e].T + (bias64[e] if bias64 is not None else 0.0)
    return out


def assert_close(out, expected, rtol):
    bound = rtol * (expected.abs() + expected.abs().mean())
    assert ((out.double() - expected).abs() <= bound).all(), f"max error {(out.double() - expected).abs().max():.3g}"


def run_fake(op, args):
    with FakeTensorMode() as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def assert_fake_matches(op, args):
    """The real and the fake impl agree on every output's shape, dtype and strides; opcheck passes."""
    torch.library.opcheck(op, tuple(args))
    real, fake = op(*args), run_fake(op, args)
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for r, f in zip(real, fake):
        assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride())


# ---- grouped_gemm: weight and activation layouts ------------------------------------------------

# name -> weights [E, N, K] in that layout, from new(*shape) (random, in the test's dtype). The sliced
# ones are views of a wider buffer whose row stride is not a multiple of 16 bytes: fused_experts accepts
# them (each expert row- or column-major), and torch._grouped_mm raised "strides should be multiple of
# 16 bytes" on them.
WEIGHTS = {
    "row_major": lambda new: new(E, N, K),
    "column_major": lambda new: new(E, K, N).transpose(1, 2),
    "row_major_K_sliced": lambda new: new(E, N, K + 3)[:, :, :K],
    "column_major_N_sliced": lambda new: new(E, K, N + 1)[:, :, :N].transpose(1, 2),
    "expert_sliced": lambda new: new(E + 2, N, K)[1 : E + 1],
}
# name -> activation rows [r, K] in that layout
ROWS = {
    "contiguous": lambda new, r: new(r, K),
    "transposed": lambda new, r: new(K, r).t(),
    "K_sliced": lambda new, r: new(r, K + 3)[:, :K],
    "offset_start": lambda new, r: new(r * K + 1)[1:].view(r, K),
}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gather", [False, True])
def test_grouped_gemm_layouts(weights, rows, dtype, gather):
    """Each layout gives the float64 per-expert product (expert 1 empty, 2 rows dropped) and the fake
    impl's strides."""
    w = WEIGHTS[weights](lambda *shape: (torch.randn(*shape) / K**0.5).to(dtype))
    new = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    offsets = offsets_of([3, 0, 2, 4])
    num_rows = int(offsets[-1]) + 2
    bias = torch.randn(E, N).to(dtype)
    if gather:
        a = ROWS[rows](new, 5)
        gather_idx = torch.randint(0, 5, (num_rows,), dtype=torch.int64)
        x64 = a.double()[gather_idx]
    else:
        a, gather_idx = ROWS[rows](new, num_rows), None
        x64 = a.double()
    out = call_gemm(a, w, offsets, gather_idx, bias)
    assert_close(out, expected_gemm(x64, w.double(), offsets, bias.double()), {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype])
    assert (out[int(offsets[-1]) :] == 0).all()
    assert_fake_matches(OPS.grouped_gemm, gemm_args(a, w, offsets, gather_idx, bias))


def test_grouped_gemm_float32_rows_with_bf16_weights_are_not_rounded(monkeypatch):
    """The reference multiplies in float32: float32 rows with bf16 weights must not be rounded to bf16
    where the device has a native bf16 grouped GEMM (CUDA; simulated on the CPU here, whose
    torch._grouped_mm also takes bf16). They were (x.to(w.dtype)): about 1% error."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    monkeypatch.setattr(gemm, "_NATIVE_GROUPED_MM", gemm._NATIVE_GROUPED_MM | {("cpu", torch.bfloat16)})
    offsets = offsets_of([2, 3, 0, 3])
    a, w = torch.randn(int(offsets[-1]), K), torch.randn(E, N, K).bfloat16()
    assert_close(call_gemm(a, w, offsets), expected_gemm(a.double(), w.double(), offsets), 1e-5)


def test_grouped_gemm_without_experts_or_tokens():
    """E = 0 (a rank without local experts) with a bias [0, N]: every row is dropped, so zero; and
    gathering from no tokens (a [0, K], indices all out of range) reads nothing. Both raised IndexError
    (clamping an index into an empty table) while the fake impl accepted them."""
    a = torch.randn(3, K)
    args = gemm_args(a, torch.randn(0, N, K), torch.zeros(1, dtype=torch.int32), None, torch.randn(0, N))
    assert torch.equal(OPS.grouped_gemm(*args), torch.zeros(3, N))
    assert_fake_matches(OPS.grouped_gemm, args)
    gather_idx = torch.randint(-3, 3, (4,), dtype=torch.int32)
    args = gemm_args(torch.randn(0, K), torch.randn(E, N, K), offsets_of([1, 1, 0, 2]), gather_idx)
    assert torch.equal(OPS.grouped_gemm(*args), torch.zeros(4, N))
    assert_fake_matches(OPS.grouped_gemm, args)


# ---- routing_plan, activation, weighted_reduce: layouts and edge sizes ---------------------------


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("m,k", [(0, 2), (1, 1), (7, 1), (7, 3)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("with_map", [False, True])
def test_routing_plan_layouts(id_dtype, m, k, layout, with_map):
    """Transposed ids, a strided expert_map, ids outside [0, E) and -1 map entries (dropped pairs):
    the plan groups the kept pairs by local expert in pair order, the dropped ones last, and the fake
    impl matches."""
    num_global = 6 if with_map else E
    ids = torch.randint(-1, num_global + 1, (m, k) if layout == "contiguous" else (k, m), dtype=id_dtype)
    ids = ids if layout == "contiguous" else ids.t()
    expert_map = torch.tensor([0, 9, -1, 9, 1, 9, 3, 9, -1, 9, 2, 9], dtype=id_dtype)[::2] if with_map else None
    offsets, gather_idx, inverse = OPS.routing_plan(ids, E, expert_map)
    flat = ids.reshape(-1).tolist()
    local = [expert_map.tolist()[i] if with_map and 0 <= i < num_global else (i if 0 <= i < num_global else -1) for i in flat]
    key = [e if 0 <= e < E else E for e in local]
    order = sorted(range(len(key)), key=lambda p: (key[p], p))
    assert offsets.tolist() == [sum(c < e for c in key) for e in range(E + 1)]
    assert gather_idx.tolist() == [p // k for p in order]
    assert [order[r] for r in inverse.tolist()] == list(range(len(key)))
    assert_fake_matches(OPS.routing_plan, [ids, E, expert_map])


def test_routing_plan_empty_expert_map():
    """expert_map [0] (no global expert): every pair is dropped. It raised IndexError."""
    ids = torch.randint(0, 3, (3, 2), dtype=torch.int32)
    offsets, gather_idx, inverse = OPS.routing_plan(ids, 2, torch.zeros(0, dtype=torch.int32))
    assert offsets.tolist() == [0, 0, 0]
    assert gather_idx.tolist() == [0, 0, 1, 1, 2, 2] and inverse.tolist() == list(range(6))
    assert_fake_matches(OPS.routing_plan, [ids, 2, torch.zeros(0, dtype=torch.int32)])


def test_routing_plan_without_local_experts():
    """num_experts 0 (a rank that holds no expert) is allowed: offsets [0] and every pair dropped, in
    pair order; a negative count is an error."""
    ids = torch.randint(0, 3, (3, 2), dtype=torch.int32)
    offsets, gather_idx, inverse = OPS.routing_plan(ids, 0, None)
    assert offsets.tolist() == [0]
    assert gather_idx.tolist() == [0, 0, 1, 1, 2, 2] and inverse.tolist() == list(range(6))
    assert_fake_matches(OPS.routing_plan, [ids, 0, None])
    with pytest.raises(ValueError, match=r"num_experts: got -1; allowed: an int >= 0"):
        OPS.routing_plan(ids, -1, None)


@pytest.mark.parametrize("layout", ["transposed", "column_sliced", "rows_0"])
@pytest.mark.parametrize("kind,interleaved", [("silu", False), ("swigluoai", True), ("relu2", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_layouts(layout, kind, interleaved, dtype):
    """Non-contiguous inputs give contiguous [R, I] outputs equal to those of the contiguous input (up to
    an ulp: the CPU's vectorized and strided elementwise loops round differently)."""
    rows = 0 if layout == "rows_0" else 5
    x = {"transposed": lambda: torch.randn(16, rows).t(), "column_sliced": lambda: torch.randn(rows, 40)[:, 3:35:2],
         "rows_0": lambda: torch.randn(rows, 16)}[layout]().mul(3).to(dtype)  # fmt: skip
    x = x[:, :-1] if kind == "relu2" else x  # an odd width for the kind without a gate
    out = OPS.activation(x, kind, 1.702, 7.0, interleaved)
    torch.testing.assert_close(out, OPS.activation(x.contiguous(), kind, 1.702, 7.0, interleaved))
    assert out.is_contiguous()
    assert_fake_matches(OPS.activation, [x, kind, 1.702, 7.0, interleaved])


@pytest.mark.parametrize("m,k", [(0, 2), (5, 1), (5, 3)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_weighted_reduce_layouts(m, k, index_dtype):
    """Transposed y and topk_weights, int64 indices: float64 sum of the kept pairs, fake strides."""
    pairs, h = m * k, 24
    y = torch.randn(h, pairs).t()
    weights = torch.rand(k, m).t()
    inverse = torch.randperm(pairs).to(index_dtype)
    offsets = torch.tensor([0, pairs // 2, max(pairs - 1, 0)], dtype=index_dtype)  # the last row dropped
    out = OPS.weighted_reduce(y, weights, inverse, offsets)
    kept = (inverse < offsets[-1]).double().unsqueeze(1)
    want = (y.double()[inverse] * weights.double().reshape(-1, 1) * kept).view(m, k, h).sum(1)
    assert_close(out, want, 1e-5)
    assert_fake_matches(OPS.weighted_reduce, [y, weights, inverse, offsets])


# ---- argument errors: the real and the fake impl alike --------------------------------------------

_OFF = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)


def _gemm(**changes):
    args = dict(a=torch.randn(3, K), a_scale=None, a_global_scale=None, a_dtype="none", a_group=NONE,
                w=torch.randn(E, N, K), w_scale=None, w_global_scale=None, w_zero=None, w_dtype="none", w_group=NONE,
                bias=None, expert_offsets=_OFF, gather_idx=None, out_dtype=torch.float32)  # fmt: skip
    return OPS.grouped_gemm, list({**args, **changes}.values())


def _reduce(**changes):
    args = dict(y=torch.randn(6, N), topk_weights=torch.rand(3, 2), inverse=torch.arange(6, dtype=torch.int32),
                expert_offsets=torch.tensor([0, 4, 6], dtype=torch.int32))  # fmt: skip
    return OPS.weighted_reduce, list({**args, **changes}.values())


# name -> (op and arguments, exception, message). Before the checks the real impls failed inside the
# computation (RuntimeError, IndexError) or returned a result, and the fake impls disagreed with them.
BAD = {
    "gemm_offsets_E+2": (lambda: _gemm(expert_offsets=torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)),
                         ValueError, r"expert_offsets: expected shape \(5,\) \(\[E\+1\]\), got \(6,\)"),
    "gemm_K_mismatch": (lambda: _gemm(a=torch.randn(3, K + 1)), ValueError,
                        r"a and w: K differs, a \(3, 33\) \(none\) holds K=33, w \(4, 48, 32\) \(none\) K=32"),
    "gemm_bias_N": (lambda: _gemm(bias=torch.randn(E, N + 1)), ValueError, r"bias: expected shape \(4, 48\) \(\[E, N\]\)"),
    "gemm_w_2d": (lambda: _gemm(w=torch.randn(N, K)), ValueError, r"w: expected 3-D \[E, N, K\]"),
    "gemm_a_3d": (lambda: _gemm(a=torch.randn(3, K, 1)), ValueError, r"a: expected 2-D \[R, K\]"),
    "gemm_gather_2d": (lambda: _gemm(gather_idx=torch.zeros(1, 3, dtype=torch.int32)), ValueError, r"gather_idx: expected 1-D"),
    "gemm_float_offsets": (lambda: _gemm(expert_offsets=_OFF.float()), TypeError,
                           r"expert_offsets: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    "gemm_float_gather": (lambda: _gemm(gather_idx=torch.zeros(3)), TypeError, r"gather_idx: dtype torch.float32"),
    "gemm_int_a": (lambda: _gemm(a=torch.ones(3, K, dtype=torch.int32)), TypeError, r"a: dtype torch.int32 is not allowed"),
    "gemm_int_out": (lambda: _gemm(out_dtype=torch.int32), TypeError,
                     r"out_dtype: got torch.int32; allowed: torch.float32, torch.float16, torch.bfloat16"),
    "gemm_unknown_w_dtype": (lambda: _gemm(w_dtype="int2"), ValueError, r"w_dtype: got 'int2'; allowed: 'none', 'fp8'"),
    "gemm_int8_without_scale": (lambda: _gemm(w=torch.ones(E, N, K, dtype=torch.int8), w_dtype="int8", w_group=[1, -1]),
                                ValueError, r"w_scale: 'int8' values need their scales, got None"),
    # Before: nvfp4 without its global scale gave values off by exactly 1/global (x788 in the review's
    # case), and a global scale given to another format was applied.
    "gemm_nvfp4_w_without_global": (lambda: _gemm(w=torch.zeros(E, N, K // 2, dtype=torch.uint8), w_dtype="nvfp4", w_group=[1, 16],
                                                  w_scale=torch.ones(E, N, K // 16).to(torch.float8_e4m3fn)),
                                    ValueError, r"w_global_scale: 'nvfp4' needs its float32 global scale, got None"),
    "gemm_nvfp4_a_without_global": (lambda: _gemm(a=torch.zeros(3, K // 2, dtype=torch.uint8), a_dtype="nvfp4", a_group=[1, 16],
                                                  a_scale=torch.ones(3, K // 16).to(torch.float8_e4m3fn)),
                                    ValueError, r"a_global_scale: 'nvfp4' needs its float32 global scale, got None"),
    "gemm_fp8_w_with_global": (lambda: _gemm(w=torch.zeros(E, N, K).to(torch.float8_e4m3fn), w_dtype="fp8", w_group=[1, -1],
                                             w_scale=torch.ones(E, N, 1), w_global_scale=torch.full((E,), 0.5)),
                               ValueError, r"w_global_scale: 'fp8' has no global scale \(nvfp4 only\), got \(4,\)"),
    "gemm_nvfp4_global_per_row": (lambda: _gemm(w=torch.zeros(E, N, K // 2, dtype=torch.uint8), w_dtype="nvfp4", w_group=[1, 16],
                                                w_scale=torch.ones(E, N, K // 16).to(torch.float8_e4m3fn), w_global_scale=torch.ones(3)),
                                  ValueError, r"w_global_scale: expected one value or one per expert \[4\], got shape \(3,\)"),
    # An activation global scale of several values: the real impl failed in a reshape, the fake returned.
    "gemm_nvfp4_a_global_per_row": (lambda: _gemm(a=torch.zeros(3, K // 2, dtype=torch.uint8), a_dtype="nvfp4", a_group=[1, 16],
                                                  a_scale=torch.ones(3, K // 16).to(torch.float8_e4m3fn), a_global_scale=torch.ones(3)),
                                    ValueError, r"a_global_scale: expected one value \[1\], got shape \(3,\)"),
    "gemm_zero_for_int8": (lambda: _gemm(w=torch.ones(E, N, K, dtype=torch.int8), w_dtype="int8", w_group=[1, -1],
                                         w_scale=torch.ones(E, N, 1), w_zero=torch.full((E, N, 1), 8, dtype=torch.uint8)),
                           ValueError, r"w_zero: zero points are for int4 weights only, got one for w_dtype='int8'"),
    # A scale on meta beside x on the CPU dispatched quantize to its fake impl, which returned
    # uninitialised CPU tensors (garbage codes, a zero scale) without an error.
    "quantize_static_scale_on_meta": (lambda: (OPS.quantize, [torch.randn(6, K), "fp8", [-1, -1], torch.ones(1, device="meta"), None]),
                                      ValueError, r"scale: on meta, but x is on cpu; all tensors must share one device"),
    "quantize_global_scale_on_meta": (lambda: (OPS.quantize, [torch.randn(6, K), "nvfp4", [1, 16], None, torch.ones(1, device="meta")]),
                                      ValueError, r"global_scale: on meta, but x is on cpu"),
    # Scale-less fp8 failed inside the dequantization; an empty activation global scale, an int bias and
    # tensors on another device were read without an error.
    "gemm_fp8_w_without_scale": (lambda: _gemm(w=torch.randn(E, N, K).to(torch.float8_e4m3fn), w_dtype="fp8", w_group=[1, -1]),
                                 ValueError, r"w_scale: 'fp8' values need their scales, got None"),
    "gemm_fp8_a_without_scale": (lambda: _gemm(a=torch.randn(3, K).to(torch.float8_e4m3fn), a_dtype="fp8", a_group=[1, -1]),
                                 ValueError, r"a_scale: 'fp8' values need their scales, got None"),
    "gemm_nvfp4_a_empty_global": (lambda: _gemm(a=torch.zeros(3, K // 2, dtype=torch.uint8), a_dtype="nvfp4", a_group=[1, 16],
                                                a_scale=torch.ones(3, K // 16).to(torch.float8_e4m3fn), a_global_scale=torch.ones(0)),
                                  ValueError, r"a_global_scale: expected one value \[1\], got shape \(0,\)"),
    "gemm_int_bias": (lambda: _gemm(bias=torch.randint(-3, 4, (E, N), dtype=torch.int32)), TypeError,
                      r"bias: dtype torch.int32 is not allowed; allowed: torch.float32"),
    "gemm_bias_on_meta": (lambda: _gemm(bias=torch.randn(E, N, device="meta")), ValueError,
                          r"bias: on meta, but a is on cpu; all tensors must share one device"),
    "gemm_w_scale_on_meta": (lambda: _gemm(w=torch.ones(E, N, K, dtype=torch.int8), w_dtype="int8", w_group=[1, -1],
                                           w_scale=torch.rand(E, N, 1, device="meta")), ValueError, r"w_scale: on meta, but a is on cpu"),
    "gemm_w_global_scale_on_meta": (lambda: _gemm(w=torch.zeros(E, N, K // 2, dtype=torch.uint8), w_dtype="nvfp4", w_group=[1, 16],
                                                  w_scale=torch.ones(E, N, K // 16).to(torch.float8_e4m3fn),
                                                  w_global_scale=torch.rand(E, device="meta")),
                                    ValueError, r"w_global_scale: on meta, but a is on cpu"),
    "reduce_short_inverse": (lambda: _reduce(inverse=torch.arange(5, dtype=torch.int32)), ValueError,
                             r"inverse: expected shape \(6,\) \(\[M\*k\] for topk_weights \(3, 2\)\), got \(5,\)"),
    "reduce_y_rows": (lambda: _reduce(y=torch.randn(5, N)), ValueError, r"y \(5, 48\): expected M\*k=6 rows for topk_weights \(3, 2\), got 5"),
    "reduce_2d_offsets": (lambda: _reduce(expert_offsets=torch.tensor([[0, 6]])), ValueError, r"expert_offsets: expected 1-D \[E\+1\]"),
    "reduce_empty_offsets": (lambda: _reduce(expert_offsets=torch.zeros(0, dtype=torch.int32)), ValueError,
                             r"expert_offsets: expected \[E\+1\] with E >= 0, got shape \(0,\)"),
    "reduce_1d_weights": (lambda: _reduce(topk_weights=torch.rand(6)), ValueError, r"topk_weights: expected 2-D \[M, k\], got shape \(6,\)"),
    "reduce_float_inverse": (lambda: _reduce(inverse=torch.arange(6.0)), TypeError, r"inverse: dtype torch.float32"),
    "reduce_int_y": (lambda: _reduce(y=torch.ones(6, N, dtype=torch.int32)), TypeError, r"y: dtype torch.int32 is not allowed"),
    # topk_ids where the weights go (int64, the same shape) weighted each row by its expert id; float
    # offsets and tensors on another device were read without an error.
    "reduce_ids_as_weights": (lambda: _reduce(topk_weights=torch.randint(0, 4, (3, 2))), TypeError,
                              r"topk_weights: dtype torch.int64 is not allowed; allowed: torch.float32"),
    "reduce_float_offsets": (lambda: _reduce(expert_offsets=torch.tensor([0.0, 4.0, 6.0])), TypeError,
                             r"expert_offsets: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    "reduce_weights_on_meta": (lambda: _reduce(topk_weights=torch.rand(3, 2, device="meta")), ValueError,
                               r"topk_weights: on meta, but y is on cpu; all tensors must share one device"),
    "reduce_offsets_on_meta": (lambda: _reduce(expert_offsets=torch.tensor([0, 4, 6], dtype=torch.int32, device="meta")), ValueError,
                               r"expert_offsets: on meta, but y is on cpu"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("where", ["real", "fake"])
def test_ops_reject_bad_args(case, where):
    build, exc, match = BAD[case]
    op, args = build()
    with pytest.raises(exc, match=match):
        op(*args) if where == "real" else run_fake(op, args)


@pytest.mark.parametrize("build", [_gemm, _reduce])
def test_ops_accept_the_base_args(build):
    # Positive control for test_ops_reject_bad_args.
    op, args = build()
    assert_fake_matches(op, args)


# ---- compile and host syncs --------------------------------------------------------------------


def _plan(m):
    return OPS.routing_plan(torch.randint(-1, E + 1, (m, 2), dtype=torch.int32), E, None)


def _nvfp4_gemm(a, wq, w_scale, w_global, offsets, gather_idx):
    """nvfp4 activations (quantized by the op) times nvfp4 weights."""
    a_global = torch.full((1,), 0.01)
    aq, a_scale = OPS.quantize(a, "nvfp4", [1, 16], None, a_global)
    return OPS.grouped_gemm(aq, a_scale, a_global, "nvfp4", [1, 16], wq, w_scale, w_global, None, "nvfp4", [1, 16],
                            None, offsets, gather_idx, torch.float32)  # fmt: skip


def _nvfp4_inputs(m):
    w = torch.randn(E, N, K)
    w_global = formats.nvfp4_global_scale(w, dims=(1, 2))
    return (torch.randn(m, K), *formats.quantize_nvfp4(w, w_global), w_global, *_plan(m)[:2])


def _mxfp4_gemm(a, wq, w_scale, offsets, gather_idx):
    return OPS.grouped_gemm(a, None, None, "none", NONE, wq, w_scale, None, None, "mxfp4", [1, 32], None, offsets,
                            gather_idx, torch.float32)  # fmt: skip


# name -> (function of tensors, its inputs for M tokens)
SINGLE_OPS = {
    "routing_plan": (lambda ids, emap: OPS.routing_plan(ids, E, emap),
                     lambda m: (torch.randint(-1, 7, (m, 2)), torch.tensor([0, -1, 1, 2, -1, 3]))),
    "grouped_gemm": (lambda a, w, off, g, b: call_gemm(a, w, off, g, b),
                     lambda m: (torch.randn(m, K), torch.randn(E, K, N).transpose(1, 2), _plan(m)[0], _plan(m)[1], torch.randn(E, N))),
    # The quantized formats' decoders and encoders (e2m1 built its tables with torch.tensor on the
    # device: a host-to-device copy per call).
    "grouped_gemm_nvfp4": (_nvfp4_gemm, _nvfp4_inputs),
    "grouped_gemm_mxfp4": (_mxfp4_gemm, lambda m: (torch.randn(m, K), *formats.quantize_mxfp4(torch.randn(E, N, K)), *_plan(m)[:2])),
    "activation": (lambda x: OPS.activation(x, "swigluoai", 1.702, 7.0, True), lambda m: (torch.randn(2 * N, 2 * m).t(),)),
    "weighted_reduce": (lambda y, w, inv, off: OPS.weighted_reduce(y, w, inv, off),
                        lambda m: (torch.randn(2 * m, N), torch.rand(m, 2), _plan(m)[2], _plan(m)[0])),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SINGLE_OPS))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_single_op_compiles_to_one_dynamic_graph(name, backend):
    fn, make = SINGLE_OPS[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 11):
        args = make(m)
        want, got = fn(*args), compiled(*args)
        for w, g in zip(*((want, got) if isinstance(want, tuple) else ((want,), (got,)))):
            assert torch.equal(w, g) and w.stride() == g.stride()
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(SINGLE_OPS))
def test_single_op_reads_no_values_on_the_host(name):
    fn, make = SINGLE_OPS[name]
    args = make(5)
    with no_host_reads():
        fn(*args)
