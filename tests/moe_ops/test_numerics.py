"""Numerics of moe_ops on fresh random inputs against independent float64 re-computations:
routing (a per-row Python loop here), fused_experts for every activation and every quantization
scheme (against moe_ops.reference.moe_float64 fed with weights decoded here, independently of
moe_ops.quant.formats), edge cases of the layer, routing_plan's invariants and weighted_reduce.
Tolerances come from moe_ops.reference only."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import moe_ops
from moe_ops import Activation, fused_experts, route
from moe_ops.plan import routing_plan
from moe_ops.quant import (
    FACTORIES,
    SCHEMES,
    ActivationQuant,
    GroupShape,
    QuantScheme,
    WeightQuant,
    quantize_weights,
)
from moe_ops.reduce import weighted_reduce
from moe_ops.reference import DTYPE_TOLERANCE, TIE_MARGIN, Float64Reference, apply_activation, fake_quantize, float64_reference, moe_float64, relative_error, tolerance

from ..decoders import decode_e2m1_packed, decode_e4m3, decode_weight, expand

PER_TENSOR, PER_ROW = GroupShape(-1, -1), GroupShape(1, -1)


def random_ids(m: int, k: int, num_experts: int, dtype=torch.int32) -> torch.Tensor:
    """k distinct experts per token, uniformly."""
    return torch.rand(m, num_experts).argsort(dim=1)[:, :k].to(dtype).contiguous()


def random_layer(m, hidden, inter, num_experts, top_k, gated=True, dtype=torch.float32, w_scale=1.0):
    x = torch.randn(m, hidden)
    w13 = torch.randn(num_experts, (2 if gated else 1) * inter, hidden) * (w_scale / hidden**0.5)
    w2 = torch.randn(num_experts, hidden, inter) / inter**0.5
    ids = random_ids(m, top_k, num_experts)
    weights = torch.rand(m, top_k) + 0.1
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def assert_close_rel(out, ref, tol, what=""):
    """ref: a float64 tensor, or a Float64Reference whose tied codes may go either way."""
    err = ref.relative_error(out) if isinstance(ref, Float64Reference) else relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.3e}"


def test_dtype_tolerances_stay_within_100_roundings():
    """Every float64 check's dtype term is at most 100 unit roundoffs of the dtype (float32 1e-5 is 84):
    loosening it 1000x left every float32 check green before."""
    for dtype, tol in DTYPE_TOLERANCE.items():
        assert tol <= 100 * torch.finfo(dtype).eps, (dtype, tol)



def test_relative_error_of_hand_built_cases():
    """The checker's ||out - ref|| / ||ref||, on values worked out by hand: an error of 0.5 against a
    reference of norm 5 is 0.1 (a shrunken measure would pass every check it serves); NaN in out is
    NaN; two empty tensors are 0."""
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert relative_error(torch.tensor([[3.0, 0.3], [0.0, 3.6]]), ref) == pytest.approx(0.1, rel=1e-6)
    assert relative_error(ref.bfloat16(), ref.double()) == 0.0
    assert math.isnan(relative_error(torch.tensor([[3.0, float("nan")], [0.0, 4.0]]), ref))
    assert relative_error(torch.zeros(0, 4), torch.zeros(0, 4)) == 0.0


def test_relative_error_reads_float64_differences():
    """The measure is taken in float64: two float64 tensors 1e-10 apart relatively (invisible in float32,
    where they round to the same values) read 1e-10, so a check tighter than float32 rounding can fail."""
    ref = torch.randn(64, 32, dtype=torch.float64)
    assert relative_error(ref * (1 + 1e-10), ref) == pytest.approx(1e-10, rel=1e-3)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_fake_quantize_keeps_a_zero_row(fmt):
    """A row of exact zeros (a padding token) quantized per token stays exact zeros rather than 0 / 0 =
    NaN from a zero scale, and the other rows come out as they do without it."""
    x = torch.randn(6, 40, dtype=torch.float64)
    x[3] = 0.0
    got = fake_quantize(x, fmt, (1, -1))
    assert torch.equal(got[3], torch.zeros(40, dtype=torch.float64))
    others = [0, 1, 2, 4, 5]
    assert torch.equal(got[others], fake_quantize(x[others], fmt, (1, -1)))


def test_reference_forgives_tied_codes_and_nothing_else():
    """float64_reference's ties: a GEMM2 input on a rounding boundary may take either code, and only those.
    One token, one relu2 expert and static int8 scale 1, so GEMM2's input is h**2 on a grid of integers:
    h**2 = 2.5 and 0.5 (a float64 rounding from the boundary) are ties, 1.44 and 0.25 are not. The output
    of each choice is computed here directly, as tw * w2 @ codes."""
    h = torch.tensor([2.5**0.5, 1.2, 0.5, 0.5**0.5], dtype=torch.float64)
    w13 = torch.zeros(1, 4, 4, dtype=torch.float64)
    w13[0, :, 0] = h
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    w2 = torch.randn(1, 4, 4, dtype=torch.float64)
    tw, ids = torch.tensor([[0.7]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.long)
    act_quant = ("int8", (-1, -1), torch.tensor([1 / 64]), torch.tensor([1.0]), None, None)
    ref = float64_reference(x, w13, w2, tw, ids, activation="relu2", act_quant=act_quant, tie_margin=1e-6)
    assert [r for r, _ in ref.ties] == [0] and ref.ties[0][1].shape == (2, 4)

    def layer(codes):
        return 0.7 * (w2[0] @ torch.tensor(codes, dtype=torch.float64)).unsqueeze(0)

    correct = ([2, 1, 0, 0], [3, 1, 0, 0], [2, 1, 0, 1], [3, 1, 0, 1])
    for codes in correct:
        assert ref.relative_error(layer(codes)) < 1e-12, codes
    # Any other code is charged its distance to the nearest correct output.
    for codes in ([2, 2, 0, 0], [2, 1, 1, 0], [4, 1, 0, 0], [1, 1, 0, 1]):
        nearest = min((layer(codes) - layer(c)).norm().item() for c in correct)
        assert ref.relative_error(layer(codes)) == pytest.approx(nearest / ref.out.norm().item(), rel=1e-9), codes
        assert nearest > 1e-3 * w2.norm().item()  # the codes above do move the output
    untied = float64_reference(x, w13, w2, tw, ids, activation="relu2", act_quant=act_quant)
    assert untied.ties == () and untied.relative_error(layer([3, 1, 0, 1])) == relative_error(layer([3, 1, 0, 1]), untied.out) > 0
    with pytest.raises(ValueError, match="tie_margin"):
        float64_reference(x, w13, w2, tw, ids, activation="relu2", tie_margin=1e-6)
    with pytest.raises(TypeError, match="float64_reference"):
        moe_float64(x, w13, w2, tw, ids, activation="relu2", act_quant=act_quant, tie_margin=1e-6)


@pytest.mark.parametrize("fmt,group,static", [("fp8", (1, -1), False), ("int8", (1, -1), False),
                                              ("int8_static", (-1, -1), True), ("nvfp4", (1, 16), False)])  # fmt: skip
def test_fake_quant_tolerance_catches_a_reference_without_activation_quantization(fmt, group, static):
    """A check whose reference re-applies activation quantization (fake_quant=True) must fail when the
    reference leaves it out: the error quantization alone makes on random activations exceeds that
    tolerance, while staying within the tolerance of checks that do not re-apply it."""
    x = torch.randn(16, 128, dtype=torch.float64) * torch.exp(torch.randn(16, 1, dtype=torch.float64))
    qfmt = fmt.removesuffix("_static")
    scale = (x.abs().amax() / 127).reshape(1) if static else None
    global_scale = (x.abs().amax() / (448 * 6)).reshape(1) if qfmt == "nvfp4" else None
    err = relative_error(fake_quantize(x, qfmt, group, scale, global_scale), x)
    assert tolerance(torch.float32, fmt, fake_quant=True) < err <= tolerance(torch.float32, fmt), err


def test_moe_float64_rounds_where_a_bf16_layer_stores():
    """With bf16 hidden states, intermediate_dtype=bf16 and the router weight applied on the input, the
    checker rounds to bf16 where the layer stores: the weighted input, the GEMM1 output, the activation
    output and the GEMM2 output; recomputed here step by step in float64 (one expert, so every token's
    rows are multiplied in one product, as the checker does)."""
    m, hidden, inter = 8, 32, 16
    x = torch.randn(m, hidden).bfloat16()
    w13 = (torch.randn(1, 2 * inter, hidden) / hidden**0.5).bfloat16()
    w2 = (torch.randn(1, hidden, inter) / inter**0.5).bfloat16()
    tw = torch.rand(m, 1)
    ids = torch.zeros(m, 1, dtype=torch.int32)

    def bf16(t):
        return t.bfloat16().double()

    xin = bf16(x.double() * tw.double())
    h = bf16(xin @ w13[0].double().T)
    gate, up = h.chunk(2, dim=1)
    act = bf16(gate / (1 + torch.exp(-gate)) * up)
    want = bf16(act @ w2[0].double().T)
    got = moe_float64(x, w13, w2, tw, ids, apply_router_weight_on_input=True, intermediate_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    # fused_activation: a kernel applying the activation to its float32 sums stores only its output
    gate, up = (xin @ w13[0].double().T).chunk(2, dim=1)
    fused = bf16(bf16(gate / (1 + torch.exp(-gate)) * up) @ w2[0].double().T)
    got = moe_float64(x, w13, w2, tw, ids, apply_router_weight_on_input=True, intermediate_dtype=torch.bfloat16, fused_activation=True)
    assert torch.equal(got, fused) and not torch.equal(fused, want)


def test_moe_float64_computes_in_float64():
    """Without intermediate rounding the checker is exact to float64 rounding: against the layer's formula
    written here with einsum over each pair's expert weights, biases included. A checker multiplying in
    float32 (errors ~1e-7) would pass float32 layers whatever their own float32 rounding."""
    m, hidden, inter, num_experts, top_k = 24, 48, 40, 5, 3
    x, w13, w2, tw, ids = random_layer(m, hidden, inter, num_experts, top_k)
    b13, b2 = torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)
    e = ids.long()
    h = torch.einsum("mh,mknh->mkn", x.double(), w13.double()[e]) + b13.double()[e]
    gate, up = h.chunk(2, dim=-1)
    act = gate * torch.sigmoid(gate) * up
    y = torch.einsum("mkn,mkhn->mkh", act, w2.double()[e]) + b2.double()[e]
    want = (y * tw.double().unsqueeze(-1)).sum(dim=1)
    got = moe_float64(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2)
    assert got.dtype == torch.float64
    assert relative_error(got, want) <= 1e-12, relative_error(got, want)


def test_moe_float64_of_a_batch_routed_only_to_remote_experts_is_zero():
    """When no pair of the batch has a local expert (expert parallelism: every chosen expert lives on
    another rank), no expert adds anything: the checker's output is exact zeros of [M, H], as the
    layer's is (checked in test_expert_map_remote_experts_contribute_nothing)."""
    x, w13, w2, tw, _ = random_layer(7, 32, 16, 4, 2)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1])
    ids = torch.randint(4, 7, (7, 2), dtype=torch.int32)
    got = moe_float64(x, w13, w2, tw, ids, expert_map=expert_map)
    assert torch.equal(got, torch.zeros(7, 32, dtype=torch.float64))


