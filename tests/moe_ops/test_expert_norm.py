"""moe_ops::post_expert_norm and PostExpertNorm (MuseSpark's input-scaled RMS norm of each expert's
output row): values against a float64 re-computation written here on fresh random inputs, opcheck and
the fake impl, bad arguments, and fused_experts with the norm against moe_float64, eager and compiled
(where the lowering fuses the norm into down_reduce)."""
from __future__ import annotations

import pytest
import torch

import lowering
from moe_ops import PostExpertNorm, fused_experts
from moe_ops.expert_norm import post_expert_norm
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..host_reads import no_host_reads
from .test_numerics import random_layer
from .test_opcheck import assert_fake_matches, check

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def expected_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64, rounding where the op stores: s = y * (1 + weight) in y's dtype, s / sqrt(mean(s^2) + eps)."""
    s = (y.double() * (1 + weight).double()).to(y.dtype).double()
    return s / torch.sqrt((s * s).mean(dim=1, keepdim=True) + eps)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_post_expert_norm_against_float64(dtype, weight_dtype):
    """Rows of different scales come out with unit root mean square (up to eps), each element scaled by
    1 + weight first; all-zero rows (GEMM2's rows past the last offset) stay zero."""
    rows, hidden = int(torch.randint(2, 9, ())), 48
    y = (torch.randn(rows, hidden) * torch.rand(rows, 1) * 10).to(dtype)
    y[-1] = 0
    weight = (torch.randn(hidden) * 0.5).to(weight_dtype)
    eps = 1e-5
    out = post_expert_norm(y, weight, eps)
    assert out.dtype == dtype and out.shape == y.shape
    want = expected_norm(y, weight, eps)
    assert relative_error(out[:-1], want[:-1]) <= tolerance(dtype)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    # the norm changed the rows (so the check above is not of y against itself)
    assert relative_error(y[:-1], want[:-1]) > 0.1


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_expert_norm_opcheck(rows, dtype):
    args = [torch.randn(rows, 32).to(dtype), torch.randn(32), 1e-6]
    check(post_expert_norm, args)
    assert_fake_matches(post_expert_norm, args)


def test_post_expert_norm_reads_no_values_on_the_host():
    with no_host_reads():
        post_expert_norm(torch.randn(6, 32), torch.randn(32), 1e-6)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.randn(4, 32), torch.randn(31), 1e-6), ValueError, r"weight: expected shape \(32,\) \(\[H\] for y \(4, 32\)\), got \(31,\)"),
        ((torch.randn(4, 32), torch.randn(32).int(), 1e-6), TypeError, r"weight: dtype torch.int32 is not allowed"),
        ((torch.randn(32), torch.randn(32), 1e-6), ValueError, r"y: expected 2-D \[R, H\], got shape \(32,\)"),
        ((torch.randn(4, 32), torch.randn(32), 0.0), ValueError, r"eps: got 0.0; allowed: > 0"),
    ],
    ids=["weight_shape", "weight_dtype", "y_1d", "eps_0"],
)
def test_post_expert_norm_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        post_expert_norm(*args)


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: PostExpertNorm(torch.randn(4, 8)), ValueError, r"post_expert_norm.weight: expected 1-D \[H\], got shape \(4, 8\)"),
        (lambda: PostExpertNorm([1.0, 2.0]), TypeError, r"post_expert_norm.weight: expected a torch.Tensor, got list"),
        (lambda: PostExpertNorm(torch.randn(8), eps=0.0), ValueError, r"post_expert_norm.eps: got 0.0; allowed: a finite number > 0"),
        (lambda: PostExpertNorm(torch.randn(8), eps=float("inf")), ValueError, r"post_expert_norm.eps: got inf"),
        (lambda: PostExpertNorm(torch.randn(8), eps=float("nan")), ValueError, r"post_expert_norm.eps: got nan"),
        (lambda: PostExpertNorm(torch.randn(8), eps="1e-6"), TypeError, r"post_expert_norm.eps: expected a real number, got str"),
    ],
    ids=["weight_2d", "weight_list", "eps_0", "eps_inf", "eps_nan", "eps_str"],
)
def test_post_expert_norm_spec_rejects(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def _layer(dtype, m=23, hidden=64, inter=32, num_experts=6, top_k=2):
    # Drawn from the test's fresh seed (tests/conftest.py): new inputs on every run.
    x, w13, w2, tw, ids = random_layer(m, hidden, inter, num_experts, top_k, True, dtype)
    norm = PostExpertNorm((torch.randn(hidden) * 0.3).to(dtype), eps=1e-6)
    return x, w13, w2, tw, ids, norm


def test_fused_experts_rejects_a_norm_of_another_width():
    x, w13, w2, tw, ids, _ = _layer(torch.float32)
    with pytest.raises(ValueError, match=r"post_expert_norm.weight: expected shape \(64,\) \(\[H\]\), got \(63,\)"):
        fused_experts(x, w13, w2, tw, ids, post_expert_norm=PostExpertNorm(torch.randn(63)))
    with pytest.raises(TypeError, match=r"post_expert_norm: expected moe_ops.PostExpertNorm or None, got tuple"):
        fused_experts(x, w13, w2, tw, ids, post_expert_norm=(torch.randn(64), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_with_norm_against_float64(dtype):
    """Each expert's output row is normalized before its router weight: against moe_float64 with the
    norm, and far from the same layer without it."""
    x, w13, w2, tw, ids, norm = _layer(dtype)
    b2 = torch.randn(w2.shape[0], w2.shape[1]).to(dtype)
    out = fused_experts(x, w13, w2, tw, ids, w2_bias=b2, post_expert_norm=norm)
    inter = torch.bfloat16 if dtype == torch.bfloat16 else None
    want = moe_float64(x, w13, w2, tw, ids, w2_bias=b2, post_expert_norm=norm, intermediate_dtype=inter)
    assert out.dtype == dtype
    assert relative_error(out, want) <= tolerance(dtype)
    plain = moe_float64(x, w13, w2, tw, ids, w2_bias=b2, intermediate_dtype=inter)
    assert relative_error(plain, want) > 0.1


def test_compiled_layer_fuses_the_norm_into_down_reduce():
    """The lowering fuses a chain with a norm between GEMM2 and the reduction: explain() shows the norm
    in the recipe, the graph keeps no post_expert_norm of its own, and the compiled layer gives the
    eager output (on the CPU both are the reference composition)."""
    x, w13, w2, tw, ids, norm = _layer(torch.float32)

    def layer(x, tw, ids):
        return fused_experts(x, w13, w2, tw, ids, post_expert_norm=norm)

    report = lowering.explain(layer, x, tw, ids)
    (row,) = report.layers
    assert row.fused == "gate_up + down_reduce" and row.recipe.endswith("; post-norm=rms(eps=1e-06)"), row
    (graph,) = report.graphs
    assert "post_expert_norm" not in graph and "down_reduce" in graph
    with lowering.enabled():
        compiled = torch.compile(layer, fullgraph=True)
        assert torch.allclose(compiled(x, tw, ids), layer(x, tw, ids), rtol=1e-5, atol=1e-6)
    assert relative_error(layer(x, tw, ids), moe_float64(x, w13, w2, tw, ids, post_expert_norm=norm)) <= tolerance(torch.float32)
