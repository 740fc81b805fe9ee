"""The routing kernel (moe_ops/route_kernel.py) against the reference routing (routing._route): the ids
exactly, the weights to float32 rounding (NaN where the reference has NaN).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when triton.jit decorates, so
in a fresh subprocess); on the GPU it runs compiled, through the op's CUDA registration.
"""
from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

from moe_ops.routing import _route, route_op
from tests.ptx import compile_triton, split_at_wait, touches_global
from tests.triton_interpreter import needs_interpreter, run_interpreted

RTOL = 2e-6  # the scores' exp and the sums in another order than torch's

# (name, M, E, top_k, logits dtype, scoring, renormalize, bias, scale, how the logits are drawn,
#  (num_expert_group, topk_group): (0, 0) for no groups)
CASES = [
    ("softmax", 37, 128, 8, "float32", "softmax", True, False, 1.0, "randn", (0, 0)),
    ("softmax_bf16_ties", 50, 64, 6, "bfloat16", "softmax", True, False, 1.0, "ties", (0, 0)),
    ("softmax_fp16_not_renormalized", 9, 60, 4, "float16", "softmax", False, False, 1.0, "randn", (0, 0)),
    ("sigmoid_bias_scaled", 33, 256, 8, "float32", "sigmoid", True, True, 2.5, "randn", (0, 0)),
    ("sigmoid_not_renormalized", 20, 16, 1, "bfloat16", "sigmoid", False, False, 1.0, "ties", (0, 0)),
    ("specials", 24, 16, 5, "float32", "sigmoid", False, False, 1.0, "specials", (0, 0)),
    ("specials_softmax", 24, 16, 5, "float32", "softmax", True, False, 1.0, "specials", (0, 0)),
    ("nan_bias", 6, 32, 4, "float32", "sigmoid", True, "nan", 1.0, "randn", (0, 0)),
    ("all_experts", 5, 7, 7, "float32", "softmax", True, False, 1.0, "randn", (0, 0)),
    ("one_expert", 3, 1, 1, "float32", "sigmoid", False, False, 1.0, "randn", (0, 0)),
    ("many_experts", 4, 1000, 8, "bfloat16", "softmax", True, False, 1.0, "randn", (0, 0)),
    ("strided", 40, 32, 4, "float32", "softmax", True, False, 1.0, "strided", (0, 0)),
    ("no_tokens", 0, 32, 4, "float32", "softmax", True, False, 1.0, "randn", (0, 0)),
    # Grouped top-k: DeepSeek-V3's (sum of each group's two best biased scores) and V2's (best logit).
    ("v3_grouped", 33, 256, 8, "float32", "sigmoid", True, True, 2.5, "randn", (8, 4)),
    ("v3_grouped_bf16_ties", 64, 64, 6, "bfloat16", "sigmoid", True, "per_group", 1.0, "ties_positive", (16, 2)),
    ("v2_grouped_uneven_groups", 256, 160, 6, "bfloat16", "softmax", False, False, 16.0, "ties", (8, 3)),
    ("v2_grouped_three_groups", 17, 24, 4, "float32", "softmax", True, False, 1.0, "randn", (3, 2)),
    ("grouped_groups_of_one", 12, 8, 3, "float32", "sigmoid", True, True, 1.0, "randn", (8, 3)),
    ("grouped_one_group", 9, 32, 4, "float32", "sigmoid", True, True, 1.0, "randn", (1, 1)),
    ("grouped_specials", 24, 16, 5, "float32", "sigmoid", False, True, 1.0, "specials", (4, 2)),
    ("grouped_specials_softmax", 24, 16, 5, "float32", "softmax", True, True, 1.0, "specials", (4, 2)),
    ("grouped_specials_no_bias", 24, 16, 5, "float32", "softmax", True, False, 1.0, "specials", (4, 2)),
    ("grouped_strided", 30, 64, 8, "float32", "sigmoid", True, True, 1.0, "strided", (8, 4)),
    ("grouped_infinite_bias", 8, 16, 5, "float32", "sigmoid", True, "infinite", 1.0, "randn", (4, 2)),
    # DeepSeek-V4's sqrt(softplus) scores with a correction bias; on wide logits (softplus' x-above-20
    # branch, and renormalized rows whose k scores are all tiny, where log1p must keep them exact); its
    # specials; bf16 ties.
    ("sqrtsoftplus_bias_scaled", 33, 256, 6, "float32", "sqrtsoftplus", True, True, 1.5, "randn", (0, 0)),
    ("sqrtsoftplus_wide", 40, 16, 4, "float32", "sqrtsoftplus", True, False, 1.0, "wide", (0, 0)),
    ("sqrtsoftplus_specials", 24, 16, 5, "float32", "sqrtsoftplus", True, True, 1.0, "specials", (0, 0)),
    ("sqrtsoftplus_bf16_ties", 50, 64, 6, "bfloat16", "sqrtsoftplus", False, False, 1.0, "ties", (0, 0)),
]