# ==== routing =====================================================================================

# Elementwise relative tolerance of routing weights computed in float32 against float64. The table
# in moe_ops.reference has no per-element routing entry; DTYPE_TOLERANCE[float32] is a norm bound
# for a whole layer, so the routing check uses the tighter 1e-6 it was specified with.
ROUTE_RTOL = 1e-6


def route_float64(logits, top_k, scoring, renormalize, num_expert_group=None, topk_group=None, bias=None, scale=1.0):
    """Per-row Python loop in float64; returns (weights [M, k] as lists, ids as lists)."""
    out_w, out_ids = [], []
    num_experts = logits.shape[1]
    bias = [0.0] * num_experts if bias is None else [float(b) for b in bias.double()]
    for row in logits.double().tolist():
        if scoring == "softmax":
            top = max(row)
            ex = [math.exp(v - top) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        sel = [s + b for s, b in zip(scores, bias)]
        candidates = list(range(num_experts))
        if num_expert_group:
            size = num_experts // num_expert_group
            group_score = []
            for g in range(num_expert_group):
                vals = sorted(sel[g * size : (g + 1) * size], reverse=True)
                group_score.append(sum(vals[:2]) if any(bias) else vals[0])
            kept = sorted(range(num_expert_group), key=lambda g: -group_score[g])[:topk_group]
            candidates = [e for e in candidates if e // size in kept]
        chosen = sorted(candidates, key=lambda e: -sel[e])[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        out_w.append([v * scale for v in w])
        out_ids.append(chosen)
    return out_w, out_ids


# name -> (route kwargs, E, k)
ROUTING_METHODS = {
    "softmax_topk": (dict(scoring="softmax", renormalize=False), 16, 4),
    "softmax_topk_renormalized": (dict(scoring="softmax", renormalize=True), 16, 4),
    "sigmoid_top1_llama4": (dict(scoring="sigmoid", renormalize=False), 16, 1),
    "sigmoid_topk_renormalized": (dict(scoring="sigmoid", renormalize=True), 16, 4),
    "deepseek_v3_grouped": (
        dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5, bias=True),
        64, 8,
    ),  # fmt: skip
    "grouped_no_bias": (dict(scoring="softmax", renormalize=True, num_expert_group=4, topk_group=2), 32, 6),
}


def _route_args(method):
    kwargs, num_experts, top_k = ROUTING_METHODS[method]
    kwargs = dict(kwargs)
    bias = torch.randn(num_experts) * 0.5 if kwargs.pop("bias", False) else None
    return kwargs, bias, num_experts, top_k


@pytest.mark.parametrize("method", list(ROUTING_METHODS))
def test_route_matches_float64(method):
    kwargs, bias, num_experts, top_k = _route_args(method)
    logits = torch.randn(64, num_experts) * 2
    weights, ids = route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (64, top_k)
    ref_w, ref_ids = route_float64(
        logits, top_k, kwargs["scoring"], kwargs["renormalize"], kwargs.get("num_expert_group"),
        kwargs.get("topk_group"), bias, kwargs.get("routed_scaling_factor", 1.0),
    )  # fmt: skip
    for m in range(64):
        got = dict(zip(ids[m].tolist(), weights[m].double().tolist()))
        want = dict(zip(ref_ids[m], ref_w[m]))
        assert set(got) == set(want), f"row {m}: ids {sorted(got)} != {sorted(want)}"
        for e, w in want.items():
            assert abs(got[e] - w) <= ROUTE_RTOL * abs(w), f"row {m}, expert {e}: weight {got[e]} != {w}"


def test_deepseek_bias_steers_selection_only():
    """A large correction bias forces experts into the selection, but their weights stay unbiased."""
    num_experts, top_k = 64, 8
    logits = torch.randn(32, num_experts)
    bias = torch.zeros(num_experts)
    bias[[5, 40]] = 100.0  # in groups 0 and 5 of 8: both groups win and both experts are chosen
    weights, ids = route(logits, top_k, scoring="sigmoid", renormalize=False, num_expert_group=8, topk_group=4,
                         e_score_correction_bias=bias)  # fmt: skip
    sig = torch.sigmoid(logits.double())
    for m in range(32):
        row = ids[m].tolist()
        assert 5 in row and 40 in row
        for j, e in enumerate(row):
            assert abs(weights[m, j].item() - sig[m, e].item()) <= ROUTE_RTOL * sig[m, e].item()


@pytest.mark.parametrize("method", list(ROUTING_METHODS))
def test_route_nan_logits_do_not_crash(method):
    kwargs, bias, num_experts, top_k = _route_args(method)
    logits = torch.randn(16, num_experts)
    logits[3, 5] = float("nan")
    logits[7] = float("nan")
    logits[11, ::2] = float("nan")
    weights, ids = route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    assert ((ids >= 0) & (ids < num_experts)).all()
    # rows without NaN are routed as without the NaN rows (not bit-exactly: the batch size may change
    # the vectorization)
    clean = [m for m in range(16) if m not in (3, 7, 11)]
    w_clean, ids_clean = route(logits[clean], top_k, e_score_correction_bias=bias, **kwargs)
    assert torch.equal(ids[clean], ids_clean)
    assert torch.allclose(weights[clean], w_clean, rtol=ROUTE_RTOL, atol=0)
    # and through the plan, nothing is out of bounds
    offsets, gather_idx, inverse = routing_plan(ids, num_experts, None)
    assert offsets[-1].item() == ids.numel()


@pytest.mark.parametrize("method", list(ROUTING_METHODS))
def test_route_nan_row_weights_are_nan(method):
    """Documented in moe_ops/routing.py: 'the weights of a row with NaN logits are NaN'."""
    kwargs, bias, num_experts, top_k = _route_args(method)
    logits = torch.randn(8, num_experts)
    logits[2, 1] = float("nan")
    weights, _ = route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    assert weights[2].isnan().all(), f"row with a NaN logit got weights {weights[2].tolist()}"
    assert not weights[[0, 1, 3, 4, 5, 6, 7]].isnan().any()


# ==== activations through fused_experts ===========================================================

ACTIVATION_CASES = {
    "silu": Activation("silu"),
    "gelu": Activation("gelu"),
    "gelu_tanh": Activation("gelu_tanh"),
    "swigluoai": Activation("swigluoai"),
    "swigluoai_interleaved": Activation("swigluoai", interleaved=True),
    "swigluoai_alpha_limit": Activation("swigluoai", alpha=1.2, limit=1.5, interleaved=True),
    "silu_interleaved": Activation("silu", interleaved=True),
    "silu_clamped_limit": Activation("silu_clamped", limit=1.5),
    "silu_clamped_interleaved": Activation("silu_clamped", limit=1.5, interleaved=True),
    # Inkling-2's softcaps, small enough to bend most of these sums (the defaults 4 and 25 would barely).
    "swiglu_softcapped": Activation("swiglu_softcapped", alpha=1.0, limit=2.0),
    "swiglu_softcapped_interleaved": Activation("swiglu_softcapped", alpha=1.0, limit=2.0, interleaved=True),
    "relu2": Activation("relu2"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_activation_vs_float64(case, dtype):
    act = ACTIVATION_CASES[case]
    num_experts, hidden, inter, m, top_k = 6, 64, 48, 37, 2
    swiglu = act.kind in ("swigluoai", "silu_clamped", "swiglu_softcapped")
    x, w13, w2, tw, ids = random_layer(m, hidden, inter, num_experts, top_k, act.gated, dtype, w_scale=3.0 if swiglu else 1.0)
    b13 = b2 = None
    if swiglu:  # gpt-oss has biases; pre-activations exceed the limit so the clamps are exercised
        b13 = torch.randn(num_experts, w13.shape[1]).to(dtype)
        b2 = torch.randn(num_experts, hidden).to(dtype)
        pre = torch.einsum("mh,enh->men", x.double(), w13.double())
        assert (pre.abs() > act.limit).any()
    out = fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)
    assert out.shape == (m, hidden) and out.dtype == dtype
    ref = moe_float64(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2,
                      intermediate_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)  # fmt: skip
    assert_close_rel(out, ref, tolerance(dtype), case)


def test_swigluoai_against_formula():
    """moe_float64's activation against gpt-oss' formula written out here (so the reference itself is
    checked): gate clamped above, up clamped both sides, gate * sigmoid(alpha * gate) * (up + 1)."""
    h = torch.randn(20, 16, dtype=torch.float64) * 6
    gate, up = h[:, 0::2], h[:, 1::2]
    g = torch.minimum(gate, torch.tensor(7.0, dtype=torch.float64))
    u = up.clamp(-7.0, 7.0)
    want = g * torch.sigmoid(1.702 * g) * (u + 1)
    got = apply_activation(h, "swigluoai", 1.702, 7.0, interleaved=True)
    assert_close_rel(got, want, tolerance(torch.float32), "reference swigluoai")
    assert not torch.equal(got, apply_activation(h, "swigluoai", 1.702, 7.0, interleaved=False))
    op = moe_ops.activation.activation(h.float(), "swigluoai", 1.702, 7.0, True)
    assert_close_rel(op, want, tolerance(torch.float32), "moe_ops::activation swigluoai")


# ==== quantization schemes ========================================================================

# name -> QuantScheme; every entry of SCHEMES appears (test_every_scheme_is_covered).
QUANT_CASES = {
    "unquantized": QuantScheme(),
    "fp8_w8a8_per_tensor_static": QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("fp8", PER_TENSOR)),
    "fp8_w8a8_per_tensor_dynamic": QuantScheme(ActivationQuant("fp8", PER_TENSOR), WeightQuant("fp8", PER_TENSOR)),
    "fp8_w8a8_per_token": QuantScheme(ActivationQuant("fp8", PER_ROW), WeightQuant("fp8", PER_ROW)),
    "fp8_w8a8_block": QuantScheme(ActivationQuant("fp8", GroupShape(1, 32)), WeightQuant("fp8", GroupShape(32, 32))),
    "int8_w8a8_dynamic": QuantScheme(ActivationQuant("int8", PER_ROW), WeightQuant("int8", PER_ROW)),
    "int8_w8a8_static": QuantScheme(ActivationQuant("int8", PER_TENSOR, static=True), WeightQuant("int8", PER_ROW)),
    "fp8_w8a16_per_tensor": QuantScheme(None, WeightQuant("fp8", PER_TENSOR)),
    "fp8_w8a16_per_channel": QuantScheme(None, WeightQuant("fp8", PER_ROW)),
    "fp8_w8a16_block": QuantScheme(None, WeightQuant("fp8", GroupShape(32, 32))),
    "int8_w8a16_per_channel": QuantScheme(None, WeightQuant("int8", PER_ROW)),
    "int8_w8a16_group": QuantScheme(None, WeightQuant("int8", GroupShape(1, 32))),
    "int4_w4a16_symmetric": QuantScheme(None, WeightQuant("int4", GroupShape(1, 32))),
    "int4_w4a16_zero_point": QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True)),
    "nvfp4_w4a16": QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16))),
    "nvfp4_w4a4": QuantScheme(ActivationQuant("nvfp4", GroupShape(1, 16)), WeightQuant("nvfp4", GroupShape(1, 16))),
    "mxfp4_w4a16": QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32))),
    "mxfp4_w4a8_per_tensor_static": QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=True), WeightQuant("mxfp4", GroupShape(1, 32))),
    "mxfp4_w4a8_per_tensor_dynamic": QuantScheme(ActivationQuant("fp8", PER_TENSOR), WeightQuant("mxfp4", GroupShape(1, 32))),
    "mxfp4_w4a8_per_token": QuantScheme(ActivationQuant("fp8", PER_ROW), WeightQuant("mxfp4", GroupShape(1, 32))),
}  # fmt: skip
BIASED = {"mxfp4_w4a16", "int4_w4a16_zero_point", "fp8_w8a8_per_token"}
ACT_MAX = {"fp8": 448.0, "int8": 127.0, "nvfp4": 448.0 * 6.0}


