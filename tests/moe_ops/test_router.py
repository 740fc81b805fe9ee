"""moe_ops::router_linear and the Router module (moe_ops/router.py), and its decode kernel
(moe_ops/router_kernel.py) against float64 re-computations on fresh random inputs.

On CPU the kernel runs in Triton's interpreter (a fresh subprocess, tests/triton_interpreter.py); on the
GPU it runs compiled, through the op's CUDA registration.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

import moe_ops
from moe_ops.router import Router, router_linear, router_linear_op
from tests.moe_ops.test_opcheck import check
from tests.ptx import compile_triton, split_at_wait, touches_global
from tests.triton_interpreter import needs_interpreter, run_interpreted

# A float32 sum of H products against float64: a few units of float32 rounding times sqrt(H); the
# output's own rounding for 16-bit dtypes (half an ulp: 2^-9 bf16, 2^-12 fp16 relative).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
# Triton's interpreter converts float32 to bfloat16 by truncation (the GPU rounds to nearest): a full ulp.
INTERPRETER_TOLERANCE = TOLERANCE | {torch.bfloat16: 2 ** -7}

# (M, E, H, dtype, bias, how x is laid out): the kernel's cases. E and H off powers of two (gpt-oss'
# 2880), E above the programs' 128 (several experts a program), H above a chunk, a transposed x.
KERNEL_CASES = [
    (1, 128, 256, torch.bfloat16, False, "contiguous"),
    (3, 200, 96, torch.float32, True, "contiguous"),
    (8, 8, 2880, torch.bfloat16, True, "contiguous"),
    (5, 300, 64, torch.float16, False, "contiguous"),
    (2, 16, 4200, torch.float32, False, "contiguous"),
    (7, 33, 48, torch.float32, True, "transposed"),
    (0, 16, 64, torch.bfloat16, False, "contiguous"),
]


def make_args(m, e, h, dtype, bias, layout, device="cpu"):
    """x [M, H], weight [E, H], bias [E] or None: random, scaled so the logits are O(1)."""
    x = torch.randn(h, m, device=device).t() if layout == "transposed" else torch.randn(m, h, device=device)
    weight = torch.randn(e, h, device=device) / h**0.5
    b = torch.randn(e, device=device) if bias else None
    return x.to(dtype), weight.to(dtype), None if b is None else b.to(dtype)


def assert_matches_float64(got, x, weight, bias, tolerance=TOLERANCE):
    """got [M, E] in x's dtype, contiguous, within the dtype's tolerance of the float64 logits (the
    largest error over the largest logit)."""
    want = x.double() @ weight.double().t() + (bias.double() if bias is not None else 0.0)
    assert got.dtype == x.dtype and got.shape == want.shape and got.is_contiguous()
    if want.numel():
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= tolerance[x.dtype], (err, tuple(x.shape), tuple(weight.shape), x.dtype)


_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from moe_ops.router_kernel import router_linear_triton
    from tests.moe_ops.test_router import INTERPRETER_TOLERANCE, KERNEL_CASES, assert_matches_float64, make_args
    torch.manual_seed(int(sys.argv[1]))
    for case in KERNEL_CASES:
        args = make_args(*case)
        assert_matches_float64(router_linear_triton(*args), *args, tolerance=INTERPRETER_TOLERANCE)
        # A launch the bench's sweep may pick: two experts a program, chunks of 64 (many chunks).
        assert_matches_float64(router_linear_triton(*args, launch=(2, 64, 4)), *args, tolerance=INTERPRETER_TOLERANCE)
    print("same", len(KERNEL_CASES))
    """
)


@needs_interpreter
def test_kernel_matches_float64_in_interpreter(rng):
    out = run_interpreted(_SCRIPT, rng.initial_seed(), timeout=600)
    assert out.startswith("same"), out


def test_launch_shape_spreads_experts_over_about_128_or_64_programs():
    from moe_ops.router_kernel import MAX_TOKENS, launch_shape

    assert launch_shape(1, 2048, 128) == (1, 1, 2048)  # qwen3: one expert a program
    assert launch_shape(2, 7168, 256) == (2, 2, 4096)  # deepseek: two experts, chunks of 4096
    assert launch_shape(1, 4096, 8) == (1, 1, 4096)  # mixtral: 8 programs
    # From 4 tokens about 64 programs: qwen3 and gpt-oss (all of H in one chunk) two experts a program.
    assert launch_shape(3, 2048, 128) == (4, 2, 2048)
    assert launch_shape(4, 2880, 128) == (4, 2, 4096)
    assert launch_shape(3, 7168, 256) == (4, 4, 2048)
    assert launch_shape(MAX_TOKENS, 2048, 128) == (8, 2, 2048)  # qwen3 at 8 tokens: 64 programs too