def draw_logits(m: int, e: int, dtype: torch.dtype, how: str, device="cpu") -> torch.Tensor:
    """[M, E] router logits: normal draws; few distinct values (exact ties), or few non-negative ones;
    NaN, +-inf, -0.0 and +0.0 in some rows; or a transposed (non-contiguous) view."""
    if how in ("ties", "ties_positive"):
        low = 0 if how == "ties_positive" else -3
        return (torch.randint(low, 4, (m, e), device=device) * 0.5).to(dtype)
    if how == "strided":
        return torch.randn(e, m, device=device).to(dtype).t()
    if how == "wide":
        # Even rows from -75 to 75; odd rows from -80 to -10, where every score is tiny (exp(x) stays a
        # normal float32: the GPU's exp flushes subnormals to zero, the CPU's keeps them).
        x = torch.rand(m, e, device=device) * 150 - 75
        x[1::2] = torch.rand(m // 2, e, device=device) * 70 - 80
        return x.to(dtype)
    x = torch.randn(m, e, device=device)
    if how == "specials":
        x[1, 3] = float("nan")
        x[2, :] = float("-inf")
        x[3, 2] = float("inf")
        x[4, 5] = float("inf")
        x[4, 6] = torch.finfo(torch.float32).max  # ties +inf, as nan_to_num makes it
        x[5, :8] = float("-inf")
        x[6, :] = 0.0
        x[6, ::2] = -0.0  # ties +0.0: the lower id first
        x[7, 0] = float("nan")
        x[7, 1:] = float("-inf")  # NaN ranks below -inf
        x[8, 0] = float("nan")
        x[8, 1:3] = 5.0  # the best group (of 4) holds a NaN: it still scores its other experts
    return x.to(dtype)


def case_args(case, device="cpu"):
    _, m, e, k, dtype, scoring, renormalize, bias, scale, how, (groups, topk_group) = case
    logits = draw_logits(m, e, getattr(torch, dtype), how, device)
    b = None
    if bias == "per_group":
        # One value per group, 0 or 0.25: with logits of 0, 0.5, 1 or 1.5 the groups' scores tie exactly
        # (a group's two best experts) or differ by far more than rounding. A bias that varies inside a
        # group ties in the reals only: sigmoid(a) + b1 + sigmoid(c) + b2 against the same with b1 and b2
        # swapped, where float32 rounding (torch's own differs between CPU and GPU) picks the group.
        b = (torch.randint(0, 2, (groups,), device=device) * 0.25).repeat_interleave(e // groups)
    elif bias == "infinite":
        # Group 0's two best are +inf and -inf: after nan_to_num they sum to 0, which beats the other
        # groups' (about -9); summed as they are they would give NaN, ranked last.
        b = torch.full((e,), -5.0, device=device)
        b[0], b[1:4] = float("inf"), float("-inf")
    elif bias:
        b = torch.randn(e, device=device) * 0.1
        if bias == "nan":
            b[3] = float("nan")
    return logits, k, scoring, renormalize, groups, topk_group, b, scale


def assert_same_routing(got, want):
    (w, ids), (rw, rids) = got, want
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.is_contiguous() and ids.is_contiguous()
    assert w.shape == rw.shape and ids.shape == rids.shape
    assert torch.equal(ids, rids), (ids.tolist(), rids.tolist())
    torch.testing.assert_close(w, rw, rtol=RTOL, atol=0, equal_nan=True)


def assert_weights_match_float64(args, got) -> None:
    """The kernel's weights against the routing formula in float64 at the kernel's own ids (the rows
    whose weights are defined: NaN rows are compared with the reference in assert_same_routing)."""
    logits, k, scoring, renormalize, _, _, bias, scale = args
    weights, ids = got
    x = logits.double()
    scores = {
        "softmax": lambda: torch.softmax(x, dim=-1),
        "sigmoid": lambda: torch.sigmoid(x),
        # softplus in float64 without its threshold: log1p(exp(x)) is exact enough at any x here
        "sqrtsoftplus": lambda: torch.log1p(torch.exp(x)).sqrt(),
    }[scoring]()
    want = scores.gather(1, ids.long())
    if renormalize:
        want = want / want.sum(dim=-1, keepdim=True)
    want = want * scale
    rows = weights.isfinite().all(dim=-1) & want.isfinite().all(dim=-1)
    if logits.shape[0] and not (bias is not None and bias.isnan().any()):
        assert rows.any(), "no defined row to compare"
    torch.testing.assert_close(weights[rows].double(), want[rows], rtol=1e-5, atol=1e-12)


_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from moe_ops.routing import _route
    from moe_ops.route_kernel import route_triton
    from tests.moe_ops.test_route_kernel import CASES, assert_same_routing, assert_weights_match_float64, case_args
    torch.manual_seed(int(sys.argv[1]))
    for case in CASES:
        args = case_args(case)
        got = route_triton(*args)
        assert_same_routing(got, _route(*args))
        assert_weights_match_float64(args, got)
    print("same", len(CASES))
    """
)


@needs_interpreter
def test_route_kernel_matches_reference_in_interpreter(rng):
    out = run_interpreted(_SCRIPT, rng.initial_seed(), timeout=600)
    assert out.startswith("same"), out


def test_every_scoring_has_a_kernel_score():
    from moe_ops.route_kernel import SCORES
    from moe_ops.routing import SCORING

    assert set(SCORES) == set(SCORING) and len(set(SCORES.values())) == len(SCORES)


def test_specials_reach_every_edge():
    """The specials draw holds what the kernel's key order must get right: a reference check that a
    mutation of _order_key (NaN as -inf, +inf above the largest float) would fail."""
    logits, k, *rest = case_args(CASES[5])
    _, ids = _route(logits, k, *rest)
    assert ids[7].tolist() == [1, 2, 3, 4, 5]  # NaN ranks below -inf: not the lowest id's tie
    assert ids[4, 0] == 5 and ids[4, 1] == 6  # +inf ties the largest float: the lower id first
    assert ids[6].tolist() == [0, 1, 2, 3, 4]  # -0.0 ties +0.0


def test_kernel_serves_up_to_1024_positions():
    """The kernel takes E up to 1024 positions: groups and group size each rounded up to a power of two."""
    from moe_ops.route_kernel import why_not

    for e, groups in ((1, 0), (1000, 0), (1024, 0), (256, 8), (160, 8), (768, 3)):  # DeepSeek-V3, V2: 8 x 32
        assert why_not(e, groups) is None, (e, groups)
    assert why_not(1025, 0) == "1025 experts: the route kernel holds at most 1024 positions in registers"
    assert why_not(999, 3) == "999 experts in 3 groups (4 x 512 positions): the route kernel holds at most 1024 positions in registers"
    assert why_not(2048, 8) is not None


def test_route_past_the_kernel_warns_once_and_runs_the_reference(monkeypatch):
    """Where the kernel cannot serve, the op's CUDA impl runs the reference ops and says so once per
    reason (here called with CPU tensors, which the reference takes alike)."""
    from moe_ops import routing

    monkeypatch.setattr(routing, "_WARNED", set())
    args = (torch.randn(5, 2048), 8, "sigmoid", True, 8, 4, torch.randn(2048) * 0.1, 2.5)
    with pytest.warns(UserWarning, match=r"moe_ops::route runs the reference ops on cpu: 2048 experts in 8 groups"):
        got = routing._route_cuda(*args)
    assert_same_routing(got, _route(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routing._route_cuda(*args)


def _compile_without_gpu(capability: int, top_k: int = 8, grid_dependency: bool = True, scoring: str = "sigmoid"):
    """Triton's compile of the route kernel for sm_<capability> (through its own ptxas) as route_triton
    launches DeepSeek-V3's routing: sigmoid (or `scoring`) + bias, 8 groups of 32 keeping 4, scaled."""
    import triton

    from moe_ops import plan_kernel, route_kernel

    signature = {p: "*fp32" for p in ("logits_ptr", "bias_ptr", "weights_ptr")} | {"ids_ptr": "*i32"}
    signature |= {s: "i32" for s in ("m", "num_groups", "group_size", "stride_m", "stride_e")} | {"scale": "fp32"}
    constants = dict(
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), SCORE=route_kernel.SCORES[scoring], HAS_BIAS=True,
        RENORMALIZE=True, SCALED=True,
        BLOCK_M=16, G_P2=8, S_P2=32, TOPK_GROUP=4, TOP2=True, PDL=grid_dependency,
    )  # fmt: skip
    return compile_triton(route_kernel._route_kernel, signature, constants, capability, plan_kernel.compile_options(grid_dependency))


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_cuda_route_waits_for_the_kernel_before_it(scoring):
    """Launched as a programmatic dependent (launch_pdl) of the router's matmul, the kernel must not
    read the logits (or touch any global memory) before griddepcontrol.wait; it lets the plan launch
    before that wait."""
    compiled = _compile_without_gpu(90, scoring=scoring)
    assert compiled.metadata.launch_pdl
    before, after = split_at_wait(compiled.asm["ptx"])
    assert "griddepcontrol.launch_dependents" in before
    assert not touches_global(before), "a global access before griddepcontrol.wait"
    assert touches_global(after)


def test_cuda_route_builds_for_sm80_without_grid_dependency():
    """What an sm_80 GPU runs (plan_kernel.uses_grid_dependency False): ptxas for sm_80 and no
    griddepcontrol instruction."""
    compiled = _compile_without_gpu(80, grid_dependency=False)
    assert compiled.asm["cubin"]
    assert "griddepcontrol" not in compiled.asm["ptx"]


def test_cuda_route_code_does_not_grow_with_top_k():
    """The top-k passes are a loop, not unrolled: unrolled, k = 64 took minutes to compile."""
    small, large = (len(_compile_without_gpu(90, top_k=k).asm["ptx"]) for k in (8, 64))
    assert large < 1.2 * small, (small, large)


def _case(name):
    return next(c for c in CASES if c[0] == name)


def test_grouped_cases_reach_their_edges():
    """The grouped draws hold what the kernel's group stage must get right, checked on the reference:
    the kept groups change the picks, group scores tie at the topk_group-th place (the lower group
    wins), and a group's two best scores are often equal (the sum counts both)."""
    for name in ("v3_grouped", "v2_grouped_uneven_groups", "v3_grouped_bf16_ties"):
        logits, k, scoring, renormalize, groups, topk_group, bias, scale = case_args(_case(name))
        _, grouped = _route(logits, k, scoring, renormalize, groups, topk_group, bias, scale)
        _, flat = _route(logits, k, scoring, renormalize, 0, 0, bias, scale)
        assert (grouped != flat).any(dim=1).any(), f"{name}: the groups never change the picks"
    logits, k, scoring, renormalize, groups, topk_group, bias, scale = case_args(_case("v3_grouped_bf16_ties"))
    selection = (torch.sigmoid(logits.float()) + bias).view(len(logits), groups, -1)
    best2 = selection.topk(2, dim=-1).values
    assert (best2[..., 0] == best2[..., 1]).any(), "no group's two best scores are equal"
    ranked = best2.sum(dim=-1).sort(dim=1, descending=True).values
    assert (ranked[:, topk_group - 1] == ranked[:, topk_group]).any(), "no group scores tie at the last kept place"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_route_op_on_cuda_matches_reference(case, rng):
    """The op's CUDA registration (the kernel, compiled) against the reference ops on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = case_args(case, "cuda")
    assert_same_routing(route_op(*args), _route(*args))
    if case[9] != "specials" and case[7] != "nan":  # opcheck compares runs without equal_nan
        torch.library.opcheck(route_op, args)


@pytest.mark.gpu
def test_route_op_on_cuda_past_the_kernel_runs_the_reference():
    """Sizes past the kernel's positions (why_not) run the reference ops on CUDA, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits = torch.randn(16, 2048, device="cuda")
    args = (logits, 8, "sigmoid", True, 8, 4, torch.randn(2048, device="cuda") * 0.1, 2.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-reason warning, tested on the CPU
        got = route_op(*args)
    want = _route(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