def test_every_scheme_is_covered():
    assert {s.name for s in QUANT_CASES.values()} == set(SCHEMES) == set(FACTORIES)


def _sizes(scheme: QuantScheme) -> tuple[int, int, int]:
    """(M, H, I). The op rounds GEMM1's output in float32 and the reference in float64, so now and then
    an element of GEMM2's input lands on the other side of a rounding boundary and moves by one
    quantization step; one such step weighs ~1/sqrt(M * I) of the output, so the layer is made large
    enough that FAKE_QUANT_TOLERANCE covers it with margin (per-tensor schemes cost nothing more in
    the float64 re-quantization, so they get the largest layer: their steps are the coarsest)."""
    a = scheme.activation
    if a is not None and a.group.kind == "per-tensor":
        return 1024, 64, 512
    return 256, 64, 256


def _quant_layer(case, dtype, m=None, num_experts=5, top_k=2):
    scheme = QUANT_CASES[case]
    m_default, hidden, inter = _sizes(scheme)
    m = m_default if m is None else m
    x, w13, w2, tw, ids = random_layer(m, hidden, inter, num_experts, top_k)
    biases = {}
    if case in BIASED:
        biases = dict(w13_bias=torch.randn(num_experts, 2 * inter).to(dtype), w2_bias=torch.randn(num_experts, hidden).to(dtype))
    inter = moe_ops.expert_intermediates(x, w13.to(dtype), ids, w13_bias=biases.get("w13_bias"))
    q13, q2, config = quantize_weights(scheme, w13.to(dtype), w2.to(dtype), calibration=x, intermediate_calibration=inter, **biases)
    assert config.name == scheme.name
    wq = scheme.weight
    d13 = decode_weight(q13, wq, config.w13_scale, config.w13_global_scale, config.w13_zero)
    d2 = decode_weight(q2, wq, config.w2_scale, config.w2_global_scale, config.w2_zero)
    if wq is not None:  # the decoded weights approximate the float ones (the quantizer is sane)
        assert relative_error(d13, w13.to(dtype)) < 0.2 and relative_error(d2, w2.to(dtype)) < 0.2
    return scheme, x.to(dtype), q13, q2, config, d13, d2, tw, ids, biases


