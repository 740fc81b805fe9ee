"""Bad input raises ValueError/TypeError naming the argument (and the allowed values where the code
states them) before any moe_ops op runs; value checks are eager-only, so compiled calls drop
out-of-range expert ids instead of raising."""
from __future__ import annotations

import dataclasses
import importlib
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops import quant
from moe_ops.quant import (
    PER_CHANNEL,
    PER_TENSOR,
    PER_TOKEN,
    ActivationQuant,
    GroupShape,
    QuantConfig,
    QuantScheme,
    WeightQuant,
)
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..seeds import generator

FE_MODULE = importlib.import_module("moe_ops.fused_experts")
ROUTING_MODULE = importlib.import_module("moe_ops.routing")

E, H, I, M, K = 4, 32, 16, 6, 2
F32_TOL = tolerance(torch.float32)


def _ids(m: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    g = generator(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)


def _inputs(dtype=torch.float32, e=E, h=H, i=I, m=M, k=K, seed=0) -> dict:
    g = generator(seed)
    return dict(
        hidden_states=torch.randn(m, h, generator=g).to(dtype),
        w13=(torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)).to(dtype),
        w2=(torch.randn(e, h, i, generator=g) / math.sqrt(i)).to(dtype),
        topk_weights=torch.rand(m, k, generator=g),
        topk_ids=_ids(m, k, e, seed),
    )


