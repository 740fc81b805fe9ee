"""The fused ops' argument contract: a bad argument to moe_ops::gate_up or moe_ops::down_reduce raises the
same ValueError/TypeError, naming it, from the real impl and from the fake impl (what torch.compile
traces). Before, the fake impls checked nothing: a call traced with, say, a bias of the wrong width
compiled, and failed inside the reference's computation (or misread memory on the kernels' path) when
it ran."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from lowering.fused_ops import down_reduce, gate_up
from moe_ops.plan import routing_plan
from moe_ops.reference import relative_error, tolerance

E, H, I, K_TOP, M = 4, 32, 16, 2, 3
NONE = [-1, -1]


def _plan():
    gen = torch.Generator().manual_seed(0)
    topk_weights, topk_ids = moe_ops.route(torch.randn(M, E, generator=gen), K_TOP)
    return (topk_weights, topk_ids, *routing_plan(topk_ids, E, None))


def _gate_up(**changes):
    _, topk_ids, offsets, gather_idx, _ = _plan()
    args = dict(
        x=torch.randn(M, H), a_scale=None, a_global_scale=None, a_dtype="none", a_group=NONE,
        w=torch.randn(E, 2 * I, H), w_scale=None, w_global_scale=None, w_zero=None, w_dtype="none", w_group=NONE,
        bias=torch.randn(E, 2 * I), expert_offsets=offsets, gather_idx=gather_idx,
        activation="silu", alpha=1.702, limit=7.0, interleaved=False,
        out_quant_dtype="none", out_quant_group=NONE, out_scale=None, out_global_scale=None, out_dtype=torch.float32,
        expert_ids=topk_ids,
    )  # fmt: skip
    return gate_up, list({**args, **changes}.values())


def _down_reduce(**changes):
    topk_weights, _, offsets, _, inverse = _plan()
    args = dict(
        a=torch.randn(M * K_TOP, I), a_scale=None, a_global_scale=None, a_dtype="none", a_group=NONE,
        w=torch.randn(E, H, I), w_scale=None, w_global_scale=None, w_zero=None, w_dtype="none", w_group=NONE,
        bias=torch.randn(E, H), expert_offsets=offsets, topk_weights=topk_weights,
        inverse=inverse, out_dtype=torch.float32,
    )  # fmt: skip
    return down_reduce, list({**args, **changes}.values())


_I32 = torch.int32
# name -> (op and arguments, exception, message)
BAD = {
    "gate_up_x_width": (lambda: _gate_up(x=torch.randn(M, H + 1)), ValueError,
                        r"x and w: K differs, x \(3, 33\) \(none\) holds K=33, w \(4, 32, 32\) \(none\) K=32"),
    "gate_up_int_x": (lambda: _gate_up(x=torch.ones(M, H, dtype=_I32)), TypeError, r"x: dtype torch.int32 is not allowed"),
    "gate_up_bias_width": (lambda: _gate_up(bias=torch.randn(E, 2 * I + 1)), ValueError, r"bias: expected shape \(4, 32\) \(\[E, N\]\)"),
    "gate_up_offsets_E+2": (lambda: _gate_up(expert_offsets=torch.zeros(E + 2, dtype=_I32)), ValueError,
                            r"expert_offsets: expected shape \(5,\) \(\[E\+1\]\), got \(6,\)"),
    "gate_up_float_gather": (lambda: _gate_up(gather_idx=torch.zeros(M * K_TOP)), TypeError, r"gather_idx: dtype torch.float32"),
    "gate_up_unknown_activation": (lambda: _gate_up(activation="tanh"), ValueError, r"kind: got 'tanh'; allowed: 'silu'"),
    "gate_up_interleaved_relu2": (lambda: _gate_up(activation="relu2", interleaved=True), ValueError,
                                  r"interleaved: 'relu2' has no gate"),
    "gate_up_odd_gated_N": (lambda: _gate_up(w=torch.randn(E, 2 * I - 1, H), bias=None), ValueError,
                            r"w: 'silu' splits GEMM1's N=31 outputs into gate and up halves; N must be even"),
    "gate_up_unknown_a_dtype": (lambda: _gate_up(a_dtype="fp4"), ValueError, r"a_dtype: got 'fp4'; allowed: 'none', 'fp8'"),
    "gate_up_fp8_bad_group": (lambda: _gate_up(a_dtype="fp8", a_group=[2, 3]), ValueError, r"ActivationQuant.group"),
    "gate_up_nvfp4_no_global": (lambda: _gate_up(a_dtype="nvfp4", a_group=[1, 16]), ValueError,
                                r"a_global_scale: nvfp4 needs its float32 global scale"),
    "gate_up_out_quant_unknown": (lambda: _gate_up(out_quant_dtype="int4"), ValueError, r"out_quant_dtype: got 'int4'; allowed: 'none', 'fp8'"),
    "gate_up_out_scale_not_per_tensor": (lambda: _gate_up(out_quant_dtype="fp8", out_quant_group=NONE, out_scale=torch.ones(2)),
                                         ValueError, r"out_scale: a static scale is one per-tensor value, got shape \(2,\)"),
    "gate_up_out_global_for_fp8": (lambda: _gate_up(out_quant_dtype="fp8", out_quant_group=[1, -1], out_global_scale=torch.ones(1)),
                                   ValueError, r"out_global_scale: only nvfp4 uses a global scale"),
    "gate_up_ids_1d": (lambda: _gate_up(expert_ids=torch.zeros(M * K_TOP, dtype=_I32)), ValueError, r"expert_ids: expected 2-D"),
    "gate_up_ids_float": (lambda: _gate_up(expert_ids=torch.zeros(M, K_TOP)), TypeError, r"expert_ids: dtype torch.float32"),
    "gate_up_ids_pairs": (lambda: _gate_up(expert_ids=torch.zeros(M + 1, K_TOP, dtype=_I32)), ValueError,
                          r"expert_ids: expected the plan's topk_ids \[M, k\] with M\*k = 6 routed pairs, got shape \(4, 2\)"),
    # Fewer ids than routed pairs too: the kernels read one id per pair (and the CPU reference none, so
    # only this check stops the call there).
    "gate_up_ids_too_few": (lambda: _gate_up(expert_ids=torch.zeros(M - 1, K_TOP, dtype=_I32)), ValueError,
                            r"expert_ids: expected the plan's topk_ids \[M, k\] with M\*k = 6 routed pairs, got shape \(2, 2\)"),
    "gate_up_int_out": (lambda: _gate_up(out_dtype=torch.int32), TypeError, r"out_dtype: got torch.int32"),
    # The re-quantized intermediate is GEMM1's N / 2 wide for a gated activation: nvfp4 needs that width
    # even (N = 30 is even, its half 15 is not).
    "gate_up_nvfp4_odd_intermediate": (lambda: _gate_up(w=torch.randn(E, 30, H), bias=None, out_quant_dtype="nvfp4", out_quant_group=[1, 16],
                                                        out_global_scale=torch.ones(1)), ValueError,
                                       r"the intermediate: nvfp4 packs two values per byte; K must be even, got K=15"),
    # relu2 re-quantizes all N of GEMM1's outputs (no gate halves them): N = 15 is odd for nvfp4.
    "gate_up_relu2_nvfp4_odd_intermediate": (lambda: _gate_up(w=torch.randn(E, 15, H), bias=None, activation="relu2", out_quant_dtype="nvfp4",
                                                              out_quant_group=[1, 16], out_global_scale=torch.ones(1)), ValueError,
                                             r"the intermediate: nvfp4 packs two values per byte; K must be even, got K=15"),
    # Every tensor argument shares x's device, the re-quantization's static scale and the kernels' expert_ids
    # hint included (the CPU reference never reads the hint, the kernels do).
    "gate_up_meta_out_scale": (lambda: _gate_up(out_quant_dtype="fp8", out_scale=torch.ones(1, device="meta")), ValueError,
                               r"out_scale: on meta, but x is on cpu"),
    "gate_up_meta_a_scale": (lambda: _gate_up(a_dtype="fp8", a_scale=torch.ones(1, device="meta")), ValueError,
                             r"a_scale: on meta, but x is on cpu"),
    "gate_up_meta_a_global_scale": (lambda: _gate_up(a_dtype="nvfp4", a_group=[1, 16], a_global_scale=torch.ones(1, device="meta")),
                                    ValueError, r"a_global_scale: on meta, but x is on cpu"),
    "gate_up_meta_out_global_scale": (lambda: _gate_up(out_quant_dtype="nvfp4", out_quant_group=[1, 16],
                                                       out_global_scale=torch.ones(1, device="meta")),
                                      ValueError, r"out_global_scale: on meta, but x is on cpu"),
    "gate_up_meta_expert_ids": (lambda: _gate_up(expert_ids=torch.zeros(M, K_TOP, dtype=_I32, device="meta")), ValueError,
                                r"expert_ids: on meta, but x is on cpu"),
    "down_reduce_a_width": (lambda: _down_reduce(a=torch.randn(M * K_TOP, I + 1)), ValueError, r"a and w: K differs"),
    "down_reduce_a_rows": (lambda: _down_reduce(a=torch.randn(M * K_TOP + 1, I)), ValueError,
                           r"a \(7, 16\): expected M\*k=6 rows for topk_weights \(3, 2\), got 7"),
    "down_reduce_short_inverse": (lambda: _down_reduce(inverse=torch.arange(M * K_TOP - 1, dtype=_I32)), ValueError,
                                  r"inverse: expected shape \(6,\)"),
    "down_reduce_1d_weights": (lambda: _down_reduce(topk_weights=torch.rand(M * K_TOP)), ValueError, r"topk_weights: expected 2-D"),
    "down_reduce_bias_width": (lambda: _down_reduce(bias=torch.randn(E, H + 1)), ValueError, r"bias: expected shape \(4, 32\)"),
    "down_reduce_int8_without_scale": (lambda: _down_reduce(a_dtype="int8", a=torch.ones(M * K_TOP, I, dtype=torch.int8)),
                                       ValueError, r"a_scale: 'int8' values need their scales, got None"),
    "down_reduce_norm_width": (lambda: _down_reduce(weights_early=False, norm_weight=torch.randn(H + 1), norm_eps=1e-6), ValueError,
                               r"weight: expected shape \(32,\) \(\[H\] for y \(0, 32\)\), got \(33,\)"),
    "down_reduce_norm_eps": (lambda: _down_reduce(weights_early=False, norm_weight=torch.randn(H), norm_eps=0.0), ValueError,
                             r"eps: got 0.0; allowed: > 0"),
    "down_reduce_meta_weights": (lambda: _down_reduce(topk_weights=torch.rand(M, K_TOP, device="meta")), ValueError,
                                 r"topk_weights: on meta, but a is on cpu"),
    "down_reduce_meta_inverse": (lambda: _down_reduce(inverse=torch.arange(M * K_TOP, dtype=_I32, device="meta")), ValueError,
                                 r"on meta, but"),
}  # fmt: skip


def _run(where: str, op, args):
    if where == "real":
        return op(*args)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def _real_matching_fake(op, args) -> tuple:
    """The real impl's outputs (as a tuple), after checking the fake impl gives each one's shape, dtype
    and strides."""
    real, fake = _run("real", op, args), _run("fake", op, args)
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for r, f in zip(real, fake, strict=True):
        assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride())
    return real


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("where", ["real", "fake"])
def test_fused_ops_reject_bad_args(case, where):
    build, exc, match = BAD[case]
    op, args = build()
    with pytest.raises(exc, match=match):
        _run(where, op, args)


@pytest.mark.parametrize("build", [_gate_up, _down_reduce])
def test_fused_ops_accept_the_base_args(build):
    # Positive control for test_fused_ops_reject_bad_args: the base arguments run in both impls and agree.
    real = _real_matching_fake(*build())
    assert real[0].abs().sum() > 0


@pytest.mark.parametrize("build, x_name", [(_gate_up, "x"), (_down_reduce, "a")])
def test_fused_ops_output_dtype_is_out_dtype_not_the_inputs(build, x_name):
    # bf16 inputs with out_dtype float32: the output is float32 from the real impl and from the fake
    # one alike (every other call in these tests has out_dtype equal to the inputs' dtype, so a fake impl
    # that followed the inputs' dtype would have gone unseen).
    _, base = build()  # positional: x (or a) first, w sixth
    op, args = build(**{x_name: base[0].to(torch.bfloat16), "w": base[5].to(torch.bfloat16), "bias": None})
    assert _real_matching_fake(op, args)[0].dtype == torch.float32


def test_gate_up_accepts_an_odd_width_for_an_ungated_activation():
    # Only a gated activation splits GEMM1's N outputs into halves and needs N even; relu2's
    # intermediate is all N = 31 of them, from the real and the fake impl alike.
    op, args = _gate_up(w=torch.randn(E, 31, H), bias=None, activation="relu2")
    assert _real_matching_fake(op, args)[0].shape == (M * K_TOP, 31)


def test_gate_up_requantizes_relu2s_whole_width():
    # relu2's intermediate is all N = 30 of GEMM1's outputs, re-quantized to nvfp4 (two values a byte:
    # [P, 15] codes) from the real and the fake impl alike; half of it (15) would be refused as odd.
    op, args = _gate_up(w=torch.randn(E, 30, H), bias=None, activation="relu2", out_quant_dtype="nvfp4", out_quant_group=[1, 16],
                        out_global_scale=torch.ones(1))  # fmt: skip
    codes, scales = _real_matching_fake(op, args)
    assert codes.shape == (M * K_TOP, 15) and codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn


def _down_reduce_float64(a, w, bias, topk_weights, topk_ids, inverse, norm_weight=None, norm_eps=0.0):
    """float64 [M, H], pair by pair: out[m] = sum_j topk_weights[m, j] * f(a[inverse[m*k+j]] @ w[e].T + bias[e])
    with e = topk_ids[m, j], f the input-scaled RMS norm (expert_norm.py) or the identity; written out
    here, independent of the ops' composition."""
    m, k = topk_ids.shape
    out = torch.zeros(m, w.shape[1], dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            e = int(topk_ids[t, j])
            y = a[int(inverse[t * k + j])].double() @ w[e].double().T
            if bias is not None:
                y = y + bias[e].double()
            if norm_weight is not None:
                s = y * (1 + norm_weight.double())
                y = s / torch.sqrt((s * s).mean() + norm_eps)
            out[t] += topk_weights[t, j].double() * y
    return out


def test_down_reduce_with_a_post_expert_norm():
    # With norm_weight, each of GEMM2's rows is normalized before the weighted sum: against float64
    # pair by pair (the fake impl gives its shape, dtype and strides), and opcheck passes with the two
    # extra arguments. Without the norm the result is far from it.
    norm_weight = torch.randn(H) * 0.3
    op, args = _down_reduce(weights_early=False, norm_weight=norm_weight, norm_eps=1e-5)
    (out,) = _real_matching_fake(op, args)
    _, topk_ids, *_ = _plan()
    a, w, bias, topk_weights, inverse = args[0], args[5], args[11], args[13], args[14]
    want = _down_reduce_float64(a, w, bias, topk_weights, topk_ids, inverse, norm_weight, 1e-5)
    assert relative_error(out, want) <= tolerance(torch.float32)
    assert relative_error(_down_reduce_float64(a, w, bias, topk_weights, topk_ids, inverse), want) > 0.1
    torch.library.opcheck(op, tuple(args))


def test_down_reduce_weighs_rows_by_signed_router_weights():
    # The router weights multiply GEMM2's rows as given, sign included (a weight is not a probability
    # for every router): against float64 pair by pair with weights of both signs, and far from the
    # same sum with the weights' magnitudes.
    topk_weights = torch.randn(M, K_TOP)
    topk_weights[0, 0] = -abs(topk_weights[0, 0]) - 0.5
    op, args = _down_reduce(bias=None, topk_weights=topk_weights)
    _, topk_ids, *_ = _plan()
    a, w, inverse = args[0], args[5], args[14]  # positional, as _down_reduce orders them
    out = op(*args)
    assert relative_error(out, _down_reduce_float64(a, w, None, topk_weights, topk_ids, inverse)) <= tolerance(torch.float32)
    assert relative_error(out, _down_reduce_float64(a, w, None, topk_weights.abs(), topk_ids, inverse)) > 0.1