def _act_quant(scheme, config):
    a = scheme.activation
    if a is None:
        return None
    return (a.dtype, a.group.astuple(), config.a13_scale, config.a2_scale, config.a13_global_scale, config.a2_global_scale)


def _fake_quant_reference(x, d13, d2, tw, ids, scheme, config, dtype=torch.float32, **kwargs):
    """float64_reference with the scheme's activation quantization re-applied; a float32 layer's GEMM2
    input codes at a rounding boundary may go either way (TIE_MARGIN)."""
    act_quant = _act_quant(scheme, config)
    margin = TIE_MARGIN.get(dtype, 0.0) if act_quant is not None else 0.0
    return float64_reference(x, d13, d2, tw, ids, act_quant=act_quant, tie_margin=margin, **kwargs)


# nvfp4 global scales are multiplied by this non-dyadic factor. With global = amax / (448 * 6) exactly, a
# block's scale amax_block / (6 * global) = 448 * amax_block / amax is a ratio of bf16 values that often
# lands exactly on an e4m3 midpoint, where the op's float32 arithmetic and the float64 reference may
# round to different neighbours and rescale the whole block (seen once in ~15 runs without it).
NVFP4_GLOBAL_NUDGE = 1.0 + 2.0**-6 / 3


def _calibrated(scheme, config, x, d13, ids, num_experts, biases):
    """Static activation scales (and nvfp4 global scales) from the real activations, as a calibration
    would give them (quantize_weights only estimates GEMM2's input range as 4x GEMM1's)."""
    a = scheme.activation
    if a is None or not (a.static or a.dtype == "nvfp4"):
        return config
    xd = x.double()
    h = []
    for e in range(num_experts):
        tok = (ids.long() == e).any(dim=1)
        pre = xd[tok] @ d13[e].T
        if "w13_bias" in biases:
            pre = pre + biases["w13_bias"][e].double()
        h.append(apply_activation(pre, "silu"))
    amax13, amax2 = xd.abs().max().item(), torch.cat(h).abs().max().item()
    key, nudge = ("global_scale", NVFP4_GLOBAL_NUDGE) if a.dtype == "nvfp4" else ("scale", 1.0)
    new = {f"a{which}_{key}": torch.tensor([amax * nudge / ACT_MAX[a.dtype]]) for which, amax in (("13", amax13), ("2", amax2))}
    return dataclasses.replace(config, **new)