def _call(kw: dict):
    kw = dict(kw)
    args = [kw.pop(n) for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")]
    return moe_ops.fused_experts(*args, **kw)


class _OpCalled(AssertionError):
    pass


@pytest.fixture
def no_ops(monkeypatch):
    """Replace every op fused_experts and route call with a sentinel that records the call and fails."""
    calls = []

    def sentinel(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise _OpCalled(f"moe_ops op {name} ran before the bad input was rejected")

        return fn

    for name in ("routing_plan", "quantize", "grouped_gemm", "activation_op", "weighted_reduce"):
        monkeypatch.setattr(FE_MODULE, name, sentinel(name))
    monkeypatch.setattr(ROUTING_MODULE, "route_op", sentinel("route"))
    return calls


def test_no_ops_fixture_intercepts_valid_calls(no_ops):
    # The positive control: without it the "no op ran" checks below could not fail.
    with pytest.raises(_OpCalled):
        _call(_inputs())
    assert no_ops == ["routing_plan"]
    with pytest.raises(_OpCalled):
        moe_ops.route(torch.randn(3, E), 2)
    assert no_ops == ["routing_plan", "route"]


def test_valid_inputs_run():
    kw = _inputs()
    out = _call(kw)
    ref = moe_float64(*(kw[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")))
    assert relative_error(out, ref) <= F32_TOL


# ---- fused_experts, unquantized ------------------------------------------------------------------


def _noncontig_last(t):
    """Same values, last-dim stride != 1."""
    return t.t().contiguous().t() if t.dim() == 2 else t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _neither_row_nor_col_major(w):
    # experts innermost: strides (1, N*E, E) -- each expert's matrix is neither row- nor column-major
    return w.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def _with(**changes):
    return lambda kw: {**kw, **changes}


def _edit(name, fn):
    return lambda kw: {**kw, name: fn(kw[name])}


def _bad_id(value, where=(1, 0)):
    def fn(ids):
        ids = ids.clone()
        ids[where] = value
        return ids

    return fn


BAD_FUSED = [
    # dtypes
    ("hidden_int", _edit("hidden_states", lambda x: x.to(torch.int32)), TypeError,
     r"hidden_states: dtype torch.int32 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16"),
    ("hidden_f64", _edit("hidden_states", lambda x: x.double()), TypeError, r"hidden_states: dtype torch.float64"),
    ("topk_weights_bf16", _edit("topk_weights", lambda t: t.bfloat16()), TypeError,
     r"topk_weights: dtype torch.bfloat16 is not allowed; allowed: torch.float32"),
    ("topk_ids_float", _edit("topk_ids", lambda t: t.float()), TypeError,
     r"topk_ids: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    ("w13_dtype_differs", _edit("w13", lambda w: w.bfloat16()), TypeError,
     r"w13: dtype torch.bfloat16 differs from hidden_states' torch.float32"),
    ("w2_dtype_differs", _edit("w2", lambda w: w.half()), TypeError, r"w2: dtype torch.float16 differs from hidden_states'"),
    ("w13_int8_unquantized", _edit("w13", lambda w: w.to(torch.int8)), TypeError, r"w13: dtype torch.int8"),
    ("hidden_not_tensor", _edit("hidden_states", lambda x: x.tolist()), TypeError,
     r"hidden_states: expected a torch.Tensor, got list"),
    ("w2_not_tensor", _with(w2=None), TypeError, r"w2: expected a torch.Tensor, got NoneType"),
    # ranks and shapes
    ("hidden_1d", _edit("hidden_states", lambda x: x[0]), ValueError, r"hidden_states: expected 2-D \[M, H\], got shape \(32,\)"),
    ("w13_2d", _edit("w13", lambda w: w[0]), ValueError, r"w13: expected 3-D"),
    ("w2_2d", _edit("w2", lambda w: w[0]), ValueError, r"w2: expected 3-D \[E, H, I\]"),
    ("topk_ids_1d", _edit("topk_ids", lambda t: t[:, 0]), ValueError, r"topk_ids: expected 2-D \[M, k\]"),
    ("topk_weights_1d", _edit("topk_weights", lambda t: t[:, 0]), ValueError, r"topk_weights: expected 2-D \[M, k\]"),
    ("hidden_wrong_H", _edit("hidden_states", lambda x: torch.randn(M, H + 1)), ValueError,
     r"w2: expected shape \[E, H=33, I\], got \(4, 32, 16\)"),
    ("w2_wrong_E", _edit("w2", lambda w: w[:-1]), ValueError, r"w2: has 3 experts, w13 has 4"),
    ("w13_wrong_E", _edit("w13", lambda w: w[:-1]), ValueError, r"w2: has 4 experts, w13 has 3"),
    ("w2_wrong_H", _edit("w2", lambda w: torch.randn(E, H + 2, I)), ValueError, r"w2: expected shape \[E, H=32, I\]"),
    ("w13_wrong_rows", _edit("w13", lambda w: torch.randn(E, 2 * I + 2, H)), ValueError,
     r"w13: activation 'silu' needs 32 rows per expert \(2I with I=16 from w2\), got shape \(4, 34, 32\)"),
    ("w13_I_rows_for_gated", _edit("w13", lambda w: w[:, :I]), ValueError, r"w13: activation 'silu' needs 32 rows"),
    ("w13_wrong_cols", _edit("w13", lambda w: torch.randn(E, 2 * I, H - 1)), ValueError, r"w13: expected 32 columns \(H=32\)"),
    ("w2_wrong_I", _edit("w2", lambda w: torch.randn(E, H, I + 1)), ValueError, r"w13: activation 'silu' needs 34 rows"),
    ("topk_shapes_differ", _edit("topk_weights", lambda t: t[:, :1]), ValueError,
     r"topk_weights and topk_ids: expected both \[M=6, k\], got \(6, 1\) and \(6, 2\)"),
    ("topk_M_differs", lambda kw: {**kw, "topk_weights": kw["topk_weights"][:-1], "topk_ids": kw["topk_ids"][:-1]},
     ValueError, r"topk_weights and topk_ids: expected both \[M=6, k\], got \(5, 2\) and \(5, 2\)"),
    ("top_k_gt_E", lambda kw: {**kw, "topk_weights": torch.rand(M, E + 1), "topk_ids": torch.randint(0, E, (M, E + 1))},
     ValueError, r"topk_ids: top_k=5 is larger than the number of experts E=4"),
    ("top_k_0", lambda kw: {**kw, "topk_weights": torch.rand(M, 0), "topk_ids": torch.zeros(M, 0, dtype=torch.int32)},
     ValueError, r"topk_ids: top_k=0 \(shape \(6, 0\)\); allowed: top_k >= 1"),
    ("top_k_0_no_tokens", lambda kw: {**kw, "hidden_states": kw["hidden_states"][:0], "topk_weights": torch.rand(0, 0),
                                      "topk_ids": torch.zeros(0, 0, dtype=torch.int32)},
     ValueError, r"topk_ids: top_k=0 \(shape \(0, 0\)\); allowed: top_k >= 1"),
    # expert ids (eager value checks)
    ("id_eq_E", _edit("topk_ids", _bad_id(E)), ValueError, r"topk_ids: value 4 is outside \[0, 4\) \(expert ids\)"),
    ("id_negative", _edit("topk_ids", _bad_id(-1)), ValueError, r"topk_ids: value -1 is outside \[0, 4\)"),
    ("id_huge_int64", _edit("topk_ids", lambda t: _bad_id(2**40)(t.long())), ValueError,
     r"topk_ids: value 1099511627776 is outside \[0, 4\)"),
    ("id_outside_expert_map", lambda kw: {**kw, "expert_map": torch.arange(E, dtype=torch.int32),
                                           "topk_ids": _bad_id(E)(kw["topk_ids"])},
     ValueError, r"topk_ids: value 4 is outside \[0, 4\) \(expert ids \(global, indexing expert_map\)\)"),
    ("id_outside_global_map", lambda kw: {**kw, "expert_map": torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]),
                                           "topk_ids": _bad_id(8)(kw["topk_ids"])},
     ValueError, r"topk_ids: value 8 is outside \[0, 8\)"),
    ("expert_map_value_eq_E", _with(expert_map=torch.tensor([0, 1, 2, 4], dtype=torch.int32)), ValueError,
     r"expert_map: value 4 is outside \[-1, 4\) \(-1 or a local expert id < E=4\)"),
    ("expert_map_value_lt_-1", _with(expert_map=torch.tensor([0, 1, -2, 3])), ValueError,
     r"expert_map: value -2 is outside \[-1, 4\)"),
    ("expert_map_float", _with(expert_map=torch.arange(E).float()), TypeError,
     r"expert_map: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    ("expert_map_2d", _with(expert_map=torch.arange(E).view(2, 2)), ValueError, r"expert_map: expected 1-D \[E_global\]"),
    ("top_k_gt_global_E", lambda kw: {**kw, "topk_weights": torch.rand(M, 3), "topk_ids": torch.zeros(M, 3, dtype=torch.int32),
                                      "expert_map": torch.tensor([0, 1])},
     ValueError, r"topk_ids: top_k=3 is larger than the number of experts E=2"),
    # devices
    ("w2_on_meta", _edit("w2", lambda w: w.to("meta")), ValueError,
     r"w2: on meta, but hidden_states is on cpu; all tensors must share one device"),
    ("topk_ids_on_meta", _edit("topk_ids", lambda t: t.to("meta")), ValueError, r"topk_ids: on meta, but hidden_states is on cpu"),
    ("hidden_on_meta", _edit("hidden_states", lambda x: x.to("meta")), ValueError, r"w13: on cpu, but hidden_states is on meta"),
    ("bias_on_meta", _with(w2_bias=torch.zeros(E, H, device="meta")), ValueError, r"w2_bias: on meta, but hidden_states is on cpu"),
    ("expert_map_on_meta", _with(expert_map=torch.arange(E, device="meta")), ValueError, r"expert_map: on meta"),
    # layout
    ("hidden_noncontig_last", _edit("hidden_states", _noncontig_last), ValueError,
     r"hidden_states: the last dimension must be contiguous \(stride 1\), got strides \(1, 6\); call .contiguous\(\)"),
    ("hidden_strided_slice", _edit("hidden_states", lambda x: torch.randn(M, 2 * H)[:, ::2]), ValueError,
     r"hidden_states: the last dimension must be contiguous"),
    ("w13_neither_layout", _edit("w13", _neither_row_nor_col_major), ValueError,
     r"w13: each expert's matrix must be row-major \(stride\(2\) == 1\) or column-major \(stride\(1\) == 1\)"),
    ("w2_every_other_col", _edit("w2", lambda w: torch.randn(E, H, 2 * I)[:, :, ::2]), ValueError,
     r"w2: each expert's matrix must be row-major"),
    # biases
    ("w13_bias_wrong_shape", _with(w13_bias=torch.zeros(E, I)), ValueError,
     r"w13_bias: expected shape \(4, 32\) \(\[E, N\]\), got \(4, 16\)"),
    ("w2_bias_wrong_E", _with(w2_bias=torch.zeros(E + 1, H)), ValueError, r"w2_bias: expected shape \(4, 32\)"),
    ("w13_bias_int", _with(w13_bias=torch.zeros(E, 2 * I, dtype=torch.int32)), TypeError,
     r"w13_bias: dtype torch.int32 is not allowed"),
    ("bias_twice_w13", _with(w13_bias=torch.zeros(E, 2 * I), quant_config=quant.unquantized(w13_bias=torch.zeros(E, 2 * I))),
     ValueError, r"w13_bias: given both as an argument and in quant_config; give it once"),
    ("bias_twice_w2", _with(w2_bias=torch.zeros(E, H), quant_config=quant.unquantized(w2_bias=torch.zeros(E, H))),
     ValueError, r"w2_bias: given both as an argument and in quant_config"),
    ("config_bias_wrong_shape", _with(quant_config=quant.unquantized(w2_bias=torch.zeros(E, H - 1))), ValueError,
     r"w2_bias: expected shape \(4, 32\)"),
    # activation, config type, apply_router_weight_on_input
    ("activation_unknown", _with(activation="swish"), ValueError,
     r"activation: got 'swish'; allowed: 'silu', 'gelu', 'gelu_tanh', 'swigluoai', 'silu_clamped', 'swiglu_softcapped', 'relu2'"),
    ("activation_not_str", _with(activation=3), TypeError, r"activation: expected a str or moe_ops.Activation, got int"),
    ("relu2_with_2I_rows", _with(activation="relu2"), ValueError, r"w13: activation 'relu2' needs 16 rows per expert \(I with I=16"),
    ("quant_config_is_scheme", _with(quant_config=quant.UNQUANTIZED), TypeError,
     r"quant_config: expected moe_ops.QuantConfig or None, got QuantScheme"),
    ("router_weight_on_input_topk2", _with(apply_router_weight_on_input=True), ValueError,
     r"apply_router_weight_on_input: needs top_k == 1, got top_k=2"),
    # a str was truthy: "False" multiplied the input by the router weight
    ("router_weight_on_input_str", _with(apply_router_weight_on_input="False"), TypeError,
     r"apply_router_weight_on_input: expected a bool, got str 'False'"),
]


@pytest.mark.parametrize("mutate, exc, match", [c[1:] for c in BAD_FUSED], ids=[c[0] for c in BAD_FUSED])
def test_fused_experts_rejects(no_ops, mutate, exc, match):
    kw = mutate(_inputs())
    with pytest.raises(exc, match=match):
        _call(kw)
    assert no_ops == []


@pytest.mark.parametrize(
    "name, value",
    [("w2_bias", [0.0] * H), ("w13_bias", 0.0), ("expert_map", [0, 1, 2, 3])],
)
def test_fused_experts_rejects_non_tensor_optional_args(no_ops, name, value):
    kw = {**_inputs(), name: value}
    with pytest.raises(TypeError, match=rf"{name}: expected a torch.Tensor"):
        _call(kw)
    assert no_ops == []


@pytest.mark.parametrize(
    "mutate",
    [
        _edit("w13", lambda w: w.transpose(1, 2).contiguous().transpose(1, 2)),  # column-major per expert
        _edit("w2", lambda w: w.transpose(1, 2).contiguous().transpose(1, 2)),
        _edit("w13", lambda w: torch.cat([w, torch.zeros(E, 2 * I, 8)], 2)[:, :, :H]),  # padded rows
        _edit("w2", lambda w: w.transpose(0, 1).contiguous().transpose(0, 1)),  # experts not outermost
        _edit("hidden_states", lambda x: torch.cat([x, x], 1)[:, :H]),  # padded rows of hidden_states
        _edit("topk_weights", lambda t: t.t().contiguous().t()),  # topk tensors need no particular layout
        _edit("topk_ids", lambda t: t.long().t().contiguous().t()),
    ],
    ids=["w13_colmajor", "w2_colmajor", "w13_padded", "w2_expert_strided", "hidden_padded", "weights_colmajor", "ids_colmajor"],
)
def test_allowed_layouts_are_accepted_and_correct(mutate):
    base = _inputs()
    kw = mutate(dict(base))
    ref = moe_float64(*(base[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")))
    assert relative_error(_call(kw), ref) <= F32_TOL


def _map_tensors(kw: dict, fn) -> dict:
    """kw with fn applied to every tensor, those of its quant_config included."""
    kw = {n: (fn(v) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    if "quant_config" in kw:
        tensors = {n: fn(t) for n, t in kw["quant_config"].tensors().items() if t is not None}
        kw["quant_config"] = dataclasses.replace(kw["quant_config"], **tensors)
    return kw


@pytest.mark.parametrize(
    "build, dtype",
    [
        (lambda: _inputs(), torch.float32),
        (lambda: _inputs(torch.bfloat16), torch.bfloat16),
        (lambda: {**_inputs(), "expert_map": torch.tensor([0, 1, 2, 3, -1, -1]), "topk_ids": _ids(M, K, 6)}, torch.float32),
        (lambda: _quantized(FP8_TOKEN), torch.float32),
    ],
    ids=["f32", "bf16", "expert_map", "fp8_w8a8"],
)
@pytest.mark.parametrize("where", ["meta", "fake"])
def test_fused_experts_on_tensors_without_values(build, dtype, where):
    """Meta tensors (a reference device) and FakeTensorMode's fake ones have no values to check: the
    eager value checks skip them, and the call gives the output's shape and dtype."""
    kw = build()
    if where == "meta":
        out = _call(_map_tensors(kw, lambda t: t.to("meta")))
        assert out.is_meta
    else:
        with FakeTensorMode() as mode:
            out = _call(_map_tensors(kw, mode.from_tensor))
    assert out.shape == (M, QH if "quant_config" in kw else H) and out.dtype == dtype


# ---- fused_experts, quantized --------------------------------------------------------------------

QH, QI = 64, 32  # mxfp4 groups of 32 along K need K >= 32


def _quantized(scheme, calibration=None):
    kw = _inputs(h=QH, i=QI)
    inter = None
    if calibration is not None:  # GEMM2's inputs: expert 0's SwiGLU of the calibration tokens (no op may run here)
        gate, up = (calibration @ kw["w13"][0].T).chunk(2, dim=1)
        inter = torch.nn.functional.silu(gate) * up
    q13, q2, config = quant.quantize_weights(scheme, kw["w13"], kw["w2"], calibration=calibration, intermediate_calibration=inter)
    return {**kw, "w13": q13, "w2": q2, "quant_config": config}


FP8_TOKEN = QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL))
INT4_G32 = QuantScheme(None, WeightQuant("int4", GroupShape(1, 32)))
INT4_G32_ZP = QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True))
NVFP4_W4A4 = QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16)))
FP8_STATIC = QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR))
FP8_W8A16 = QuantScheme(None, WeightQuant("fp8", PER_CHANNEL))


