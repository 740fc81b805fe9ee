"""moe_ops.route against each model's own routing, recomputed here in float64 the way the model's code
(transformers, vLLM) writes it, on fresh random logits in float32/bf16/fp16 and in three layouts; exact
ties (lower expert id wins), infinite logits, the renormalize check, the fake impl on non-contiguous
inputs, and no host synchronisation in the op's body."""
from __future__ import annotations

import math

import pytest
import torch

from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops import routing
from moe_ops.routing import route_op

# Elementwise relative tolerance of float32 routing weights against float64, as in test_numerics.
ROUTE_RTOL = 1e-6


def _top(values, k, among=None):
    """Positions of the k largest of `values` (floats) among `among`, best first; an exact tie goes to
    the lower position (vLLM's routing kernels)."""
    among = range(len(values)) if among is None else among
    return sorted(among, key=lambda i: (-values[i], i))[:k]


def _softmax(row):
    top = max(row)
    ex = [math.exp(v - top) for v in row]
    return [v / sum(ex) for v in ex]


def _sigmoid(row):
    return [1.0 / (1.0 + math.exp(-v)) for v in row]


def _sqrt_softplus(row):
    return [math.sqrt(math.log1p(math.exp(v))) for v in row]


SCORES = {"softmax": _softmax, "sigmoid": _sigmoid, "sqrtsoftplus": _sqrt_softplus}


def _normalized(w):
    return [v / sum(w) for v in w]


def mixtral(row, k, bias, cfg):
    """Mixtral / Qwen3-MoE: softmax over all experts, top-k, divided by their sum if norm_topk_prob."""
    probs = _softmax(row)
    ids = _top(probs, k)
    w = [probs[e] for e in ids]
    return ids, _normalized(w) if cfg["norm"] else w


def gpt_oss(row, k, bias, cfg):
    """gpt-oss: top-k of the logits, then softmax over the selected logits."""
    ids = _top(row, k)
    return ids, _softmax([row[e] for e in ids])


def llama4(row, k, bias, cfg):
    """Llama4: top-k of the logits, then the sigmoid of each selected logit."""
    ids = _top(row, k)
    return ids, _sigmoid([row[e] for e in ids])


def _deepseek_selection(row, bias, cfg):
    """(scores, selection scores, group size, group scores) of DeepSeek-style routing (see deepseek)."""
    scores = SCORES[cfg["scoring"]](row)
    sel = [s + b for s, b in zip(scores, bias)] if bias is not None else scores
    size = len(row) // cfg["groups"]
    group_score = []
    for g in range(cfg["groups"]):
        best = sorted(sel[g * size : (g + 1) * size], reverse=True)
        group_score.append(sum(best[:2]) if bias is not None else best[0])
    return scores, sel, size, group_score