# fmt, group, dtypes of x
QUANTIZE_OP_CASES = [
    ("fp8", (-1, -1), True), ("fp8", (-1, -1), False), ("fp8", (1, -1), False), ("fp8", (1, 128), False),
    ("int8", (1, -1), False), ("int8", (-1, -1), True), ("nvfp4", (1, 16), False),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,group,static", QUANTIZE_OP_CASES)
def test_quantize_op_matches_fake_quantize(fmt, group, static, dtype):
    """moe_ops::quantize, dequantized by the independent decoders here, equals the reference's float64
    re-quantization (the one the layer tests rely on) element for element."""
    m, k = 24, 320
    x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).to(dtype)
    amax = x.double().abs().max().item()
    scale = torch.tensor([amax / ACT_MAX[fmt] * 0.7]) if static else None  # 0.7: some values saturate
    global_scale = torch.tensor([amax / ACT_MAX[fmt] * NVFP4_GLOBAL_NUDGE]) if fmt == "nvfp4" else None
    q, s = moe_ops.quant.quantize.quantize(x, fmt, list(group), scale, global_scale)
    if fmt == "nvfp4":
        # the nvfp4 scale is block * global rounded to float32, as the reference and the op apply it
        values, full = decode_e2m1_packed(q.unsqueeze(0))[0], (decode_e4m3(s) * global_scale.double()).float().double()
    else:
        values, full = (decode_e4m3(q) if fmt == "fp8" else q.double()), s.double()
    gs = GroupShape(*group)
    full = expand(full.unsqueeze(0), gs, m, k)[0]
    got = values * full
    want = fake_quantize(x.double(), fmt, group, scale, global_scale)
    diff = got != want
    assert not diff.any(), f"{int(diff.sum())} of {got.numel()} elements differ"


def test_quantize_op_e2m1_ties_match_reference():
    """nvfp4 activations that sit exactly on e2m1 midpoints: with global scale 2**-8 and a block amax of
    6 * 2**j, the block scale is 2**(j + 8) (exact in e4m3), so x / (block * global) is the midpoint."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    m, k = 8, 64
    v = mids[torch.randint(0, 7, (m, k))] * torch.where(torch.rand(m, k) < 0.5, -1.0, 1.0)
    v[:, ::16] = 6.0
    x = v * 2.0 ** torch.randint(-4, 1, (m, k // 16)).float().repeat_interleave(16, dim=1)
    g = torch.tensor([2.0**-8])
    q, s = moe_ops.quant.quantize.quantize(x, "nvfp4", [1, 16], None, g)
    got = decode_e2m1_packed(q.unsqueeze(0))[0] * expand(decode_e4m3(s).unsqueeze(0) * 2.0**-8, GroupShape(1, 16), m, k)[0]
    want = fake_quantize(x.double(), "nvfp4", (1, 16), None, g)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} elements differ"


QUANT_DTYPES = [(c, torch.float32) for c in QUANT_CASES] + [
    (c, torch.bfloat16)
    for c in ("fp8_w8a8_per_token", "int4_w4a16_zero_point", "nvfp4_w4a4", "mxfp4_w4a8_per_tensor_static", "int8_w8a8_dynamic")
]  # fmt: skip


@pytest.mark.parametrize("case,dtype", QUANT_DTYPES, ids=[f"{c}-{str(d)[6:]}" for c, d in QUANT_DTYPES])
def test_scheme_vs_float64_fake_quant(case, dtype):
    """Activation quantization re-applied in the float64 reference: only rounding differences remain."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, dtype)
    config = _calibrated(scheme, config, x, d13, ids, q13.shape[0], biases)
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    assert out.dtype == dtype and out.shape == x.shape
    inter = torch.bfloat16 if dtype == torch.bfloat16 else None
    ref = _fake_quant_reference(x, d13, d2, tw, ids, scheme, config, dtype, intermediate_dtype=inter, **biases)
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    assert_close_rel(out, ref, tolerance(dtype, a_dtype, fake_quant=True), case)