def _edit_config(name, fn):
    return lambda kw: {**kw, "quant_config": dataclasses.replace(kw["quant_config"], **{name: fn(getattr(kw["quant_config"], name))})}


BAD_QUANT = [
    ("fp8_w13_scale_shape", FP8_TOKEN, _edit_config("w13_scale", lambda s: s[:, :, :1].expand(-1, -1, 2).contiguous()),
     ValueError, r"w13_scale: expected shape \(4, 64, 1\) \(\[E, N/1, K/-1\]\), got \(4, 64, 2\)"),
    ("fp8_w2_scale_per_tensor_shape", FP8_TOKEN, _edit_config("w2_scale", lambda s: s[:, :1]), ValueError,
     r"w2_scale: expected shape \(4, 64, 1\)"),
    ("fp8_w13_scale_bf16", FP8_TOKEN, _edit_config("w13_scale", lambda s: s.bfloat16()), TypeError,
     r"w13_scale: dtype torch.bfloat16 is not allowed; allowed: torch.float32"),
    ("fp8_weight_float", FP8_TOKEN, lambda kw: {**kw, "w13": kw["w13"].float()}, TypeError,
     r"w13: dtype torch.float32 is not allowed; allowed: torch.float8_e4m3fn"),
    ("fp8_weight_shape", FP8_TOKEN, lambda kw: {**kw, "w2": kw["w2"][:, :, : QI // 2]}, ValueError, r"w13: activation 'silu' needs 32 rows"),
    ("fp8_w13_noncontig", FP8_TOKEN, lambda kw: {**kw, "w13": kw["w13"].transpose(1, 2).contiguous().transpose(1, 2)},
     ValueError, r"w13: quantized \(fp8\) weights must be contiguous"),
    ("fp8_w2_expert_noncontig", FP8_TOKEN, lambda kw: {**kw, "w2": kw["w2"].transpose(0, 1).contiguous().transpose(0, 1)},
     ValueError, r"w2: quantized \(fp8\) weights must be contiguous"),
    ("int4_w2_noncontig", INT4_G32, lambda kw: {**kw, "w2": torch.cat([kw["w2"], kw["w2"]], 2)[:, :, : QI // 2]},
     ValueError, r"w2: quantized \(int4\) weights must be contiguous"),
    ("int4_scale_int", INT4_G32, _edit_config("w2_scale", lambda s: s.to(torch.int32)), TypeError,
     r"w2_scale: dtype torch.int32 is not allowed; allowed: torch.float32, torch.bfloat16, torch.float16"),
    ("int4_zero_float", INT4_G32_ZP, _edit_config("w13_zero", lambda z: z.float()), TypeError,
     r"w13_zero: dtype torch.float32 is not allowed; allowed: torch.uint8"),
    ("int4_zero_shape", INT4_G32_ZP, _edit_config("w2_zero", lambda z: z[:, :-1]), ValueError,
     r"w2_zero: expected shape \(4, 64, 1\) \(like the scales\)"),
    ("int4_w13_unpacked", INT4_G32, lambda kw: {**kw, "w13": torch.cat([kw["w13"], kw["w13"]], 2)}, ValueError,
     r"w13: expected 32 columns \(H=64\)"),
    ("nvfp4_global_scale_shape", NVFP4_W4A4, _edit_config("w13_global_scale", lambda g: g[:1]), ValueError,
     r"w13_global_scale: expected shape \(4,\) \(\[E\]\), got \(1,\)"),
    ("nvfp4_global_scale_dtype", NVFP4_W4A4, _edit_config("w2_global_scale", lambda g: g.double()), TypeError,
     r"w2_global_scale: dtype torch.float64 is not allowed; allowed: torch.float32"),
    ("nvfp4_scale_dtype", NVFP4_W4A4, _edit_config("w13_scale", lambda s: s.float()), TypeError,
     r"w13_scale: dtype torch.float32 is not allowed; allowed: torch.float8_e4m3fn"),
    ("nvfp4_act_global_scale_shape", NVFP4_W4A4, _edit_config("a13_global_scale", lambda g: g.expand(2).contiguous()),
     ValueError, r"a13_global_scale: expected shape \(1,\) \(\[1\]\), got \(2,\)"),
    ("static_a2_scale_dtype", FP8_STATIC, _edit_config("a2_scale", lambda s: s.half()), TypeError,
     r"a2_scale: dtype torch.float16 is not allowed; allowed: torch.float32"),
    ("scale_on_meta", FP8_TOKEN, _edit_config("w2_scale", lambda s: s.to("meta")), ValueError,
     r"quant_config.w2_scale: on meta, but hidden_states is on cpu"),
    ("quant_bias_twice", FP8_TOKEN, lambda kw: {**kw, "w2_bias": torch.zeros(E, QH),
                                                "quant_config": dataclasses.replace(kw["quant_config"], w2_bias=torch.zeros(E, QH))},
     ValueError, r"w2_bias: given both as an argument and in quant_config"),
    # Packed codes with no config, or another format's: the dtype is the cause, named before any size
    # (they said "w13: activation 'silu' needs 32 rows per expert").
    ("int4_codes_without_config", INT4_G32, lambda kw: {**kw, "quant_config": None}, TypeError,
     r"w13: dtype torch.uint8 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16 \(quant_config unquantized, "
     r"quantized codes need the quant_config that describes them\)"),
    ("int4_codes_with_fp8_config", INT4_G32, lambda kw: {**kw, "quant_config": _quantized(FP8_TOKEN, calibration=None)["quant_config"]},
     TypeError, r"w13: dtype torch.uint8 is not allowed; allowed: torch.float8_e4m3fn \(quant_config fp8_w8a8_per_token\)"),
]


@pytest.mark.parametrize("scheme, mutate, exc, match", [c[1:] for c in BAD_QUANT], ids=[c[0] for c in BAD_QUANT])
def test_fused_experts_rejects_quantized(no_ops, scheme, mutate, exc, match):
    kw = _quantized(scheme, calibration=torch.randn(16, QH))
    with pytest.raises(_OpCalled):  # the unmodified config is valid: only the mutation is wrong
        _call(kw)
    no_ops.clear()
    with pytest.raises(exc, match=match):
        _call(mutate(kw))
    assert no_ops == []


def test_check_weights_rejects_an_odd_int4_k_that_its_group_divides():
    # int4 packs two values per byte: an odd K (33, in int4 groups of 11) cannot be stored, whatever group
    # divides it. QuantConfig.check_weights says so itself (fused_experts' own column count rejects it too,
    # as a shape mismatch; a direct check_weights call had only this check).
    h, i = 33, 22
    scheme = QuantScheme(None, WeightQuant("int4", GroupShape(1, 11)))
    config = QuantConfig(scheme, w13_scale=torch.ones(E, 2 * i, h // 11), w2_scale=torch.ones(E, h, i // 11))
    w13 = torch.zeros(E, 2 * i, (h + 1) // 2, dtype=torch.uint8)
    w2 = torch.zeros(E, h, i // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13: int4 packs two values per byte; K=33 must be even"):
        config.check_weights(w13, w2, h, i, 2 * i)


def test_int4_k_not_multiple_of_group(no_ops):
    kw = _inputs(h=QH, i=QI)
    scheme = QuantScheme(None, WeightQuant("int4", GroupShape(1, 128)))  # K=64 (w13) and 32 (w2): no group of 128 fits
    s = torch.ones(E, 2 * QI, 1)
    config = QuantConfig(scheme, w13_scale=s, w2_scale=torch.ones(E, QH, 1))
    w13 = torch.zeros(E, 2 * QI, QH // 2, dtype=torch.uint8)
    w2 = torch.zeros(E, QH, QI // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13: K=64 must be a multiple of the int4 group size 128"):
        moe_ops.fused_experts(kw["hidden_states"], w13, w2, kw["topk_weights"], kw["topk_ids"], quant_config=config)
    assert no_ops == []


# ---- backends: which device runs which scheme ----------------------------------------------------

BACKENDS = importlib.import_module("moe_ops.backends")
# The schemes that store or compute float8_e4m3fn (fp8 weights or activations, nvfp4's e4m3 scales,
# mxfp4_w4a8's fp8 activations), written out here rather than read from moe_ops.backends.
FP8_SCHEMES = {"fp8_w8a8_per_tensor", "fp8_w8a8_per_token", "fp8_w8a8_block", "fp8_w8a16", "nvfp4_w4a16", "nvfp4_w4a4", "mxfp4_w4a8"}


@pytest.mark.parametrize("scheme", sorted(quant.SCHEMES))
def test_device_without_float8_rejects_exactly_the_fp8_schemes(scheme):
    # MPS has no float8_e4m3fn tensors: a scheme that needs them is refused there by name, every other runs.
    mps = torch.device("mps")
    if scheme in FP8_SCHEMES:
        with pytest.raises(ValueError, match=rf"quant_config: scheme {scheme} cannot run on mps: mps has no float8_e4m3fn tensors"):
            BACKENDS.check_device_supports(scheme, mps)
    else:
        BACKENDS.check_device_supports(scheme, mps)
    for dev in ("cpu", "cuda", "meta"):
        BACKENDS.check_device_supports(scheme, torch.device(dev))


def test_unknown_device_type_is_refused_with_the_known_ones():
    s = BACKENDS.reference_support("unquantized", "xpu")
    assert not s.supported and s.reason == "device type 'xpu' is not one of cpu, cuda, meta, mps"
    with pytest.raises(ValueError, match=r"quant_config: scheme unquantized cannot run on xpu: device type 'xpu'"):
        BACKENDS.check_device_supports("unquantized", torch.device("xpu"))


def test_fused_experts_asks_the_backends_before_any_op(monkeypatch, no_ops):
    # No device here lacks float8 (mps is not available), so meta stands in for one: the check must
    # come from the backend table, before any op runs.
    monkeypatch.setitem(BACKENDS._REFERENCE_DEVICES, "meta", (torch.float8_e4m3fn,))
    kw = _map_tensors(_quantized(FP8_TOKEN), lambda t: t.to("meta"))
    with pytest.raises(ValueError, match=r"quant_config: scheme fp8_w8a8_per_token cannot run on meta: meta has no float8_e4m3fn"):
        _call(kw)
    assert no_ops == []
    with pytest.raises(_OpCalled):  # the unquantized layer on the same device is let through
        _call(_map_tensors(_inputs(), lambda t: t.to("meta")))


# (device, dtype, capability) -> the reason cute_support gives, None where it serves the call
CUTE_CASES = {
    "sm90_bf16": ("cuda", torch.bfloat16, (9, 0), None),
    "sm90_fp16": ("cuda", torch.float16, (9, 0), None),
    "sm90_fp32": ("cuda", torch.float32, (9, 0), r"activations in torch.float32; the kernels take \(torch.bfloat16, torch.float16\)"),
    "sm100": ("cuda", torch.bfloat16, (10, 0), r"the kernels use Hopper's wgmma and TMA \(sm_90\), device is \(10, 0\)"),
    "sm80": ("cuda", torch.bfloat16, (8, 0), r"device is \(8, 0\)"),
    "cpu": ("cpu", torch.bfloat16, (9, 0), r"the CuTe DSL kernels run on CUDA GPUs only"),
}


@pytest.mark.parametrize("case", list(CUTE_CASES))
def test_cute_support_reasons(case):
    device, dtype, capability, reason = CUTE_CASES[case]
    s = BACKENDS.cute_support("unquantized", device, dtype, capability=capability)
    assert s.supported == (reason is None), s
    if reason is not None:
        assert re.search(reason, s.reason), s.reason


def test_support_table_rows():
    """One row per scheme: the reference serves every scheme on CPU and CUDA; the CuTe DSL kernels
    (bf16, sm_90) every scheme: the fp8_w8a8 schemes on their fp8 codes (fp8_kernels.py), mxfp4_w4a16 on its
    mxfp4 codes (w4_kernels.py), the other quantized ones on weights decoded per call (dequant_kernels.py),
    which the cell says. The table's fp8 and mxfp4 schemes are the ones fp8_kernels and w4_kernels serve."""
    from moe_ops import fp8_kernels, w4_kernels

    rows = BACKENDS.support_table().splitlines()[2:]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == list(quant.SCHEMES)
    for row in rows:
        scheme, ref_cpu, ref_cuda, cute = (c.strip() for c in row.strip("| ").split(" | "))
        assert ref_cpu == ref_cuda == "yes", row
        fp8 = scheme in ("fp8_w8a8_per_tensor", "fp8_w8a8_per_token", "fp8_w8a8_block")
        w4 = scheme == "mxfp4_w4a16"
        want = "yes" if scheme == "unquantized" else "yes, fp8 codes" if fp8 else "yes, mxfp4 codes" if w4 else "yes, decoded per call"
        assert cute == want, row
        assert BACKENDS.cute_support(scheme, "cuda", torch.float32, capability=(9, 0)).supported is False
    # The groups each kind takes in the named schemes (1xG activations and GxG weights: DeepSeek's 128s).
    groups = {"per-tensor": (-1, -1), "per-row": (1, -1), "1xG": (1, 128), "GxG": (128, 128)}
    for name, (acts, weights) in quant.SCHEMES.items():
        keys = [(a, w) for a in acts for w in weights if a and w and a[1] in groups and w[1] in groups]
        served = [fp8_kernels.serves(a[0], groups[a[1]], w[0], groups[w[1]], torch.bfloat16) for a, w in keys]
        assert (name in BACKENDS.CUTE_FP8_SCHEMES) == (bool(served) and all(served)), name
        # mxfp4's 1xG groups are 1x32
        w4 = [w4_kernels.serves("none" if a is None else a[0], w[0], (1, 32), torch.bfloat16) for a in acts for w in weights if w and w[1] == "1xG"]
        assert (name in BACKENDS.CUTE_W4_SCHEMES) == (bool(w4) and all(w4)), name
        assert BACKENDS.cute_support(name, "cuda", torch.float32, capability=(9, 0)).supported is False


# ---- the quantization vocabulary -----------------------------------------------------------------


def _fp8_scales():
    return torch.ones(E, 2 * I, 1), torch.ones(E, H, 1)


BAD_VOCAB = [
    ("group_rows_0", lambda: GroupShape(0, 1), ValueError, r"GroupShape.rows: got 0; allowed: -1 \(whole dimension\) or an int >= 1"),
    ("group_cols_-2", lambda: GroupShape(1, -2), ValueError, r"GroupShape.cols: got -2; allowed"),
    ("group_cols_bool", lambda: GroupShape(1, True), ValueError, r"GroupShape.cols: got True"),
    ("group_rows_float", lambda: GroupShape(1.0, 16), ValueError, r"GroupShape.rows: got 1.0"),
    ("act_dtype", lambda: ActivationQuant("fp4", PER_TOKEN), ValueError,
     r"ActivationQuant.dtype: got 'fp4'; allowed: 'fp8', 'int8', 'nvfp4'"),
    ("act_group_type", lambda: ActivationQuant("fp8", (1, -1)), TypeError, r"ActivationQuant.group: expected a GroupShape, got tuple"),
    ("act_int8_groups", lambda: ActivationQuant("int8", GroupShape(1, 128)), ValueError,
     r"ActivationQuant.group: 1x128 is not a int8 group shape; allowed kinds: per-tensor, per-row"),
    # a 1x1 "group" (a scale per element) is no group along K: it is refused, not taken as 1xG
    ("act_fp8_1x1", lambda: ActivationQuant("fp8", GroupShape(1, 1)), ValueError,
     r"ActivationQuant.group: 1x1 is not a fp8 group shape; allowed kinds: per-tensor, per-row, 1xG"),
    ("weight_int4_1x1", lambda: WeightQuant("int4", GroupShape(1, 1)), ValueError, r"WeightQuant.group: 1x1 is not a int4 group shape"),
    ("act_nvfp4_group", lambda: ActivationQuant("nvfp4", GroupShape(1, 32)), ValueError,
     r"ActivationQuant.group: nvfp4 uses groups of 1x16, got 1x32"),
    ("act_static_per_token", lambda: ActivationQuant("fp8", PER_TOKEN, static=True), ValueError,
     r"ActivationQuant.static: only per-tensor scales can be static, got group per-row"),
    ("weight_dtype", lambda: WeightQuant("int3", PER_CHANNEL), ValueError,
     r"WeightQuant.dtype: got 'int3'; allowed: 'fp8', 'int8', 'int4', 'nvfp4', 'mxfp4'"),
    ("weight_fp8_1xG", lambda: WeightQuant("fp8", GroupShape(1, 128)), ValueError,
     r"WeightQuant.group: 1x128 is not a fp8 group shape; allowed kinds: per-tensor, per-row, GxG"),
    ("weight_int4_per_channel", lambda: WeightQuant("int4", PER_CHANNEL), ValueError, r"WeightQuant.group: per-row is not a int4"),
    ("weight_mxfp4_group", lambda: WeightQuant("mxfp4", GroupShape(1, 16)), ValueError, r"WeightQuant.group: mxfp4 uses groups of 1x32"),
    ("weight_zero_point_fp8", lambda: WeightQuant("fp8", PER_CHANNEL, zero_point=True), ValueError,
     r"WeightQuant.zero_point: only int4 has zero points, got dtype 'fp8'"),
    # group shapes of no kind of their format (rows x cols neither square nor 1 x G, or per-tensor int8)
    ("weight_fp8_64x128", lambda: WeightQuant("fp8", GroupShape(64, 128)), ValueError,
     r"WeightQuant.group: 64x128 is not a fp8 group shape; allowed kinds: per-tensor, per-row, GxG"),
    ("weight_int8_4_rows", lambda: WeightQuant("int8", GroupShape(4, -1)), ValueError,
     r"WeightQuant.group: 4x-1 is not a int8 group shape; allowed kinds: per-row, 1xG"),
    ("weight_int8_per_tensor", lambda: WeightQuant("int8", PER_TENSOR), ValueError,
     r"WeightQuant.group: per-tensor is not a int8 group shape; allowed kinds: per-row, 1xG"),
    ("scheme_nvfp4_act_fp8_weight", lambda: QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("fp8", PER_CHANNEL)),
     ValueError, r"QuantScheme: activations nvfp4 1xG with weights fp8 per-row is not supported; allowed: .*"
                 r"fp8_w8a8_per_token: activations fp8 per-row, weights fp8 per-row.*nvfp4_w4a4: activations nvfp4 1xG, weights nvfp4 1xG"),
    ("scheme_act_without_weight", lambda: QuantScheme(ActivationQuant("fp8", PER_TOKEN), None), ValueError,
     r"QuantScheme: activations fp8 per-row with weights none is not supported; allowed: unquantized"),
    ("scheme_int8_act_fp8_weight", lambda: QuantScheme(ActivationQuant("int8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL)),
     ValueError, r"QuantScheme: activations int8 per-row with weights fp8 per-row is not supported"),
    ("scheme_block_mismatch", lambda: QuantScheme(ActivationQuant("fp8", GroupShape(1, 64)), WeightQuant("fp8", GroupShape(128, 128))),
     ValueError, r"QuantScheme: block scaling needs activation groups 1x128 for weight blocks 128x128, got 1x64"),
    ("scheme_activation_str", lambda: QuantScheme("fp8", WeightQuant("fp8", PER_CHANNEL)), TypeError,
     r"QuantScheme.activation: expected ActivationQuant or None, got str"),
    ("scheme_weight_wrong_type", lambda: QuantScheme(None, ActivationQuant("fp8", PER_TOKEN)), TypeError,
     r"QuantScheme.weight: expected WeightQuant or None, got ActivationQuant"),
    ("config_scheme_str", lambda: QuantConfig("fp8_w8a8_per_token"), TypeError, r"QuantConfig.scheme: expected a QuantScheme, got str"),
    ("config_missing_scale", lambda: QuantConfig(FP8_TOKEN, w13_scale=torch.ones(E, 2 * I, 1)), ValueError,
     r"QuantConfig.w2_scale: required by scheme fp8_w8a8_per_token .*, got None"),
    ("config_missing_global", lambda: QuantConfig(QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16))),
                                                  w13_scale=torch.ones(1), w2_scale=torch.ones(1)),
     ValueError, r"QuantConfig.w13_global_scale: required by scheme nvfp4_w4a16"),
    # the scheme's description names what the name does not: static scales, zero points
    ("config_missing_static", lambda: QuantConfig(FP8_STATIC, *(torch.ones(E, 1, 1),) * 2), ValueError,
     r"QuantConfig.a13_scale: required by scheme fp8_w8a8_per_tensor \(activations fp8 per-tensor static; weights fp8 per-tensor\)"),
    ("config_missing_zero", lambda: QuantConfig(INT4_G32_ZP, *_fp8_scales()), ValueError,
     r"QuantConfig.w13_zero: required by scheme int4_w4a16 \(activations bf16/fp16/fp32; weights int4 1x32 zero-point\), got None"),
    ("config_extra_scale", lambda: QuantConfig(FP8_TOKEN, *_fp8_scales(), a13_scale=torch.ones(1)), ValueError,
     r"QuantConfig.a13_scale: given, but scheme fp8_w8a8_per_token .* does not use it; it uses: w13_scale, w2_scale"),
    ("config_unquantized_scale", lambda: QuantConfig(quant.UNQUANTIZED, w13_scale=torch.ones(1)), ValueError,
     r"QuantConfig.w13_scale: given, but scheme unquantized .* does not use it; it uses: no scale tensors"),
    ("config_zero_symmetric", lambda: QuantConfig(INT4_G32, *_fp8_scales(), w13_zero=torch.zeros(1, dtype=torch.uint8),
                                                  w2_zero=torch.zeros(1, dtype=torch.uint8)),
     ValueError, r"QuantConfig.w13_zero: given, but scheme int4_w4a16"),
    ("config_scale_not_tensor", lambda: QuantConfig(FP8_TOKEN, [1.0], torch.ones(1)), TypeError,
     r"QuantConfig.w13_scale: expected a torch.Tensor, got list"),
    ("factory_fp8_one_static", lambda: quant.fp8_w8a8_per_tensor(torch.ones(E, 1, 1), torch.ones(E, 1, 1), a13_scale=torch.ones(1)),
     ValueError, r"a13_scale and a2_scale: give both \(static activation scales\) or neither \(dynamic\)"),
    ("factory_int8_one_static", lambda: quant.int8_w8a8(*_fp8_scales(), a2_scale=torch.ones(1)), ValueError,
     r"a13_scale and a2_scale: give both"),
    ("factory_mxfp4_one_static", lambda: quant.mxfp4_w4a8(*_fp8_scales(), a13_scale=torch.ones(1)), ValueError,
     r"a13_scale and a2_scale: give both"),
    ("factory_mxfp4_static_per_token", lambda: quant.mxfp4_w4a8(*_fp8_scales(), torch.ones(1), torch.ones(1), per_token=True),
     ValueError, r"per_token: static scales are per-tensor"),
    ("factory_mxfp4_per_token_str", lambda: quant.mxfp4_w4a8(*_fp8_scales(), per_token="no"), TypeError,
     r"per_token: expected a bool, got str 'no'"),
    # Static activation scales of 0 or NaN quantized to inf codes and the layer gave NaN, silently.
    ("factory_fp8_zero_static", lambda: quant.fp8_w8a8_per_tensor(*_fp8_scales(), torch.zeros(1), torch.ones(1)), ValueError,
     r"a13_scale: holds 0.0; allowed: finite values > 0"),
    ("factory_int8_nan_static", lambda: quant.int8_w8a8(*_fp8_scales(), torch.ones(1), torch.tensor([float("nan")])), ValueError,
     r"a2_scale: holds nan; allowed: finite values > 0"),
    ("factory_mxfp4_negative_static", lambda: quant.mxfp4_w4a8(*_fp8_scales(), torch.tensor([-2.0]), torch.ones(1)), ValueError,
     r"a13_scale: holds -2.0; allowed: finite values > 0"),
    ("factory_nvfp4_inf_global", lambda: quant.nvfp4_w4a4(*_fp8_scales(), torch.ones(E), torch.ones(E), torch.ones(1), torch.tensor([float("inf")])),
     ValueError, r"a2_global_scale: holds inf; allowed: finite values > 0"),
    ("factory_int4_one_zero", lambda: quant.int4_w4a16(*_fp8_scales(), w13_zero=torch.zeros(1, dtype=torch.uint8)),
     ValueError, r"w13_zero and w2_zero: give both \(asymmetric int4\) or neither \(symmetric\)"),
    ("factory_int4_bad_group", lambda: quant.int4_w4a16(*_fp8_scales(), group_size=0), ValueError, r"GroupShape.cols: got 0"),
    ("factory_fp8_block_bad_size", lambda: quant.fp8_w8a8_block(*_fp8_scales(), block_size=-3), ValueError, r"GroupShape.cols: got -3"),
    ("factory_fp8_w8a16_group", lambda: quant.fp8_w8a16(*_fp8_scales(), group=GroupShape(1, 64)), ValueError,
     r"WeightQuant.group: 1x64 is not a fp8 group shape"),
    ("factory_nvfp4_missing_global", lambda: quant.nvfp4_w4a16(*_fp8_scales(), None, torch.ones(E)), ValueError,
     r"QuantConfig.w13_global_scale: required"),
    ("factory_nvfp4_w4a4_missing_act_global", lambda: quant.nvfp4_w4a4(*_fp8_scales(), torch.ones(E), torch.ones(E), torch.ones(1), None),
     ValueError, r"QuantConfig.a2_global_scale: required by scheme nvfp4_w4a4"),
    ("quantize_weights_scheme_type", lambda: quant.quantize_weights("fp8", torch.ones(E, 2 * I, H), torch.ones(E, H, I)),
     TypeError, r"scheme: expected a QuantScheme, got str"),
    ("quantize_weights_no_calibration", lambda: quant.quantize_weights(FP8_STATIC, torch.ones(E, 2 * I, H), torch.ones(E, H, I)),
     ValueError, r"calibration: scheme fp8_w8a8_per_tensor .* has static activation scales; it needs sample hidden states \[T, H\]"),
    ("quantize_weights_no_intermediate_calibration",
     lambda: quant.quantize_weights(FP8_STATIC, torch.ones(E, 2 * I, H), torch.ones(E, H, I), calibration=torch.randn(2, H)),
     ValueError, r"intermediate_calibration: scheme fp8_w8a8_per_tensor .* needs GEMM2's sample inputs \[T, I\]"),
    # An inf weight used to quantize to a NaN scale, an int bias or one on another device to pass.
    ("quantize_weights_inf_weight",
     lambda: quant.quantize_weights(FP8_W8A16, torch.ones(E, 2 * I, H), torch.full((E, H, I), float("inf"))),
     ValueError, r"w2: holds NaN or inf"),
    ("quantize_weights_int_bias",
     lambda: quant.quantize_weights(FP8_W8A16, torch.ones(E, 2 * I, H), torch.ones(E, H, I), w2_bias=torch.ones(E, H, dtype=torch.int32)),
     TypeError, r"w2_bias: dtype torch.int32 is not allowed"),
    ("quantize_weights_bias_on_meta",
     lambda: quant.quantize_weights(FP8_W8A16, torch.ones(E, 2 * I, H), torch.ones(E, H, I), w13_bias=torch.ones(E, 2 * I, device="meta")),
     ValueError, r"w13_bias: on meta, but w13 is on cpu"),
]


@pytest.mark.parametrize("build, exc, match", [c[1:] for c in BAD_VOCAB], ids=[c[0] for c in BAD_VOCAB])
def test_quant_vocabulary_rejects(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


@pytest.mark.parametrize("name", sorted(quant.FACTORIES))
def test_every_factory_builds_its_scheme(name):
    # Positive control for the factory errors: each factory, with the scales quantize_weights makes,
    # gives a config whose scheme has the factory's name.
    schemes = {
        "unquantized": quant.UNQUANTIZED,
        "fp8_w8a8_per_tensor": QuantScheme(ActivationQuant("fp8", PER_TENSOR), WeightQuant("fp8", PER_TENSOR)),
        "fp8_w8a8_per_token": FP8_TOKEN,
        "fp8_w8a8_block": QuantScheme(ActivationQuant("fp8", GroupShape(1, 128)), WeightQuant("fp8", GroupShape(128, 128))),
        "int8_w8a8": QuantScheme(ActivationQuant("int8", PER_TOKEN), WeightQuant("int8", PER_CHANNEL)),
        "fp8_w8a16": QuantScheme(None, WeightQuant("fp8", PER_CHANNEL)),
        "int8_w8a16": QuantScheme(None, WeightQuant("int8", PER_CHANNEL)),
        "int4_w4a16": QuantScheme(None, WeightQuant("int4", GroupShape(1, 128))),
        "nvfp4_w4a16": QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16))),
        "nvfp4_w4a4": NVFP4_W4A4,
        "mxfp4_w4a16": QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32))),
        "mxfp4_w4a8": QuantScheme(ActivationQuant("fp8", PER_TENSOR), WeightQuant("mxfp4", GroupShape(1, 32))),
    }
    scheme = schemes[name]
    assert scheme.name == name
    _, _, cfg = quant.quantize_weights(scheme, torch.randn(E, 2 * 128, 128), torch.randn(E, 128, 128), calibration=torch.randn(4, 128),
                                       intermediate_calibration=torch.randn(4, 128))  # fmt: skip
    args = {
        "unquantized": lambda c: (),
        "fp8_w8a8_per_tensor": lambda c: (c.w13_scale, c.w2_scale),
        "fp8_w8a8_per_token": lambda c: (c.w13_scale, c.w2_scale),
        "fp8_w8a8_block": lambda c: (c.w13_scale, c.w2_scale),
        "int8_w8a8": lambda c: (c.w13_scale, c.w2_scale),
        "fp8_w8a16": lambda c: (c.w13_scale, c.w2_scale),
        "int8_w8a16": lambda c: (c.w13_scale, c.w2_scale),
        "int4_w4a16": lambda c: (c.w13_scale, c.w2_scale),
        "nvfp4_w4a16": lambda c: (c.w13_scale, c.w2_scale, c.w13_global_scale, c.w2_global_scale),
        "nvfp4_w4a4": lambda c: (c.w13_scale, c.w2_scale, c.w13_global_scale, c.w2_global_scale, c.a13_global_scale, c.a2_global_scale),
        "mxfp4_w4a16": lambda c: (c.w13_scale, c.w2_scale),
        "mxfp4_w4a8": lambda c: (c.w13_scale, c.w2_scale),
    }[name](cfg)
    assert quant.FACTORIES[name](*args).scheme == scheme


def test_int8_w8a16_group_size_gives_grouped_scales():
    # The factory's group_size is honoured: scales of 32-wide groups along K give a 1x32 scheme, not per-channel.
    scheme = QuantScheme(None, WeightQuant("int8", GroupShape(1, 32)))
    _, _, cfg = quant.quantize_weights(scheme, torch.randn(E, 2 * 128, 128), torch.randn(E, 128, 128))
    assert cfg.w13_scale.shape == (E, 2 * 128, 4) and cfg.w2_scale.shape == (E, 128, 4)
    assert quant.int8_w8a16(cfg.w13_scale, cfg.w2_scale, group_size=32).scheme == scheme
    assert quant.int8_w8a16(*_fp8_scales()).scheme.weight.group == PER_CHANNEL


# ---- route ---------------------------------------------------------------------------------------

BAD_ROUTE = [
    ("logits_int", lambda: moe_ops.route(torch.zeros(3, 8, dtype=torch.int64), 2), TypeError,
     r"router_logits: dtype torch.int64 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16"),
    ("logits_1d", lambda: moe_ops.route(torch.zeros(8), 2), ValueError, r"router_logits: expected 2-D \[M, E\]"),
    ("logits_not_tensor", lambda: moe_ops.route([[0.0] * 8], 2), TypeError, r"router_logits: expected a torch.Tensor, got list"),
    ("scoring", lambda: moe_ops.route(torch.zeros(3, 8), 2, scoring="tanh"), ValueError,
     r"scoring: got 'tanh'; allowed: 'softmax', 'sigmoid'"),
    ("top_k_gt_E", lambda: moe_ops.route(torch.zeros(3, 8), 9), ValueError, r"top_k: got 9; allowed: an int in \[1, E=8\]"),
    ("top_k_0", lambda: moe_ops.route(torch.zeros(3, 8), 0), ValueError, r"top_k: got 0; allowed: an int in \[1, E=8\]"),
    ("top_k_float", lambda: moe_ops.route(torch.zeros(3, 8), 2.0), TypeError, r"top_k: got float 2.0; allowed: an int"),
    ("top_k_bool", lambda: moe_ops.route(torch.zeros(3, 8), True), TypeError, r"top_k: got bool True"),
    ("group_not_dividing", lambda: moe_ops.route(torch.zeros(3, 8), 2, num_expert_group=3, topk_group=1), ValueError,
     r"num_expert_group: got 3; allowed: a divisor of E=8"),
    ("group_zero", lambda: moe_ops.route(torch.zeros(3, 8), 2, num_expert_group=0, topk_group=1), ValueError,
     r"num_expert_group: got 0; allowed: a divisor of E=8"),
    ("topk_group_without_groups", lambda: moe_ops.route(torch.zeros(3, 8), 2, topk_group=2), ValueError,
     r"num_expert_group and topk_group: got None and 2; allowed: both None or both set"),
    ("groups_without_topk_group", lambda: moe_ops.route(torch.zeros(3, 8), 2, num_expert_group=4), ValueError,
     r"num_expert_group and topk_group: got 4 and None"),
    ("topk_group_gt_groups", lambda: moe_ops.route(torch.zeros(3, 8), 2, num_expert_group=4, topk_group=5), ValueError,
     r"topk_group: got 5; allowed: 1 to num_expert_group=4"),
    ("topk_group_0", lambda: moe_ops.route(torch.zeros(3, 8), 2, num_expert_group=4, topk_group=0), ValueError,
     r"topk_group: got 0; allowed: 1 to num_expert_group=4"),
    ("top_k_gt_kept_experts", lambda: moe_ops.route(torch.zeros(3, 8), 3, num_expert_group=4, topk_group=1), ValueError,
     r"top_k: got 3; the 1 kept groups hold only 2 experts"),
    ("bias_shape", lambda: moe_ops.route(torch.zeros(3, 8), 2, scoring="sigmoid", e_score_correction_bias=torch.zeros(7)),
     ValueError, r"e_score_correction_bias: expected shape \(8,\) \(\[E\]\), got \(7,\)"),
    ("bias_dtype", lambda: moe_ops.route(torch.zeros(3, 8), 2, e_score_correction_bias=torch.zeros(8, dtype=torch.int32)),
     TypeError, r"e_score_correction_bias: dtype torch.int32 is not allowed"),
    ("bias_device", lambda: moe_ops.route(torch.zeros(3, 8), 2, e_score_correction_bias=torch.zeros(8, device="meta")),
     ValueError, r"e_score_correction_bias: on meta, but router_logits is on cpu"),
    ("scaling_factor_str", lambda: moe_ops.route(torch.zeros(3, 8), 2, routed_scaling_factor="x"), TypeError,
     r"routed_scaling_factor: expected a real number, got str 'x'"),
    ("scaling_factor_none", lambda: moe_ops.route(torch.zeros(3, 8), 2, routed_scaling_factor=None), TypeError,
     r"routed_scaling_factor: expected a real number, got NoneType None"),
]


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in BAD_ROUTE], ids=[c[0] for c in BAD_ROUTE])
def test_route_rejects(no_ops, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
    assert no_ops == []


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(num_expert_group=4, topk_group=1.5), "topk_group"), (dict(num_expert_group=2.0, topk_group=1), "num_expert_group")],
    ids=["topk_group_float", "num_expert_group_float"],
)
def test_route_rejects_non_int_groups(no_ops, kwargs, name):
    with pytest.raises(TypeError, match=rf"{name}: got float .*; allowed: an int or None"):
        moe_ops.route(torch.zeros(3, 8), 2, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(renormalize=False),
        dict(scoring="sigmoid"),
        dict(scoring="sigmoid", num_expert_group=4, topk_group=2, e_score_correction_bias=torch.linspace(-0.1, 0.1, 8)),
        dict(num_expert_group=4, topk_group=2),
    ],
    ids=["softmax", "softmax_norenorm", "sigmoid", "deepseek_v3", "grouped_softmax"],
)
def test_nan_logits_do_not_crash_routing(kwargs):
    logits = torch.randn(5, 8, generator=generator(3))
    clean_w, clean_ids = moe_ops.route(logits, 2, **kwargs)
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    weights, ids = moe_ops.route(logits, 2, **kwargs)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ((ids >= 0) & (ids < 8)).all()
    for row in range(5):  # each row's ids are distinct experts
        assert len(set(ids[row].tolist())) == 2
    assert torch.isnan(weights[2]).all()  # the routing of an all-NaN row is undefined, and says so
    keep = [0, 3, 4]  # rows without NaN route exactly as before
    assert torch.equal(ids[keep], clean_ids[keep]) and torch.equal(weights[keep], clean_w[keep])
    assert 3 not in ids[1].tolist()  # NaN ranks below every number
    # and the ids feed fused_experts without an error (NaN rows give NaN output rows only)
    kw = _inputs(e=8, m=5)
    out = moe_ops.fused_experts(kw["hidden_states"], kw["w13"], kw["w2"], weights, ids)
    assert torch.isfinite(out[keep]).all()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: moe_ops.Activation("relu2", interleaved=True), r"activation: 'relu2' has no gate, so interleaved=True means nothing"),
        (lambda: moe_ops.Activation("swigluoai", limit=0.0), r"activation.limit: got 0.0; allowed: > 0"),
        # a softcap divides by its cap: 0 would make NaNs, a negative one flip the sign
        (lambda: moe_ops.Activation("swiglu_softcapped", alpha=0.0), r"activation.alpha: got 0.0; allowed: > 0"),
        (lambda: moe_ops.Activation("swiglu_softcapped", alpha=-4.0), r"activation.alpha: got -4.0; allowed: > 0"),
        (lambda: moe_ops.Activation("SiLU"), r"activation: got 'SiLU'; allowed: 'silu', 'gelu', 'gelu_tanh', 'swigluoai', 'silu_clamped', 'swiglu_softcapped', 'relu2'"),
    ],
    ids=["relu2_interleaved", "limit_0", "softcap_0", "softcap_negative", "unknown_kind"],
)
def test_activation_rejects(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# Before, these were accepted and failed later (a str interleaved reached the op's schema after GEMM1
# had run; alpha=None failed in float() without a name) or raised unnamed errors (a list kind: unhashable).
@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: moe_ops.Activation(["silu"]), TypeError, r"activation.kind: expected a str, got list \['silu'\]"),
        (lambda: moe_ops.Activation("silu", interleaved="no"), TypeError, r"activation.interleaved: expected a bool, got str 'no'"),
        (lambda: moe_ops.Activation("swigluoai", alpha="1.7"), TypeError, r"activation.alpha: expected a real number, got str '1.7'"),
        (lambda: moe_ops.Activation("swigluoai", limit="7"), TypeError, r"activation.limit: expected a real number, got str '7'"),
        (lambda: moe_ops.Activation("swigluoai", alpha=float("nan")), ValueError, r"activation.alpha: got nan"),
        (lambda: moe_ops.Activation("swigluoai", alpha=True), TypeError, r"activation.alpha: expected a real number, got bool True"),
    ],
    ids=["kind_list", "interleaved_str", "alpha_str", "limit_str", "alpha_nan", "alpha_bool"],
)
def test_activation_rejects_field_types(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


# ---- expert_intermediates --------------------------------------------------------------------------

# Its other argument errors are in test_calibration.py; these were accepted: an int bias was cast to
# float, and tensors on two devices reached the ops.
BAD_INTERMEDIATES = [
    ("bias_int", _with(w13_bias=torch.zeros(E, 2 * I, dtype=torch.int32)), TypeError,
     r"w13_bias: dtype torch.int32 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16, torch.float64"),
    ("w13_on_meta", _edit("w13", lambda w: w.to("meta")), ValueError, r"w13: on meta, but hidden_states is on cpu"),
    ("bias_on_meta", _with(w13_bias=torch.zeros(E, 2 * I, device="meta")), ValueError, r"w13_bias: on meta, but hidden_states is on cpu"),
]


def _intermediates_call(kw: dict):
    kw = {n: v for n, v in kw.items() if n not in ("w2", "topk_weights")}
    return moe_ops.expert_intermediates(kw.pop("hidden_states"), kw.pop("w13"), kw.pop("topk_ids"), **kw)


@pytest.mark.parametrize("mutate, exc, match", [c[1:] for c in BAD_INTERMEDIATES], ids=[c[0] for c in BAD_INTERMEDIATES])
def test_expert_intermediates_rejects(no_ops, mutate, exc, match):
    with pytest.raises(_OpCalled):  # the unmodified inputs are valid
        _intermediates_call(_inputs())
    no_ops.clear()
    with pytest.raises(exc, match=match):
        _intermediates_call(mutate(_inputs()))
    assert no_ops == []


# ---- the registered ops, called directly ----------------------------------------------------------

_IDS = torch.zeros(3, 2, dtype=torch.int32)
BAD_OPS = [
    ("activation_unknown_kind", lambda: (torch.ops.moe_ops.activation, (torch.randn(3, 8), "swish", 1.702, 7.0, False)),
     ValueError, r"kind: got 'swish'; allowed: 'silu', 'gelu', 'gelu_tanh', 'swigluoai', 'silu_clamped', 'swiglu_softcapped', 'relu2'"),
    ("activation_odd_interleaved", lambda: (torch.ops.moe_ops.activation, (torch.randn(3, 7), "swigluoai", 1.702, 7.0, True)),
     ValueError, r"x: 'swigluoai' splits each row into gate and up halves; the width must be even, got shape \(3, 7\)"),
    ("activation_softcap_0", lambda: (torch.ops.moe_ops.activation, (torch.randn(3, 8), "swiglu_softcapped", 4.0, 0.0, False)),
     ValueError, r"activation.limit: got 0.0; allowed: > 0"),
    ("activation_odd", lambda: (torch.ops.moe_ops.activation, (torch.randn(3, 7), "silu", 1.702, 7.0, False)),
     ValueError, r"x: 'silu' splits each row into gate and up halves; the width must be even"),
    ("activation_relu2_interleaved", lambda: (torch.ops.moe_ops.activation, (torch.randn(3, 8), "relu2", 1.702, 7.0, True)),
     ValueError, r"interleaved: 'relu2' has no gate, so interleaved=True means nothing; allowed: False"),
    ("activation_1d", lambda: (torch.ops.moe_ops.activation, (torch.randn(8), "silu", 1.702, 7.0, False)),
     ValueError, r"x: expected 2-D \[R, 2I\] \(gated\) or \[R, I\], got shape \(8,\)"),
    ("activation_int", lambda: (torch.ops.moe_ops.activation, (torch.ones(3, 8, dtype=torch.int32), "silu", 1.702, 7.0, False)),
     TypeError, r"x: dtype torch.int32 is not allowed; allowed: torch.float32, torch.float16, torch.bfloat16"),
    ("plan_float_ids", lambda: (torch.ops.moe_ops.routing_plan, (_IDS.float(), 4, None)),
     TypeError, r"topk_ids: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    ("plan_1d_ids", lambda: (torch.ops.moe_ops.routing_plan, (_IDS[:, 0], 4, None)),
     ValueError, r"topk_ids: expected 2-D \[M, k\], got shape \(3,\)"),
    ("plan_negative_experts", lambda: (torch.ops.moe_ops.routing_plan, (_IDS, -1, None)),
     ValueError, r"num_experts: got -1; allowed: an int >= 0"),
    ("plan_float_map", lambda: (torch.ops.moe_ops.routing_plan, (_IDS, 4, torch.arange(4.0))),
     TypeError, r"expert_map: dtype torch.float32 is not allowed; allowed: torch.int32, torch.int64"),
    ("plan_2d_map", lambda: (torch.ops.moe_ops.routing_plan, (_IDS, 4, torch.arange(4).view(2, 2))),
     ValueError, r"expert_map: expected 1-D \[E_global\], got shape \(2, 2\)"),
    ("plan_map_on_meta", lambda: (torch.ops.moe_ops.routing_plan, (_IDS, 4, torch.arange(4, device="meta"))),
     ValueError, r"expert_map: on meta, but topk_ids is on cpu; all tensors must share one device"),
]


@pytest.mark.parametrize("build, exc, match", [c[1:] for c in BAD_OPS], ids=[c[0] for c in BAD_OPS])
@pytest.mark.parametrize("where", ["real", "fake"])
def test_ops_reject(build, exc, match, where):
    """The ops check their arguments' shapes and dtypes (never their values) in the real impl and in the
    fake one, so a compiled call fails with the same message while tracing."""
    op, args = build()
    if where == "real":
        with pytest.raises(exc, match=match):
            op(*args)
        return
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(exc, match=match):
            op(*fake)


def test_ops_accept_what_they_check():
    # Positive control for test_ops_reject: the same calls with valid arguments run.
    assert torch.ops.moe_ops.activation(torch.randn(3, 8), "swigluoai", 1.702, 7.0, True).shape == (3, 4)
    assert torch.ops.moe_ops.activation(torch.randn(3, 7), "relu2", 1.702, 7.0, False).shape == (3, 7)
    offsets, gather, inverse = torch.ops.moe_ops.routing_plan(_IDS.long(), 4, torch.arange(4, dtype=torch.int32))
    assert offsets.shape == (5,) and gather.shape == inverse.shape == (6,)


# ---- FusedMoE ------------------------------------------------------------------------------------

BAD_LAYER = [
    ("num_experts_0", dict(num_experts=0), ValueError, r"num_experts: got 0; allowed: an int >= 1"),
    ("hidden_float", dict(hidden_size=32.0), ValueError, r"hidden_size: got 32.0; allowed: an int >= 1"),
    ("intermediate_bool", dict(intermediate_size=True), ValueError, r"intermediate_size: got True"),
    ("top_k_gt_E", dict(top_k=5), ValueError, r"top_k: got 5; allowed: at most num_experts=4"),
    ("top_k_0", dict(top_k=0), ValueError, r"top_k: got 0; allowed: an int >= 1"),
    ("quant_config_is_config", dict(quant_config=QuantConfig()), TypeError,
     r"quant_config: expected a moe_ops.QuantScheme or None, got QuantConfig"),
    ("activation", dict(activation="tanh"), ValueError, r"activation: got 'tanh'; allowed: 'silu'"),
    ("scoring", dict(scoring="softplus"), ValueError, r"scoring: got 'softplus'; allowed: 'softmax', 'sigmoid'"),
    ("group_not_dividing", dict(num_expert_group=3, topk_group=1), ValueError, r"num_expert_group: got 3; allowed: a divisor of E=4"),
    ("topk_group_alone", dict(topk_group=1), ValueError, r"num_expert_group and topk_group"),
    ("kept_groups_too_small", dict(num_expert_group=4, topk_group=1), ValueError, r"top_k: got 2; the 1 kept groups hold only 1 experts"),
    ("scaling_factor_str", dict(routed_scaling_factor="2.5"), TypeError, r"routed_scaling_factor: expected a real number, got str"),
    # a truthy string or tensor used to switch the buffer on (or fail deep inside torch)
    ("correction_bias_str", dict(correction_bias="yes"), TypeError, r"correction_bias: expected a bool, got str 'yes'"),
    ("expert_bias_tensor", dict(expert_bias=torch.zeros(4, 8)), TypeError, r"expert_bias: expected a bool, got Tensor"),
    ("expert_bias_int", dict(expert_bias=1), TypeError, r"expert_bias: expected a bool, got int 1"),
    ("device_gpu", dict(device="gpu"), ValueError, r"device: got 'gpu'; allowed: a torch.device or a string such as 'cpu'"),
]


@pytest.mark.parametrize("changes, exc, match", [c[1:] for c in BAD_LAYER], ids=[c[0] for c in BAD_LAYER])
def test_fused_moe_constructor_rejects(changes, exc, match):
    args = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, dtype=torch.float32)
    moe_ops.FusedMoE(**args)  # the base arguments are valid
    with pytest.raises(exc, match=match):
        moe_ops.FusedMoE(**{**args, **changes})