def deepseek(row, k, bias, cfg):
    """DeepSeek-V3 (scores = sigmoid, a correction bias), V2 (softmax, none) and V4 (sqrt(softplus), a
    correction bias, one group: DeepseekV4TopKRouter's plain top-k): selection = scores + bias;
    groups ranked by the sum of their two best selection scores with a bias, by their best one without;
    the k best experts of the topk_group best groups (the others masked with -inf, as in vLLM's and
    DeepSeek's inference code), weighted by their unbiased scores, renormalized if asked, times the
    routed scaling factor."""
    scores, sel, size, group_score = _deepseek_selection(row, bias, cfg)
    kept = _top(group_score, cfg["topk_group"])
    ids = _top(sel, k, [e for e in range(len(row)) if e // size in kept])
    w = [scores[e] for e in ids]
    w = _normalized(w) if cfg["norm"] else w
    return ids, [v * cfg["scale"] for v in w]


# model -> (E, k, route kwargs, float64 reference, its config, whether it has a correction bias)
MODELS = {
    "mixtral": (8, 2, dict(scoring="softmax", renormalize=True), mixtral, dict(norm=True), False),
    "qwen3_moe": (128, 8, dict(scoring="softmax", renormalize=True), mixtral, dict(norm=True), False),
    "qwen2_moe_no_norm": (60, 4, dict(scoring="softmax", renormalize=False), mixtral, dict(norm=False), False),
    "gpt_oss": (32, 4, dict(scoring="softmax", renormalize=True), gpt_oss, {}, False),
    "llama4": (16, 1, dict(scoring="sigmoid", renormalize=False), llama4, {}, False),
    "deepseek_v3": (
        256, 8,
        dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5),
        deepseek, dict(scoring="sigmoid", groups=8, topk_group=4, norm=True, scale=2.5), True,
    ),
    "deepseek_v2": (
        160, 6,
        dict(scoring="softmax", renormalize=False, num_expert_group=8, topk_group=3, routed_scaling_factor=16.0),
        deepseek, dict(scoring="softmax", groups=8, topk_group=3, norm=False, scale=16.0), False,
    ),
    "deepseek_v4": (
        256, 6,
        dict(scoring="sqrtsoftplus", renormalize=True, routed_scaling_factor=1.5),
        deepseek, dict(scoring="sqrtsoftplus", groups=1, topk_group=1, norm=True, scale=1.5), True,
    ),
    "kimi_k2": (
        384, 8,
        dict(scoring="sigmoid", renormalize=True, num_expert_group=1, topk_group=1, routed_scaling_factor=2.827),
        deepseek, dict(scoring="sigmoid", groups=1, topk_group=1, norm=True, scale=2.827), True,
    ),
}  # fmt: skip

# How the [M, E] logits are laid out in memory.
LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.T.contiguous().T,
    "strided": lambda t: torch.stack([t, torch.randn_like(t)], dim=2).flatten(1)[:, ::2],
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def grid_logits(m, num_experts, dtype):
    """Fresh random logits (std 2) on a grid of 1/64, then in `dtype` (exact in fp16, rounded in bf16):
    exact ties occur, as with bf16 router outputs, while distinct logits stay far apart at float32
    precision, so the float64 order is the float32 one and ids can be compared in order."""
    return ((torch.randn(m, num_experts) * 128).round() / 64).to(dtype)


def grid_bias(num_experts):
    """A correction bias on a grid of 1/256 (ties among the biased scores too)."""
    return (torch.randn(num_experts) * 25).round() / 256


# Deciding scores closer than this in float64 may come out equal, or in either order, in the op's float32
# arithmetic: a biased selection score (up to ~1.5) carries ~2 ulp (~2.4e-7) of float32 error, a group
# score (the sum of two) twice that.
FLOAT32_SCORE_GAP = 2e-6


def _near_float32_tie(row, k, bias, cfg):
    """Whether two scores that decide DeepSeek-style routing of `row` (the k+1 best selection scores of
    the kept groups, the topk_group+1 best group scores) differ in float64 by less than FLOAT32_SCORE_GAP
    without being equal. Exact ties stay: both sides break them by the lower id."""
    _, sel, size, group_score = _deepseek_selection(row, bias, cfg)
    kept = _top(group_score, cfg["topk_group"])
    deciding = [sorted((sel[e] for e in range(len(row)) if e // size in kept), reverse=True)[: k + 1]]
    if cfg["groups"] > 1:
        deciding.append(sorted(group_score, reverse=True)[: cfg["topk_group"] + 1])
    return any(0 < a - b < FLOAT32_SCORE_GAP for top in deciding for a, b in zip(top, top[1:]))


def bias_clear_of_near_ties(draw, logits, k, cfg):
    """A correction bias from `draw()` under which no row of `logits` has a near tie (_near_float32_tie),
    redrawn until so. Sigmoid plus a bias breaks the grid logits' premise: e.g. kimi_k2's experts 227 and
    365 scored 1.14521502 and 1.14521513 in float64 and the same float32 value, so the op rightly chose
    the lower id where float64 chose the other (seed 9189513131603277655). About 1 draw in 10 is redrawn."""
    rows = logits.double().tolist()
    for _ in range(100):
        bias = draw()
        bias64 = bias.double().tolist()
        if not any(_near_float32_tie(row, k, bias64, cfg) for row in rows):
            return bias
    raise AssertionError("100 bias draws in a row left near ties: the tie gap is too wide for these logits")


def _assert_routes_as(weights, ids, logits, top_k, bias, reference, cfg):
    """ids in order and weights to ROUTE_RTOL against the float64 `reference`, row by row."""
    bias64 = None if bias is None else bias.double().tolist()
    for r, row in enumerate(logits.double().tolist()):
        want_ids, want_w = reference(row, top_k, bias64, cfg)
        assert ids[r].tolist() == want_ids, f"row {r}: ids {ids[r].tolist()}, the model's (lower id wins ties) {want_ids}"
        for j, w in enumerate(want_w):
            assert abs(weights[r, j].item() - w) <= ROUTE_RTOL * abs(w), f"row {r}, expert {want_ids[j]}: {weights[r, j].item()} != {w}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", list(MODELS))
def test_route_matches_model_routing_float64(model, dtype, layout):
    num_experts, top_k, kwargs, reference, cfg, has_bias = MODELS[model]
    m = 96
    logits = grid_logits(m, num_experts, DTYPES[dtype])
    # every third row ties at the k-th place for sure: its (k+1)-th best expert gets the k-th best logit
    order = logits.float().argsort(dim=1, descending=True)
    rows = torch.arange(0, m, 3)
    logits[rows, order[rows, top_k]] = logits[rows, order[rows, top_k - 1]]
    bias = bias_clear_of_near_ties(lambda: grid_bias(num_experts), logits, top_k, cfg) if has_bias else None
    logits = LAYOUTS[layout](logits)
    weights, ids = moe_ops.route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (m, top_k) and weights.is_contiguous() and ids.is_contiguous()
    _assert_routes_as(weights, ids, logits, top_k, bias, reference, cfg)


def _tied_logits(m, num_experts):
    """Fresh random logits drawn from 5 values (never all zero): most rows tie at the k-th place."""
    return torch.randint(-2, 3, (m, num_experts)).float() * 0.75 + 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scoring="softmax"),
        dict(scoring="sigmoid", renormalize=False),
        dict(scoring="sigmoid", num_expert_group=8, topk_group=2, bias=True),
        dict(scoring="softmax", num_expert_group=8, topk_group=3),
        dict(scoring="sqrtsoftplus", bias=True),
    ],
    ids=["softmax", "sigmoid", "grouped_bias", "grouped", "sqrtsoftplus_bias"],
)
def test_exact_ties_go_to_the_lower_expert_id(kwargs):
    """Equal scores: the lower expert id is chosen (and comes first), for experts and for groups, whatever
    the row's neighbours; torch.topk picked e.g. experts [6, 5] of 8 equal logits."""
    kwargs = dict(kwargs)
    num_experts, top_k = 64, 6
    bias = torch.full((num_experts,), 0.25) if kwargs.pop("bias", False) else None  # ties survive the bias
    logits = _tied_logits(48, num_experts)
    weights, ids = moe_ops.route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    groups, topk_group = kwargs.get("num_expert_group"), kwargs.get("topk_group")
    for r, row in enumerate(logits.double().tolist()):
        sel = SCORES[kwargs["scoring"]](row)
        sel = [v + 0.25 for v in sel] if bias is not None else sel
        candidates = range(num_experts)
        if groups:
            size = num_experts // groups
            best = [sorted(sel[g * size : (g + 1) * size], reverse=True) for g in range(groups)]
            kept = _top([sum(b[:2]) if bias is not None else b[0] for b in best], topk_group)
            candidates = [e for e in candidates if e // size in kept]
        assert ids[r].tolist() == _top(sel, top_k, candidates), f"row {r}: {row}"
    # the same rows routed one at a time agree (no dependence on the batch)
    for r in range(0, 48, 7):
        alone = moe_ops.route(logits[r : r + 1], top_k, e_score_correction_bias=bias, **kwargs)[1]
        assert torch.equal(alone, ids[r : r + 1])


def test_equal_logits_pick_the_first_experts():
    """A row of equal (non-zero) logits routes to experts 0..k-1 with equal weights."""
    logits = torch.full((3, 8), float(torch.randn(()).item()))
    for k in (1, 2, 4, 8):
        weights, ids = moe_ops.route(logits, k)
        assert ids.tolist() == [list(range(k))] * 3
        assert torch.allclose(weights, torch.full((3, k), 1 / k), rtol=ROUTE_RTOL, atol=0)


def test_k_equals_num_experts():
    logits = torch.randn(17, 12)
    for kwargs in (dict(), dict(renormalize=False), dict(scoring="sigmoid", num_expert_group=4, topk_group=4)):
        weights, ids = moe_ops.route(logits, 12, **kwargs)
        assert (ids.sort(dim=1).values == torch.arange(12, dtype=torch.int32)).all()
    weights, ids = moe_ops.route(logits, 12)
    probs = torch.softmax(logits.double(), dim=-1)
    assert torch.allclose(weights.double(), probs.gather(1, ids.long()), rtol=ROUTE_RTOL, atol=0)


def test_infinite_logits():
    """sigmoid takes its limits at +-inf; softmax of a row with +inf (or only -inf) is undefined: its
    weights are NaN and its ids still distinct experts in [0, E)."""
    num_experts, top_k = 8, 3
    logits = torch.randn(4, num_experts)
    logits[0, 5] = float("inf")
    logits[1, :6] = float("-inf")  # only experts 6 and 7 are finite
    logits[2] = float("-inf")
    logits[3, 2] = float("-inf")
    w, ids = moe_ops.route(logits, top_k, scoring="sigmoid", renormalize=False)
    assert ids[0, 0] == 5 and w[0, 0] == 1.0
    assert ids[1].tolist()[:2] == sorted([6, 7], key=lambda e: -logits[1, e])  # the finite ones, best first
    assert ids[1, 2] == 0 and w[1, 2] == 0.0  # the best of the -inf experts: the lowest id, weight 0
    assert ids[2].tolist() == [0, 1, 2] and (w[2] == 0).all()
    assert 2 not in ids[3].tolist()
    w, ids = moe_ops.route(logits, top_k, scoring="softmax", renormalize=True)
    assert w[0].isnan().all() and w[2].isnan().all()
    assert set(ids[1].tolist()[:2]) == {6, 7} and w[1, 2] == 0.0 and torch.isclose(w[1].sum(), torch.tensor(1.0))
    assert not w[3].isnan().any() and 2 not in ids[3].tolist()
    assert ((ids >= 0) & (ids < num_experts)).all() and all(len(set(r)) == top_k for r in ids.tolist())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_saturated_sigmoid_scores_rank_by_logit(dtype):
    """float32 sigmoid is exactly 1.0 above a logit of ~16.6 (bf16 logits from 13.44 share one score):
    distinct logits must still rank by size, as Llama4 takes the top-k of the logits. Ranking the
    rounded scores gave expert 0 for [18, 25, 0, 0] (a tie at 1.0, lower id first)."""
    dtype = DTYPES[dtype]
    logits = torch.tensor([[18.0, 25.0, 0.0, 0.0], [13.4375, 13.5, 1.0, 2.0]]).to(dtype)
    weights, ids = moe_ops.route(logits, 1, scoring="sigmoid", renormalize=False)
    assert ids[:, 0].tolist() == [1, 1]
    big = (torch.randn(64, 16) * 12).to(dtype)  # most rows hold several logits with sigmoid 1.0
    weights, ids = moe_ops.route(big, 2, scoring="sigmoid", renormalize=False)
    for row, got, w in zip(big.double().tolist(), ids.tolist(), weights.double()):
        want, want_w = llama4(row, 2, None, {})
        assert got == want and torch.allclose(w, torch.tensor(want_w, dtype=torch.float64), rtol=ROUTE_RTOL, atol=0)


def test_a_nan_correction_bias_makes_every_weight_nan():
    """A NaN in the correction bias leaves the selection of every row undefined: every weight is NaN,
    as for a row with a NaN logit (before, the rows came back with finite weights of arbitrary experts)."""
    bias = torch.randn(6)
    bias[5] = float("nan")
    weights, ids = moe_ops.route(torch.randn(4, 6), 3, scoring="sigmoid", num_expert_group=2, topk_group=1,
                                 e_score_correction_bias=bias)  # fmt: skip
    assert weights.isnan().all() and ((ids >= 0) & (ids < 6)).all()


def test_groups_of_one_expert_with_a_correction_bias():
    """num_expert_group == E with a bias (DeepSeek-V3 scoring, groups of one expert): a group's score is
    the sum of its best two selection scores, here its only one (taking the top 2 of a group of one
    would raise a RuntimeError in torch.topk)."""
    num_experts, top_k = 16, 3
    logits = torch.randn(40, num_experts) * 2
    cfg = dict(scoring="sigmoid", groups=num_experts, topk_group=4, norm=True, scale=2.5)
    bias = bias_clear_of_near_ties(lambda: torch.randn(num_experts) * 0.1, logits, top_k, cfg)
    weights, ids = moe_ops.route(logits, top_k, scoring="sigmoid", renormalize=True, num_expert_group=num_experts,
                                 topk_group=4, e_score_correction_bias=bias, routed_scaling_factor=2.5)  # fmt: skip
    _assert_routes_as(weights, ids, logits, top_k, bias, deepseek, cfg)


def test_correction_bias_keeps_float32_with_bf16_logits():
    """A float32 correction bias is added in float32 to the scores of bf16 logits, as DeepSeek-V3 keeps
    its bias in float32: rounding it to the logits' dtype (~3 significant digits) changes which experts
    are chosen in some rows. DeepSeek-V3's routing in float64 with the exact bias."""
    num_experts, top_k, kwargs, reference, cfg, _ = MODELS["deepseek_v3"]
    logits = (torch.randn(256, num_experts) * 2).bfloat16()
    bias = bias_clear_of_near_ties(lambda: torch.randn(num_experts) * 0.5, logits, top_k, cfg)  # not on the bf16 grid
    rounded = bias.bfloat16().double().tolist()
    rows = logits.double().tolist()
    changed = sum(reference(r, top_k, bias.double().tolist(), cfg)[0] != reference(r, top_k, rounded, cfg)[0] for r in rows)
    assert changed > 0, "rounding the bias to bf16 changes no row: the test would not test the bias' precision"
    weights, ids = moe_ops.route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    _assert_routes_as(weights, ids, logits, top_k, bias, reference, cfg)


@pytest.mark.parametrize("factor", [0.25, 0.8, -1.5, 1.0])
def test_routed_scaling_factor_multiplies_the_weights(factor):
    """Every weight is multiplied by routed_scaling_factor, whatever its size or sign (a factor below 1
    scales down; 1.0 leaves the weights as they are): Mixtral's float64 weights times the factor."""
    num_experts, top_k = 16, 3
    logits = grid_logits(24, num_experts, torch.float32)
    weights, ids = moe_ops.route(logits, top_k, routed_scaling_factor=factor)
    for r, row in enumerate(logits.double().tolist()):
        want_ids, want_w = mixtral(row, top_k, None, dict(norm=True))
        assert ids[r].tolist() == want_ids
        for j, w in enumerate(want_w):
            assert abs(weights[r, j].item() - factor * w) <= ROUTE_RTOL * abs(factor * w), (r, j, factor)


def test_renormalized_zero_sigmoid_scores_are_nan():
    """Renormalizing k sigmoid scores that are all exactly 0 (logits of -inf, or below about -104 in
    float32) divides 0 by 0: the weights are NaN, as the module docstring states and vLLM's grouped_topk
    gives, not a silent 0 from a guarded division. Rows with a positive score keep finite weights
    summing to 1."""
    logits = torch.randn(4, 8)
    logits[1] = float("-inf")
    logits[3] = -200.0
    logits[3, 5] = -1.0  # one expert with a positive score: a defined row
    weights, ids = moe_ops.route(logits, 2, scoring="sigmoid", renormalize=True)
    assert weights[1].isnan().all() and ids[1].tolist() == [0, 1]
    assert weights[[0, 2, 3]].isfinite().all()
    assert torch.allclose(weights[[0, 2, 3]].sum(dim=1), torch.ones(3), rtol=ROUTE_RTOL, atol=0)
    assert weights[3].tolist() == [1.0, 0.0] and ids[3, 0] == 5

@pytest.mark.parametrize("value", [None, 1, "yes"], ids=["None", "int", "str"])
def test_renormalize_must_be_a_bool(value):
    """None silently meant renormalize=False, and a str reached the op's schema check (RuntimeError)."""
    with pytest.raises(TypeError, match=rf"renormalize: expected a bool, got {type(value).__name__} {value!r}"):
        moe_ops.route(torch.randn(3, 8), 2, renormalize=value)


# The op itself (what a compiled graph calls) checks its arguments in the real and the fake impl alike.
# Before, only the `route` wrapper checked: the op returned [M, E] ids for top_k > E while its fake impl
# said [M, top_k] (torch.compile then failed with "incorrect fake kernel"), took top_k = -1, and raised
# KeyError / RuntimeError for an unknown scoring, a group count not dividing E or a short bias.
_OP = torch.ops.moe_ops.route.default
_GOOD = (4, 2, "softmax", True, 0, 0, None, 1.0)  # E, top_k, scoring, renormalize, groups, kept, bias, scale
BAD_OP_ARGS = {
    "top_k_above_E": (dict(top_k=5), ValueError, r"top_k: got 5; allowed: an int in \[1, E=4\]"),
    "top_k_negative": (dict(top_k=-1), ValueError, r"top_k: got -1"),
    "unknown_scoring": (dict(scoring="tanh"), ValueError, r"scoring: got 'tanh'; allowed: 'softmax', 'sigmoid'"),
    "groups_not_dividing": (dict(groups=3, kept=1), ValueError, r"num_expert_group: got 3; allowed: a divisor of E=4"),
    "kept_without_groups": (dict(kept=1), ValueError, r"topk_group: got 1 without grouping"),
    "short_bias": (dict(bias=torch.zeros(3)), ValueError, r"e_score_correction_bias: expected shape \(4,\) \(\[E\]\), got \(3,\)"),
    "nan_scale": (dict(scale=float("nan")), ValueError, r"routed_scaling_factor: got nan; allowed: a finite number"),
    "inf_scale": (dict(scale=float("inf")), ValueError, r"routed_scaling_factor: got inf; allowed: a finite number"),
}


def _op_args(**changes) -> list:
    names = ("num_experts", "top_k", "scoring", "renormalize", "groups", "kept", "bias", "scale")
    spec = {**dict(zip(names, _GOOD)), **changes}
    return [torch.randn(3, spec.pop("num_experts")), *spec.values()]


@pytest.mark.parametrize("case", list(BAD_OP_ARGS))
@pytest.mark.parametrize("where", ["real", "fake"])
def test_route_op_rejects_bad_args(case, where):
    changes, exc, match = BAD_OP_ARGS[case]
    args = _op_args(**changes)
    with pytest.raises(exc, match=match):
        if where == "real":
            _OP(*args)
        else:
            with FakeTensorMode() as mode:
                _OP(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


@pytest.mark.parametrize("scale", [float("nan"), float("-inf")])
def test_route_rejects_a_non_finite_scaling_factor(scale):
    with pytest.raises(ValueError, match=r"routed_scaling_factor: got (nan|-inf); allowed: a finite number"):
        moe_ops.route(torch.randn(2, 4), 2, routed_scaling_factor=scale)


BAD_ROUTE_ARGS = {
    # True is an int and a Real to Python: without its own check it would pass as a factor of 1.0
    "scale_bool": (dict(routed_scaling_factor=True), TypeError, r"routed_scaling_factor: expected a real number, got bool True"),
    # -2 divides E=8: without the sign check the error would name topk_group ("allowed: 1 to num_expert_group=-2")
    "groups_negative": (dict(num_expert_group=-2, topk_group=1), ValueError, r"num_expert_group: got -2; allowed: a divisor of E=8"),
    # 0.0 and False equal 0: checked after the 0 test, they would be rejected as the value 0 (a ValueError)
    "groups_float_zero": (dict(num_expert_group=0.0, topk_group=1), TypeError, r"num_expert_group: got float 0.0; allowed: an int or None"),
    "groups_false": (dict(num_expert_group=False, topk_group=False), TypeError, r"num_expert_group: got bool False; allowed: an int or None"),
}


@pytest.mark.parametrize("case", list(BAD_ROUTE_ARGS))
def test_route_rejects_bad_group_and_scale_args(case):
    kwargs, exc, match = BAD_ROUTE_ARGS[case]
    with pytest.raises(exc, match=match):
        moe_ops.route(torch.randn(3, 8), 2, **kwargs)


def test_route_op_accepts_the_base_args():
    # Positive control for test_route_op_rejects_bad_args.
    torch.library.opcheck(_OP, tuple(_op_args()))


@pytest.mark.parametrize("m", [0, 1, 6])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "spec",
    [("softmax", True, 0, 0, False, 1.0), ("sigmoid", True, 4, 2, True, 2.5), ("sigmoid", False, 2, 2, True, 1.0)],
    ids=["softmax", "grouped_bias", "all_groups"],
)
def test_opcheck_non_contiguous(spec, layout, m):
    """opcheck, and the fake impl against the real outputs (shape, dtype, strides), on non-contiguous
    logits and bias; M = 0 and 1 included (a [1, k] slice of an [1, E] tensor counts as contiguous)."""
    scoring, renormalize, groups, topk_group, with_bias, scale = spec
    logits = LAYOUTS[layout](torch.randn(m, 8).bfloat16())
    bias = torch.randn(16)[::2] if with_bias else None
    args = (logits, 3, scoring, renormalize, groups, topk_group, bias, scale)
    torch.library.opcheck(route_op, args)
    real = route_op(*args)
    with FakeTensorMode() as mode:
        fake = route_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


@pytest.mark.parametrize(
    "spec",
    [("softmax", False, 0, 0, False, 1.0), ("sigmoid", True, 4, 2, True, 2.5), ("softmax", True, 4, 2, False, 1.0)],
    ids=["softmax", "grouped_bias", "grouped"],
)
def test_no_host_synchronisation(spec):
    """The op's body runs on meta tensors, which hold no values: .item(), .tolist(), .cpu(), nonzero,
    unique or bincount there would raise."""
    scoring, renormalize, groups, topk_group, with_bias, scale = spec
    logits = torch.randn(5, 16).bfloat16().to("meta")
    bias = torch.randn(16, device="meta") if with_bias else None
    weights, ids = routing._route(logits, 4, scoring, renormalize, groups, topk_group, bias, scale)
    assert weights.device.type == ids.device.type == "meta"
    assert weights.shape == ids.shape == (5, 4) and weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_cuda_routing_picks_the_cpus_experts(model):
    """On CUDA the same ids as on the CPU, in the same order, ties included (torch.topk orders ties
    differently on the two), for bf16 logits with many exact ties; the weights agree to float32 rounding."""
    num_experts, top_k, kwargs, *_, has_bias = MODELS[model]
    logits = grid_logits(4096, num_experts, torch.bfloat16)
    bias = grid_bias(num_experts) if has_bias else None
    w_cpu, ids_cpu = moe_ops.route(logits, top_k, e_score_correction_bias=bias, **kwargs)
    w_gpu, ids_gpu = moe_ops.route(
        logits.cuda(), top_k, e_score_correction_bias=None if bias is None else bias.cuda(), **kwargs
    )
    tied = (logits.float().sort(dim=1, descending=True).values[:, top_k - 1 : top_k + 1].diff(dim=1) == 0).sum()
    assert tied > 0, "the draw has no tie at the k-th place: the test would not test ties"
    assert torch.equal(ids_gpu.cpu(), ids_cpu)
    torch.testing.assert_close(w_gpu.cpu(), w_cpu, rtol=2e-6, atol=1e-9)