@pytest.mark.parametrize("case", QUANT_CASES)
def test_scheme_vs_float64_unquantized_activations(case):
    """The reference keeps activations in float64: the quantization error of the activations must stay
    within ACTIVATION_QUANT_TOLERANCE (with calibrated static scales)."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.float32)
    config = _calibrated(scheme, config, x, d13, ids, q13.shape[0], biases)
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    ref = moe_float64(x, d13, d2, tw, ids, **biases)
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    if a_dtype == "int8" and scheme.activation.static:
        a_dtype = "int8_static"  # one step for the whole tensor: its own entry in the table
    assert_close_rel(out, ref, tolerance(torch.float32, a_dtype), case)


@pytest.mark.parametrize("case", ["fp8_w8a8_per_tensor_static", "int8_w8a8_static", "mxfp4_w4a8_per_tensor_static"])
def test_static_activation_scale_is_used(case):
    """With static scales, the layer uses the given scale, not one computed from the batch: a scale 20x
    too small (saturating) changes the result, and the reference with that scale predicts it."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.float32)
    coarse = dataclasses.replace(config, a13_scale=config.a13_scale / 20, a2_scale=config.a2_scale / 20)
    out = fused_experts(x, q13, q2, tw, ids, quant_config=coarse)
    ref_coarse = _fake_quant_reference(x, d13, d2, tw, ids, scheme, coarse)
    ref_fine = moe_float64(x, d13, d2, tw, ids, act_quant=_act_quant(scheme, config))
    tol = tolerance(torch.float32, scheme.activation.dtype, fake_quant=True)
    assert_close_rel(out, ref_coarse, tol, case)
    assert relative_error(out, ref_fine) > tol


@pytest.mark.parametrize("case", ["fp8_w8a8_per_tensor_dynamic", "mxfp4_w4a8_per_tensor_dynamic", "nvfp4_w4a4"])
def test_an_inf_token_leaves_the_others_under_a_dynamic_per_tensor_scale(case):
    """One token of inf (an overflow upstream) is left out of the batch's amax at both GEMMs: the other
    tokens come out as they do without it, and the bad token's output is not finite. Before, the scale
    became inf and every token's output NaN. nvfp4 (a calibrated global scale, per-group scales) keeps the
    others alike anyway; its inf groups' scales must be NaN, not saturated at 448, which gave the bad
    token a finite output."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.float32, m=64)
    bad = 5
    x = x.clone()
    x[bad] = float("inf")
    others = torch.arange(x.shape[0]) != bad
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    without = fused_experts(x[others], q13, q2, tw[others], ids[others], quant_config=config)
    assert not out[bad].isfinite().any()
    assert out[others].isfinite().all()
    assert_close_rel(out[others], without.double(), 1e-6, case)


def test_factories_build_the_same_layer():
    """A config from the FACTORIES (here int4 with zero points and mxfp4 with per-token fp8
    activations) runs the same numbers as quantize_weights' config."""
    x, w13, w2, tw, ids = random_layer(11, 64, 32, 4, 2)
    scheme = QuantScheme(None, WeightQuant("int4", GroupShape(1, 32), zero_point=True))
    q13, q2, c = quantize_weights(scheme, w13, w2)
    config = FACTORIES["int4_w4a16"](c.w13_scale, c.w2_scale, group_size=32, w13_zero=c.w13_zero, w2_zero=c.w2_zero)
    ref = moe_float64(x, decode_weight(q13, scheme.weight, c.w13_scale, None, c.w13_zero),
                      decode_weight(q2, scheme.weight, c.w2_scale, None, c.w2_zero), tw, ids)  # fmt: skip
    assert_close_rel(fused_experts(x, q13, q2, tw, ids, quant_config=config), ref, tolerance(torch.float32), "int4")
    scheme = QuantScheme(ActivationQuant("fp8", PER_ROW), WeightQuant("mxfp4", GroupShape(1, 32)))
    q13, q2, c = quantize_weights(scheme, w13, w2)
    config = FACTORIES["mxfp4_w4a8"](c.w13_scale, c.w2_scale, per_token=True)
    ref = _fake_quant_reference(x, decode_weight(q13, scheme.weight, c.w13_scale), decode_weight(q2, scheme.weight, c.w2_scale),
                                tw, ids, scheme, c)  # fmt: skip
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    assert_close_rel(out, ref, tolerance(torch.float32, "fp8", fake_quant=True), "mxfp4_w4a8")


# ==== layer edge cases ============================================================================


def test_expert_map_remote_experts_contribute_nothing():
    num_global, num_local, hidden, inter, m, top_k = 8, 4, 64, 32, 40, 3
    x, w13, w2, tw, ids = random_layer(m, hidden, inter, num_local, top_k)
    ids = random_ids(m, top_k, num_global)
    expert_map = torch.tensor([2, -1, 0, -1, -1, 3, 1, -1])
    out = fused_experts(x, w13, w2, tw, ids, expert_map=expert_map)
    ref = moe_float64(x, w13, w2, tw, ids, expert_map=expert_map)
    assert_close_rel(out, ref, tolerance(torch.float32), "expert_map")
    # the same result with the remote pairs' weights zeroed and their ids sent to some local expert
    remote = expert_map[ids.long()] < 0
    local_ids = torch.where(remote, 0, expert_map[ids.long()]).to(torch.int32)
    ref_zeroed = moe_float64(x, w13, w2, torch.where(remote, 0.0, tw), local_ids)
    assert_close_rel(out, ref_zeroed, tolerance(torch.float32), "expert_map vs zeroed weights")
    # a token whose experts are all remote gets exactly zero
    ids[0] = torch.tensor([1, 3, 4])
    out = fused_experts(x, w13, w2, tw, ids, expert_map=expert_map)
    assert torch.equal(out[0], torch.zeros(hidden))


def test_nan_token_routed_only_to_remote_experts_does_not_leak():
    x, w13, w2, tw, ids = random_layer(9, 32, 32, 4, 2)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1])
    ids[4] = torch.tensor([4, 5])
    x[4] = float("nan")
    out = fused_experts(x, w13, w2, tw, ids, expert_map=expert_map)
    assert torch.equal(out[4], torch.zeros(32))
    keep = [i for i in range(9) if i != 4]
    assert torch.isfinite(out[keep]).all()
    assert_close_rel(out[keep], moe_float64(x[keep], w13, w2, tw[keep], ids[keep], expert_map=expert_map),
                     tolerance(torch.float32), "NaN token")  # fmt: skip