def test_fused_moe_forward_wrong_hidden_size_names_argument():
    layer = moe_ops.FusedMoE(E, 2, H, I, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"hidden_states"):
        with torch.no_grad():
            layer(torch.randn(3, H + 1))


def test_fused_moe_forward_int_hidden_states_names_argument():
    layer = moe_ops.FusedMoE(E, 2, H, I, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"hidden_states"):
        with torch.no_grad():
            layer(torch.randint(0, 3, (3, H)))


# ---- compiled calls: no value checks, out-of-range ids contribute nothing ------------------------


def _fused(x, w13, w2, tw, ids, expert_map=None):
    return moe_ops.fused_experts(x, w13, w2, tw, ids, expert_map=expert_map)


@pytest.fixture(scope="module")
def compiled_fused():
    torch._dynamo.reset()
    return torch.compile(_fused, fullgraph=True, dynamic=False, backend="aot_eager")


def test_compiled_out_of_range_ids_contribute_nothing(compiled_fused):
    kw = _inputs()
    x, w13, w2, tw, ids = (kw[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids"))
    bad = ids.clone()
    bad[1, 0] = E  # one past the last expert
    bad[3, 1] = -1
    bad[4, 0] = 1000
    with pytest.raises(ValueError, match=r"topk_ids: value"):  # eager rejects them ...
        _fused(x, w13, w2, tw, bad)
    out = compiled_fused(x, w13, w2, tw, bad)  # ... compiled drops them
    # The same pairs with weight 0 (their ids replaced by valid ones) give the same result.
    zeroed_w, valid_ids = tw.clone(), bad.clone()
    for r, c in ((1, 0), (3, 1), (4, 0)):
        zeroed_w[r, c] = 0.0
        valid_ids[r, c] = (bad[r, 1 - c] + 1) % E
    expected = _fused(x, w13, w2, zeroed_w, valid_ids)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= F32_TOL
    assert relative_error(out, moe_float64(x, w13, w2, zeroed_w, valid_ids)) <= F32_TOL
    # the dropped pairs really dropped something: keeping them with their real weight differs
    assert relative_error(out, _fused(x, w13, w2, tw, valid_ids)) > 1e-2
    # and equals an expert_map that sends every out-of-range id to a slot mapped to -1
    ep_ids = torch.where((bad < 0) | (bad >= E), E, bad)
    expert_map = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32)
    assert relative_error(out, _fused(x, w13, w2, tw, ep_ids, expert_map)) <= F32_TOL


def test_compiled_out_of_range_expert_map_values_contribute_nothing(compiled_fused):
    kw = _inputs()
    x, w13, w2, tw, ids = (kw[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids"))
    # Token 0 goes to expert 2 for sure, with a weight that matters (random routing missed it 1.6% of runs).
    ids, tw = ids.clone(), tw.clone()
    ids[0] = torch.tensor([2, 3], dtype=ids.dtype)
    tw[0, 0] = 0.7
    bad_map = torch.tensor([0, 1, 7, 3], dtype=torch.int32)  # 7 is no local expert
    with pytest.raises(ValueError, match=r"expert_map: value 7 is outside \[-1, 4\)"):
        _fused(x, w13, w2, tw, ids, bad_map)
    out = compiled_fused(x, w13, w2, tw, ids, bad_map)
    good_map = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    expected = _fused(x, w13, w2, tw, ids, good_map)
    assert relative_error(out, expected) <= F32_TOL
    assert relative_error(out, moe_float64(x, w13, w2, tw, ids, expert_map=good_map)) <= F32_TOL
    assert (ids == 2).any()  # expert 2 was routed to, so dropping it matters
    assert relative_error(out, _fused(x, w13, w2, tw, ids)) > 1e-2


# ---- eager calls inside moe_ops.value_checks(False): as compiled, and without reading values -------


def test_value_checks_off_drops_bad_ids_and_map_entries_as_compiled(compiled_fused, monkeypatch):
    kw = _inputs()
    x, w13, w2, tw, ids = (kw[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids"))
    bad = ids.clone()
    bad[1, 0], bad[3, 1] = E, -1
    bad_map = torch.tensor([0, 1, 7, 3, 2], dtype=torch.int32)  # 7 is no local expert; id 4 maps to 2

    def no_value_reads(self, *args):
        raise AssertionError("a tensor value was read on the host")

    for args in ((x, w13, w2, tw, bad), (x, w13, w2, tw, ids, bad_map)):
        with pytest.raises(ValueError, match=r"value"):
            _fused(*args)  # checked by default ...
        expected = compiled_fused(*args)
        with monkeypatch.context() as m, moe_ops.value_checks(False):
            for name in ("__bool__", "item", "tolist"):
                m.setattr(torch.Tensor, name, no_value_reads)
            out = _fused(*args)  # ... not inside the block, which reads no tensor value at all
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"topk_ids: value 4 is outside"):
        _fused(x, w13, w2, tw, bad)  # the block's end turned the checks back on


def test_value_checks_block_restores_on_error_and_nests():
    from moe_ops._checks import value_checks_enabled

    assert value_checks_enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with moe_ops.value_checks(False):
            assert not value_checks_enabled()
            with moe_ops.value_checks(True):
                assert value_checks_enabled()
            assert not value_checks_enabled()
            raise RuntimeError("inside")
    assert value_checks_enabled()
    # A block in one thread leaves the others checked.
    import threading

    seen = []
    with moe_ops.value_checks(False):
        other = threading.Thread(target=lambda: seen.append(value_checks_enabled()))
        other.start()
        other.join()
        seen.append(value_checks_enabled())
    assert seen == [True, False]
    with pytest.raises(TypeError, match=r"enabled: expected a bool, got int"):
        with moe_ops.value_checks(0):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_value_checks_off_eager_cuda_call_makes_no_host_sync():
    kw = {n: t.cuda() for n, t in _inputs(torch.bfloat16, m=37).items()}
    _call(kw)  # warm-up: the routing plan's first call compiles it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
            _call(kw)  # the positive control: checked, the expert ids are read on the host
        with moe_ops.value_checks(False):
            out = _call(kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = moe_float64(*(kw[n] for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")), intermediate_dtype=torch.bfloat16)
    assert relative_error(out, ref) <= tolerance(torch.bfloat16)
