"""lowering/backend.py's kernel choice on a CPU machine: the recipes the CuTe DSL kernels cannot serve
are declined with their reason (a kernel call would raise or compute something else on the GPU), the
arguments a kernel call gets, and require_kernels leaving CPU calls alone."""
from __future__ import annotations

import pytest
import torch

import lowering
from lowering.fused_ops import down_reduce, gate_up

from . import cases
from .test_pass import _meta_down_reduce_args, _meta_gate_up_args, build_layer, inputs

# Every tensor each op hands the kernels by pointer.
POINTER_ARGS = [("gate_up", name) for name in ("x", "w", "bias", "expert_offsets", "gather_idx")] + [
    ("down_reduce", name) for name in ("a", "w", "bias", "expert_offsets", "topk_weights", "inverse")
]


def _meta_args(op: str) -> dict:
    """The op's meta arguments of a shape the kernels serve, with a bias ([E, N] in the weights' dtype)."""
    args = _meta_gate_up_args() if op == "gate_up" else _meta_down_reduce_args()
    args["bias"] = torch.empty(args["w"].shape[:2], dtype=args["w"].dtype, device="meta")
    return args


def _support(op: str, args: dict) -> tuple[bool, str]:
    from cute_kernels import interface
    from lowering import backend

    return backend._support(op, getattr(backend, f"{op}_recipe")(args), interface)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A view of t's shape that is not contiguous: every other element of a buffer twice as wide."""
    return torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)[..., ::2]


@pytest.mark.parametrize("op, name", POINTER_ARGS)
def test_kernels_decline_non_contiguous_inputs(op, name):
    """The kernels read every tensor as contiguous (cute_kernels.interface raises ValueError for one
    that is not), so a recipe with a strided input (a transposed x, a column of router weights) must get
    the reference and say why, not a kernel call that fails on the GPU."""
    args = _meta_args(op)
    assert _support(op, args)[0]
    args[name] = _strided(args[name])
    assert not args[name].is_contiguous()
    ok, why = _support(op, args)
    assert not ok and "non-contiguous" in why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_kernels_decline_router_weights_other_than_float32(dtype):
    """down_reduce's kernel reads topk_weights as float32 (interface.down_reduce raises TypeError for
    others): bf16 router weights, as a bf16 model's router gives them, must get the reference."""
    args = _meta_args("down_reduce")
    assert _support("down_reduce", args)[0]
    args["topk_weights"] = args["topk_weights"].to(dtype)
    ok, why = _support("down_reduce", args)
    assert not ok and f"router weights in {dtype}" in why


def test_kernels_decline_a_recipe_that_only_requantizes():
    """A chain that quantizes GEMM2's input only (gate_up's out_quant_dtype, with x and both weights
    unquantized) is still a quantized recipe: the kernels would return an unquantized bf16 intermediate
    where the chain makes fp8 codes and their scales. It must get the reference."""
    args = _meta_gate_up_args()
    assert _support("gate_up", args)[0]
    args.update(out_quant_dtype="fp8", out_quant_group=[1, -1])
    ok, why = _support("gate_up", args)
    assert not ok and "quantized" in why


@pytest.mark.parametrize("early", [False, True])
def test_kernel_call_gets_weights_early_from_the_pass(monkeypatch, early):
    """down_reduce's kernel may load its weights before the kernel before it finishes only when the pass
    proved they exist by then (weights_early); passing True where the pass said False is a race on the
    GPU. The backend hands the op's tensors and that flag to cute_kernels.interface unchanged."""
    from cute_kernels import interface
    from lowering import backend

    args = _meta_args("down_reduce")
    args["weights_early"] = early
    calls = []
    monkeypatch.setattr(interface, "down_reduce", lambda *a, **kw: calls.append((a, kw)))
    backend._run_down_reduce(args)
    ((given, kw),) = calls
    want = [args[name] for name in ("a", "w", "bias", "expert_offsets", "topk_weights", "inverse")]
    assert len(given) == len(want) and all(g is w for g, w in zip(given, want))
    assert kw == {"weights_early": early}


def test_require_kernels_leaves_cpu_calls_on_the_reference():
    """require_kernels turns a CUDA call that no kernel serves into an error; on the CPU the reference is
    the implementation, not a fallback, so the fused ops and explain() work as without the setting."""
    from lowering import backend

    gu, dr, _ = build_layer("bf16", 5)
    want = (*gate_up(*gu), down_reduce(*dr))
    model, h, e, dtype = cases.CASES["bf16_swiglu"]()
    with lowering.enabled(require_kernels=True):
        assert backend.REQUIRE_KERNELS["value"] is True
        got = (*gate_up(*gu), down_reduce(*dr))
        (row,) = lowering.explain(model, *inputs(h, e, dtype)).layers
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert row.backend.startswith("gate_up: reference (cpu: ") and "down_reduce: reference (cpu: " in row.backend