@pytest.mark.parametrize("case", ["fp8_w8a8_per_tensor_dynamic", "mxfp4_w4a8_per_tensor_dynamic"])
def test_nan_token_does_not_poison_a_per_tensor_dynamic_scale(case):
    """A token of NaN (a garbage padding row of a captured batch) gets NaN, and the other tokens get what
    they get without it: the per-tensor activation scales of both GEMMs skip NaN, as vLLM's amax does
    (it made every token NaN)."""
    scheme, x, q13, q2, config, _, _, tw, ids, _ = _quant_layer(case, torch.float32, m=64)
    x[4] = float("nan")
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    assert out[4].isnan().all()
    keep = torch.arange(64) != 4
    without = fused_experts(x[keep], q13, q2, tw[keep], ids[keep], quant_config=config)
    assert torch.isfinite(out[keep]).all()
    assert_close_rel(out[keep], without, 1e-6, "the other tokens, against the layer without the NaN token")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_apply_router_weight_on_input(activation, dtype):
    """The weighted input is rounded back to the layer's dtype, as a bf16 layer stores it: the output
    stays bf16 (a float32 product would carry float32 through both GEMMs and return float32)."""
    gated = activation != "relu2"
    x, w13, w2, tw, ids = random_layer(23, 64, 32, 5, 1, gated, dtype)
    tw = tw * 3  # far from 1, so input- and output-side weighting differ
    out = fused_experts(x, w13, w2, tw, ids, activation=activation, apply_router_weight_on_input=True)
    assert out.dtype == dtype
    inter = torch.bfloat16 if dtype == torch.bfloat16 else None
    ref = moe_float64(x, w13, w2, tw, ids, activation=activation, apply_router_weight_on_input=True, intermediate_dtype=inter)
    assert_close_rel(out, ref, tolerance(dtype), "apply_router_weight_on_input")
    other = moe_float64(x, w13, w2, tw, ids, activation=activation, intermediate_dtype=inter)
    assert relative_error(out, other) > 10 * tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_zero_tokens(dtype, strided):
    # A view with no rows, e.g. of a wider buffer, has strides that describe nothing: no layout to reject.
    x = torch.randn(0, 128)[:, ::2] if strided else torch.randn(0, 64)
    _, w13, w2, _, _ = random_layer(1, 64, 32, 4, 2, dtype=dtype)
    out = fused_experts(x.to(dtype), w13, w2, torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 64) and out.dtype == dtype


def test_empty_expert_matrices_have_no_layout_to_check():
    """I = 0: each expert's matrices hold no element, so their strides (here neither row- nor column-major,
    as an empty view can have) are not checked, and the layer adds nothing: exact zeros."""
    x, w13, _, tw, ids = random_layer(5, 32, 0, 4, 2)
    w2 = torch.randn(32, 0, 4).permute(2, 0, 1)  # [E, H, 0], strides (1, 4, 4)
    out = fused_experts(x, w13, w2, tw, ids)
    assert torch.equal(out, torch.zeros(5, 32))


@pytest.mark.parametrize("case", ["unquantized", "fp8_w8a8_per_tensor_dynamic", "nvfp4_w4a4", "int8_w8a8_static"])
def test_one_token(case):
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.float32, m=1)
    out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    ref = _fake_quant_reference(x, d13, d2, tw, ids, scheme, config, **biases)
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    assert_close_rel(out, ref, tolerance(torch.float32, a_dtype, fake_quant=True), case)