def test_kernel_serves_decode_sizes_where_it_beat_cublas():
    """The measured rule (bench/NOTES.md v62, v63): up to 8 tokens, and up to 32768 products a program."""
    from moe_ops.router_kernel import serves

    for m in range(1, 9):
        assert serves(m, 2048, 128) and serves(m, 4096, 8), m  # qwen3, mixtral
    assert serves(5, 2880, 128) and not serves(6, 2880, 128)  # gpt-oss: 2 experts a program from 5 tokens
    assert serves(2, 7168, 256) and not serves(3, 7168, 256)  # deepseek-v3: 2 experts a program
    assert not serves(9, 2048, 128) and not serves(9, 64, 8)


@pytest.mark.parametrize("m", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(m, dtype, bias):
    check(router_linear_op, list(make_args(m, 12, 32, dtype, bias, "contiguous")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_float64(dtype):
    args = make_args(6, 40, 96, dtype, True, "transposed")
    assert_matches_float64(moe_ops.router_linear(*args), *args)  # the public name
    assert_matches_float64(router_linear_op(*args), *args)


BAD = {
    "x 3-D": (lambda x, w, b: (x[None], w, b), ValueError, r"x: expected 2-D \[M, H\], got shape \(1, 4, 16\)"),
    "x int": (lambda x, w, b: (x.long(), w, b), TypeError, r"x: dtype torch.int64 is not allowed; allowed: torch.float32"),
    "weight H": (lambda x, w, b: (x, w[:, :8], b), ValueError, r"weight: expected \[E, H=16\] for x \(4, 16\), got shape \(6, 8\)"),
    "weight dtype": (lambda x, w, b: (x, w.double(), b), TypeError, r"weight: dtype torch.float64 differs from x's torch.float32"),
    "bias shape": (lambda x, w, b: (x, w, b[:5]), ValueError, r"bias: expected shape \(6,\) \(\[E\]\), got \(5,\)"),
    "bias dtype": (lambda x, w, b: (x, w, b.half()), TypeError, r"bias: dtype torch.float16 differs from x's torch.float32"),
    "bias device": (lambda x, w, b: (x, w, b.to("meta")), ValueError, r"bias: on meta, but x is on cpu"),
    "weight list": (lambda x, w, b: (x, w.tolist(), b), TypeError, r"weight: expected a torch.Tensor, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_anything_runs(case):
    change, error, message = BAD[case]
    args = change(torch.randn(4, 16), torch.randn(6, 16), torch.randn(6))
    with pytest.raises(error, match=message):
        router_linear(*args)
    if isinstance(args[1], torch.Tensor):  # the op's schema itself refuses a list
        with pytest.raises(error, match=message):
            router_linear_op(*args)


def test_router_is_an_nn_linear_with_its_names_hooks_and_shapes():
    linear = torch.nn.Linear(16, 6, bias=True)
    router = Router(16, 6, bias=True)
    router.load_state_dict(linear.state_dict())
    assert isinstance(router, torch.nn.Linear) and list(router.state_dict()) == ["weight", "bias"]
    seen = []
    router.register_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    x = torch.randn(2, 3, 16)
    out = router(x)
    assert seen == [torch.Size([2, 3, 6])]
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)
    assert_matches_float64(out.reshape(6, 6), x.reshape(6, 16), router.weight.detach(), router.bias.detach())


def test_router_under_autocast_runs_nn_linear():
    """Autocast does not cast custom ops: under it the router is nn.Linear's, in the autocast dtype."""
    router = Router(16, 6, bias=False)
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.dtype == torch.bfloat16
    assert_matches_float64(out, x.bfloat16(), router.weight.detach().bfloat16(), None)


class Tagged(torch.Tensor):
    """A tensor subclass that F.linear dispatches through __torch_function__ (as a quantization
    library's weights are) and that keeps its type through it."""


def test_router_with_a_tensor_subclass_weight_runs_nn_linear(monkeypatch):
    """A parameter swapped for a tensor subclass goes to nn.Linear's forward (F.linear dispatches it);
    the op, which reads plain tensors, is not called."""
    import moe_ops.router as router_module

    router = Router(16, 6, bias=False)
    router.weight = torch.nn.Parameter(router.weight.detach().as_subclass(Tagged))
    monkeypatch.setattr(router_module, "router_linear", lambda *args: pytest.fail("the op was called"))
    x = torch.randn(3, 16)
    out = router(x)
    assert type(out) is Tagged
    assert_matches_float64(out.as_subclass(torch.Tensor), x, router.weight.detach().as_subclass(torch.Tensor), None)


def test_layer_routes_through_the_op_and_compiles_fullgraph():
    """FusedMoE's router is a Router; compiled (fullgraph, dynamic) the graph calls moe_ops::router_linear,
    and eager and compiled route alike."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    layer = moe_ops.FusedMoE(8, 2, 32, 16, dtype=torch.float32, device="cpu")
    assert isinstance(layer.router, Router)
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        x = torch.randn(5, 32)
        torch.testing.assert_close(compiled(x), layer(x))
    assert "torch.ops.moe_ops.router_linear.default" in backend.graphs[0].code


# ---- GPU -----------------------------------------------------------------------------------------

GPU_CASES = [
    *KERNEL_CASES,
    (1, 128, 2048, torch.bfloat16, False, "contiguous"),  # qwen3
    (4, 128, 2880, torch.bfloat16, True, "contiguous"),  # gpt-oss (its router has a bias)
    (2, 256, 7168, torch.bfloat16, False, "contiguous"),  # deepseek-v3
    (2, 8, 4096, torch.float16, False, "contiguous"),  # mixtral
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_cuda_kernel_matches_float64(case):
    from moe_ops.router_kernel import router_linear_triton

    args = make_args(*case, device="cuda")
    assert_matches_float64(router_linear_triton(*args), *args)
    assert_matches_float64(router_linear(*args), *args)
    assert_matches_float64(router_linear_op(*args), *args)


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,h", [(9, 128, 512), (6, 128, 2880), (3, 256, 7168)])
def test_cuda_past_the_kernel_is_cublas(m, e, h):
    args = make_args(m, e, h, torch.bfloat16, True, "contiguous", device="cuda")
    assert torch.equal(router_linear(*args), F.linear(*args))


@pytest.mark.gpu
def test_cuda_graph_replays_new_tokens():
    """Captured in a CUDA graph (the kernel launches on torch's current stream) and then the route
    kernel after it, as FusedMoE runs them: replays on new tokens give the eager results."""
    x, weight, bias = make_args(2, 128, 2048, torch.bfloat16, True, "contiguous", device="cuda")
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            router_linear(static, weight, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = router_linear(static, weight, bias)
        routed = moe_ops.route(logits, 8)
    for _ in range(3):
        fresh = torch.randn_like(static)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want = router_linear(fresh, weight, bias)
        assert torch.equal(logits, want)
        assert_matches_float64(logits, fresh, weight, bias)
        assert torch.equal(routed[1], moe_ops.route(want, 8)[1])


# ---- PTX (no GPU) --------------------------------------------------------------------------------


def _compile_without_gpu(capability: int, grid_dependency: bool):
    from moe_ops import router_kernel

    signature = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}
    signature |= {s: "i32" for s in ("m", "h", "e", "stride_xm", "stride_xh", "stride_we", "stride_wh")}
    constants = dict(BLOCK_M=4, BLOCK_E=1, BLOCK_H=2048, HAS_BIAS=True, PDL=grid_dependency)
    return compile_triton(router_kernel._router_linear_kernel, signature, constants, capability, router_kernel.compile_options(grid_dependency))


def test_cuda_kernel_waits_before_reading_and_lets_the_route_launch():
    """Launched as a programmatic dependent, the kernel touches no global memory before
    griddepcontrol.wait (x comes from the kernel before it), and lets the route kernel launch first."""
    compiled = _compile_without_gpu(90, grid_dependency=True)
    assert compiled.metadata.launch_pdl
    before, after = split_at_wait(compiled.asm["ptx"])
    assert "griddepcontrol.launch_dependents" in before
    assert not touches_global(before), "a global access before griddepcontrol.wait"
    assert touches_global(after)


def test_cuda_kernel_builds_for_sm80_without_grid_dependency():
    compiled = _compile_without_gpu(80, grid_dependency=False)
    assert compiled.asm["cubin"]
    assert "griddepcontrol" not in compiled.asm["ptx"]