def _layer_check(ids, num_experts=6, hidden=64, inter=32, dtype=torch.float32):
    m, top_k = ids.shape
    x, w13, w2, _, _ = random_layer(m, hidden, inter, num_experts, top_k, dtype=dtype)
    tw = torch.rand(m, top_k) + 0.1
    out = fused_experts(x, w13, w2, tw, ids, activation="gelu")
    ref = moe_float64(x, w13, w2, tw, ids, activation="gelu",
                      intermediate_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)  # fmt: skip
    assert_close_rel(out, ref, tolerance(dtype), "layer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skewed_routing_all_tokens_to_one_expert(dtype):
    _layer_check(torch.full((50, 1), 4, dtype=torch.int32), dtype=dtype)
    ids = torch.stack([torch.full((50,), 4), torch.randint(0, 4, (50,))], dim=1).to(torch.int64)
    _layer_check(ids, dtype=dtype)


def test_experts_without_tokens():
    ids = random_ids(30, 2, 2) * 3  # only experts 0 and 3 of 6 get tokens
    _layer_check(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_equals_num_experts(dtype):
    _layer_check(random_ids(17, 6, 6), num_experts=6, dtype=dtype)


def test_column_major_weights():
    x, w13, w2, tw, ids = random_layer(21, 64, 32, 4, 2)
    w13_cm = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_cm = w2.transpose(1, 2).contiguous().transpose(1, 2)
    out = fused_experts(x, w13_cm, w2_cm, tw, ids)
    assert_close_rel(out, moe_float64(x, w13, w2, tw, ids), tolerance(torch.float32), "column-major")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_expert_intermediates_apply_the_whole_activation(dtype):
    """expert_intermediates (GEMM2's calibration inputs) applies the Activation it is given, parameters
    and layout included, not just its kind: a gpt-oss SwiGLU with its own alpha and limit, interleaved,
    with a bias, against float64 rows in pair order, grouped by expert (stable within one). It computes
    in float32 whatever the samples' dtype, float64 (which no op takes) included."""
    num_experts, hidden, inter, m, top_k = 4, 32, 16, 11, 2
    act = Activation("swigluoai", alpha=1.2, limit=1.5, interleaved=True)
    x, w13, _, _, ids = random_layer(m, hidden, inter, num_experts, top_k, dtype=dtype, w_scale=3.0)
    b13 = torch.randn(num_experts, 2 * inter).to(dtype)
    out = moe_ops.expert_intermediates(x, w13, ids, activation=act, w13_bias=b13)
    e = ids.flatten().long()
    pre = torch.einsum("ph,pnh->pn", x.double().repeat_interleave(top_k, 0), w13.double()[e]) + b13.double()[e]
    assert (pre.abs() > act.limit).any()  # the clamps are exercised
    want = apply_activation(pre, act.kind, act.alpha, act.limit, act.interleaved)
    assert_close_rel(out, want[e.argsort(stable=True)], tolerance(torch.float32), "expert_intermediates")


# ==== routing_plan ================================================================================


def _local(ids: torch.Tensor, expert_map, num_experts):
    """Python: the local expert of each pair, None when dropped."""
    out = []
    for e in ids.flatten().tolist():
        loc = e if expert_map is None else expert_map[e].item()
        out.append(loc if 0 <= loc < num_experts else None)
    return out


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k", [(0, 2), (1, 1), (1, 4), (37, 3), (200, 8)])
def test_routing_plan_properties(m, k, with_map):
    num_experts = 8
    expert_map = torch.tensor([3, -1, 0, 7, -1, 1, 2, -1, 4, 5, 6, -1]) if with_map else None
    ids = random_ids(m, k, 12 if with_map else num_experts, dtype=torch.int64 if with_map else torch.int32)
    offsets, gather_idx, inverse = routing_plan(ids, num_experts, expert_map)
    assert offsets.dtype == gather_idx.dtype == inverse.dtype == torch.int32
    assert offsets.shape == (num_experts + 1,) and gather_idx.shape == inverse.shape == (m * k,)
    local = _local(ids, expert_map, num_experts)
    counts = [sum(1 for e in local if e == x) for x in range(num_experts)]
    off = offsets.tolist()
    assert off[0] == 0 and all(a <= b for a, b in zip(off, off[1:]))
    assert [b - a for a, b in zip(off, off[1:])] == counts
    assert off[-1] == sum(e is not None for e in local)
    inv = inverse.tolist()
    assert sorted(inv) == list(range(m * k)), "inverse is not a permutation"
    pair_of_row = [None] * (m * k)
    for p, r in enumerate(inv):
        pair_of_row[r] = p
        assert gather_idx[r].item() == p // k
    for e in range(num_experts):
        pairs = pair_of_row[off[e] : off[e + 1]]
        assert all(local[p] == e for p in pairs)
        assert pairs == sorted(pairs), "order within an expert is not stable"
    dropped = pair_of_row[off[-1] :]
    assert all(local[p] is None for p in dropped) and dropped == sorted(dropped)


def test_routing_plan_drops_out_of_range_ids():
    """Out-of-range ids (possible in compiled calls, where they are not checked) are dropped like
    remote experts; calling the op directly skips the eager check."""
    ids = torch.tensor([[0, 9], [-3, 2], [1, 4]], dtype=torch.int32)
    offsets, gather_idx, inverse = routing_plan(ids, 4, None)
    assert offsets.tolist() == [0, 1, 2, 3, 3]
    assert inverse.tolist() == [0, 3, 4, 2, 1, 5]
    assert gather_idx.tolist() == [0, 2, 1, 0, 1, 2]


# ==== weighted_reduce =============================================================================


def _reduce_inputs(m, k, hidden, dtype):
    expert_map = torch.tensor([0, 1, -1, 2, 3, -1])
    ids = random_ids(m, k, 6)
    offsets, _, inverse = routing_plan(ids, 4, expert_map)
    y = torch.randn(m * k, hidden).to(dtype)
    y[offsets[-1].item() :] = torch.randn(m * k - offsets[-1].item(), hidden) * 1e6  # dropped rows
    return y, torch.rand(m, k), inverse, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_reduce_fixed_order_float32(dtype):
    """out[m] = ((w0*y0 + w1*y1) + w2*y2) ... in float32, skipping dropped rows: bit-exact."""
    m, k, hidden = 33, 4, 40
    y, tw, inverse, offsets = _reduce_inputs(m, k, hidden, dtype)
    out = weighted_reduce(y, tw, inverse, offsets)
    assert out.dtype == dtype and out.shape == (m, hidden)
    end = offsets[-1].item()
    want = torch.zeros(m, hidden, dtype=torch.float32)
    for i in range(m):
        acc = None
        for j in range(k):
            r = inverse[i * k + j].item()
            term = y[r].float() * tw[i, j] if r < end else torch.zeros(hidden)
            acc = term if acc is None else acc + term
        want[i] = acc
    assert torch.equal(out, want.to(dtype))


def test_weighted_reduce_deterministic():
    y, tw, inverse, offsets = _reduce_inputs(301, 5, 96, torch.float32)
    a = weighted_reduce(y, tw, inverse, offsets)
    b = weighted_reduce(y.clone(), tw.clone(), inverse.clone(), offsets.clone())
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # and the whole layer
    x, w13, w2, tw, ids = random_layer(64, 64, 32, 4, 4)
    f1 = fused_experts(x, w13, w2, tw, ids)
    f2 = fused_experts(x, w13, w2, tw, ids)
    assert torch.equal(f1.view(torch.int32), f2.view(torch.int32))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_weighted_reduce_dropped_nan_does_not_leak(poison):
    y, tw, inverse, offsets = _reduce_inputs(40, 3, 16, torch.float32)
    end = offsets[-1].item()
    assert end < y.shape[0]
    clean = y.clone()
    clean[end:] = 0
    y[end:] = poison
    out = weighted_reduce(y, tw, inverse, offsets)
    assert torch.isfinite(out).all()
    assert torch.equal(out, weighted_reduce(clean, tw, inverse, offsets))


def _to_cuda(t):
    return t.cuda() if isinstance(t, torch.Tensor) else t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in QUANT_CASES if c != "unquantized"])
def test_quantized_reference_runs_without_host_sync_and_captures_in_a_cuda_graph(case):
    """Every quantized scheme runs on the CUDA reference (no CuTe DSL kernel serves them), and its call
    captures in a CUDA graph whose replay equals the eager output. The nvfp4/mxfp4 decoders built their
    e2m1 tables with torch.tensor(..., device=cuda), a synchronising host-to-device copy that a
    capture refuses."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.float32, m=64)
    config = dataclasses.replace(config, **{f.name: _to_cuda(getattr(config, f.name)) for f in dataclasses.fields(config)})
    x, q13, q2, tw, ids = (t.cuda() for t in (x, q13, q2, tw, ids))

    def call():  # the expert biases, if any, are in the config
        return fused_experts(x, q13, q2, tw, ids, quant_config=config)

    eager = call()  # eager calls check ids and values on the host; a capture skips those checks
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    # The CPU test's bound (test_scheme_vs_float64_unquantized_activations): the CUDA reference runs the
    # same float32 composition, with the activations quantized by the scheme's own scales.
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    if a_dtype == "int8" and scheme.activation.static:
        a_dtype = "int8_static"
    assert_close_rel(eager.cpu(), moe_float64(x.cpu(), d13, d2, tw.cpu(), ids.cpu(), **biases), tolerance(torch.float32, a_dtype), case)
