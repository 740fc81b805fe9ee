"""lowering/backend.py's kernel choice on a CPU machine: the recipes the CuTe DSL kernels cannot serve
are declined with their reason (a kernel call would raise or compute something else on the GPU), the
arguments a kernel call gets, and require_kernels leaving CPU calls alone."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import lowering
from lowering.fused_ops import down_reduce, gate_up

from . import cases
from .test_pass import _meta_down_reduce_args, _meta_gate_up_args, build_layer, inputs

# Every tensor each op hands the kernels by pointer.
POINTER_ARGS = [("gate_up", name) for name in ("x", "w", "bias", "expert_offsets", "gather_idx")] + [
    ("down_reduce", name) for name in ("a", "w", "bias", "expert_offsets", "topk_weights", "inverse", "norm_weight")
]


def _meta_args(op: str) -> dict:
    """The op's meta arguments of a shape the kernels serve, with a bias ([E, N] in the weights' dtype),
    and for down_reduce a post-expert norm ([H] in the weights' dtype)."""
    args = _meta_gate_up_args() if op == "gate_up" else _meta_down_reduce_args()
    args["bias"] = torch.empty(args["w"].shape[:2], dtype=args["w"].dtype, device="meta")
    if op == "down_reduce":
        args.update(norm_weight=torch.empty(args["w"].shape[1], dtype=args["w"].dtype, device="meta"), norm_eps=1e-6)
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


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_column_major_weights_are_declined_with_the_call_that_fixes_them(op):
    """A transposed view of a contiguous [E, K, N] weight (what transformers' gpt-oss experts hand
    moe_ops) is declined as column-major, naming row_major_experts, not as merely non-contiguous; the
    same values stored row-major are served. A weight strided otherwise is still non-contiguous."""
    args = _meta_args(op)
    e, n, k = args["w"].shape
    args["w"] = torch.empty(e, k, n, dtype=args["w"].dtype, device="meta").transpose(1, 2)
    ok, why = _support(op, args)
    assert not ok and why.startswith("column-major (transposed) expert weights")
    assert "moe_ops.integrations.transformers.row_major_experts(model)" in why
    args["w"] = torch.empty(e, n, k, dtype=args["w"].dtype, device="meta")
    assert _support(op, args)[0]
    args["w"] = torch.empty(e, k, 2 * n, dtype=args["w"].dtype, device="meta")[..., ::2].transpose(1, 2)
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


def test_a_recipe_that_only_requantizes_runs_on_decoded_operands():
    """A chain that quantizes GEMM2's input only (gate_up's out_quant_dtype, with x and both weights
    unquantized) is still a quantized recipe: the kernels alone would return an unquantized bf16
    intermediate where the chain makes fp8 codes and their scales. The dequantizing path serves it (the
    kernel's intermediate, then moe_ops::quantize as in the chain), and its reason says so."""
    args = _meta_gate_up_args()
    ok, why = _support("gate_up", args)
    assert ok and "dequantized" not in why
    args.update(out_quant_dtype="fp8", out_quant_group=[1, -1])
    ok, why = _support("gate_up", args)
    assert ok and why.startswith("weights dequantized to torch.bfloat16 on each call"), why


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
    assert kw.keys() == {"weights_early", "norm_weight", "norm_eps"} and kw["weights_early"] == early
    assert kw["norm_weight"] is args["norm_weight"] and kw["norm_eps"] == args["norm_eps"]


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


def test_kernel_call_gets_gate_ups_tensors_and_parameters(monkeypatch):
    """GEMM1's kernel gets the op's tensors unchanged (a dropped bias is a wrong output on the GPU, the
    plan's ids dropped lose the M = 1 weight hint), the activation's alpha and limit as the recipe says
    (swigluoai with its own values here: swapped, the clamp and the sigmoid's slope are wrong), and its
    output comes back with the empty float32 scale of an unquantized intermediate, as from the fake impl
    and the reference (another dtype there is a real/fake mismatch only the GPU would run into)."""
    from cute_kernels import interface
    from lowering import backend

    args = _meta_args("gate_up")
    args.update(activation="swigluoai", alpha=1.25, limit=3.5, interleaved=True,
                expert_ids=torch.empty(4, 2, dtype=torch.int32, device="meta"))  # fmt: skip
    calls = []

    def kernel(*a, **kw):
        calls.append((a, kw))
        return a[0].new_empty((a[4].shape[0], a[1].shape[1] // 2))

    monkeypatch.setattr(interface, "gate_up", kernel)
    out, scale = backend._run_gate_up(args)
    ((given, kw),) = calls
    want = [args[name] for name in ("x", "w", "bias", "expert_offsets", "gather_idx")]
    assert len(given) == len(want) and all(g is w for g, w in zip(given, want))
    assert kw.pop("expert_ids") is args["expert_ids"]
    assert kw == {"activation": "swigluoai", "alpha": 1.25, "limit": 3.5, "gate_layout": "interleaved"}
    assert out.shape == (8, 128) and (scale.shape, scale.dtype) == ((0,), torch.float32)


def _with_shape(op: str, experts: int = 4, hidden: int = 128, inter: int = 128) -> dict:
    """_meta_args(op) with E experts, hidden size H and intermediate size I (a bias included)."""
    args = _meta_args(op)
    meta = dict(dtype=torch.bfloat16, device="meta")
    n, k = (2 * inter, hidden) if op == "gate_up" else (hidden, inter)
    args.update(w=torch.empty(experts, n, k, **meta), bias=torch.empty(experts, n, **meta),
                expert_offsets=torch.empty(experts + 1, dtype=torch.int32, device="meta"))  # fmt: skip
    rows = args["x" if op == "gate_up" else "a"].shape[0]
    args["x" if op == "gate_up" else "a"] = torch.empty(rows, k, **meta)
    return args


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
@pytest.mark.parametrize("hidden, inter", [(96, 128), (128, 96)])
def test_kernels_decline_sizes_off_the_k_tile_naming_each(op, hidden, inter):
    """H and I must be multiples of 64 (the K tile); the reason names each size with its own value. A
    recipe that read GEMM2's H from w's last dimension (its K, which is I) would name them the other way
    round, and explain() would show that for every such layer."""
    assert _support(op, _with_shape(op))[0]
    ok, why = _support(op, _with_shape(op, hidden=hidden, inter=inter))
    assert not ok and f"hidden={hidden} and intermediate={inter} must be multiples of 64" in why


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_kernels_serve_up_to_max_experts(op):
    """The kernels keep E+1 offsets in shared memory, for at most MAX_EXPERTS experts: a recipe counts E
    from the weights (w [E, ...]), not from expert_offsets' E+1 entries (that count would decline a
    layer of exactly MAX_EXPERTS experts)."""
    from cute_kernels.moe_gemm import MAX_EXPERTS

    assert _support(op, _with_shape(op, experts=MAX_EXPERTS))[0]
    ok, why = _support(op, _with_shape(op, experts=MAX_EXPERTS + 1))
    assert not ok and f"{MAX_EXPERTS + 1} local experts" in why


@pytest.mark.parametrize("activation, interleaved", [("relu2", False), ("swigluoai", True), ("gelu", False)])
def test_kernels_serve_each_activation_in_its_gate_layout(activation, interleaved):
    """gate_up_support pairs the activation with the layout of its w13 rows: relu2 with none (w13 is
    [E, I, H]), gated ones with halves or interleaved pairs. A backend that asked about one fixed layout
    would send every relu2 layer to the reference on a Hopper GPU."""
    args = _meta_args("gate_up")
    args.update(activation=activation, interleaved=interleaved)
    if activation == "relu2":
        args.update(w=args["w"][:, :128].contiguous(), bias=args["bias"][:, :128].contiguous())
    ok, why = _support("gate_up", args)
    assert ok, why


def _int4_args(op: str) -> dict:
    """The op's meta arguments with int4 weights (w4a16: packed uint8 [E, N, K/2], bf16 activations)."""
    args = _meta_args(op)
    w = args["w"]
    args.update(w=torch.empty(*w.shape[:2], w.shape[2] // 2, dtype=torch.uint8, device="meta"), w_dtype="int4", w_group=[1, 64])
    return args


def _mxfp4_args(op: str, activation: str = "silu") -> dict:
    """The op's meta arguments with mxfp4 weights (mxfp4_w4a16: packed uint8 [E, N, K/2], e8m0 1x32 scales)."""
    args = _meta_args(op)
    w = args["w"]
    args.update(w=torch.empty(*w.shape[:2], w.shape[2] // 2, dtype=torch.uint8, device="meta"), w_dtype="mxfp4", w_group=[1, 32])
    if op == "gate_up":
        args.update(activation=activation)
    return args


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_mxfp4_w4a16_runs_on_the_w4a16_kernels(op, monkeypatch):
    """mxfp4 weights with bf16 activations and a gated activation take the w4a16 kernels (w4_kernels.py: the
    codes decoded in registers), named cute+w4 with their reason and the quantized runner (which dispatches to
    them); relu2 (no gated epilogue there) and fp16 layers stay on the decoding path."""
    from cute_kernels import interface
    from lowering import backend

    ok, why = _support(op, _mxfp4_args(op))
    assert ok and why.startswith("mxfp4 weights re-laid per call for the experts in use"), why
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    choice = backend._choose(op, getattr(backend, f"{op}_recipe")(_mxfp4_args(op)), torch.device("cuda"))
    assert (choice.backend, choice.kernel) == ("cute+w4", backend._KERNELS[op, True])
    if op == "gate_up":
        args = _mxfp4_args(op, "relu2")
        args.update(w=args["w"][:, :128].contiguous(), bias=args["bias"][:, :128].contiguous())
        assert backend._choose(op, backend.gate_up_recipe(args), torch.device("cuda")).backend == "cute+dequant"
    half = _mxfp4_args(op)
    if op == "gate_up":
        half.update(x=torch.empty(half["x"].shape, dtype=torch.float16, device="meta"), out_dtype=torch.float16)
    else:
        half.update(a=torch.empty(half["a"].shape, dtype=torch.float16, device="meta"), out_dtype=torch.float16)
    half.update(bias=torch.empty(half["bias"].shape, dtype=torch.float16, device="meta"))
    if op == "down_reduce":
        half.update(norm_weight=torch.empty(half["norm_weight"].shape, dtype=torch.float16, device="meta"))
    assert backend._choose(op, getattr(backend, f"{op}_recipe")(half), torch.device("cuda")).backend == "cute+dequant"


def _tiled_args(op: str, dtype=torch.bfloat16) -> dict:
    """The op's meta arguments with mxfp4 weights tiled at load time (uint8 [E, N, B], no scale tensor)."""
    from cute_kernels import w4a16_pack as wp

    args = _mxfp4_args(op)
    w = args["w"]
    kind, w_dtype = ("gate_up", "mxfp4_tiled_gate_up") if op == "gate_up" else ("rows", "mxfp4_tiled_rows")
    b = wp.tiled_chunks(kind, w.shape[1], 2 * w.shape[2])[1]
    args.update(w=torch.empty(*w.shape[:2], b, dtype=torch.uint8, device="meta"), w_dtype=w_dtype, w_scale=None)
    act = "x" if op == "gate_up" else "a"
    args.update({act: torch.empty(args[act].shape, dtype=dtype, device="meta"), "out_dtype": dtype})
    args.update(bias=torch.empty(args["bias"].shape, dtype=dtype, device="meta"))
    if op == "down_reduce":
        args.update(norm_weight=torch.empty(args["norm_weight"].shape, dtype=dtype, device="meta"))
    return args


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_tiled_mxfp4_runs_on_the_w4a16_kernels_only(op, monkeypatch):
    """Tiled mxfp4 weights take the w4a16 kernels with their own reason; where those do not serve (fp16), the
    recipe is refused with the reason, never decoded (the decoding path reads codes), so the reference runs it."""
    from cute_kernels import interface
    from lowering import backend
    from moe_ops import w4_kernels

    ok, why = _support(op, _tiled_args(op))
    assert ok and why.startswith(w4_kernels.TILED_REASON), why
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    choice = backend._choose(op, getattr(backend, f"{op}_recipe")(_tiled_args(op)), torch.device("cuda"))
    assert (choice.backend, choice.kernel) == ("cute+w4", backend._KERNELS[op, True])
    assert _support(op, _tiled_args(op, torch.float16)) == (False, w4_kernels.TILED_ONLY)


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_weight_only_quantization_runs_on_decoded_weights(op, monkeypatch):
    """A weight-only quantized recipe (int4 weights, bf16 activations: w4a16) is served by the kernels on
    weights decoded to bf16 (dequant_kernels.py), not declined as weights of another dtype (its packed
    uint8 storage), and the choice names that backend and its runner."""
    from cute_kernels import interface
    from lowering import backend

    ok, why = _support(op, _int4_args(op))
    assert ok and why.startswith("weights dequantized to torch.bfloat16 on each call"), why
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    recipe = getattr(backend, f"{op}_recipe")(_int4_args(op))
    choice = backend._choose(op, recipe, torch.device("cuda"))
    assert (choice.backend, choice.kernel) == ("cute+dequant", backend._KERNELS[op, True])
    plain = backend._choose(op, getattr(backend, f"{op}_recipe")(_meta_args(op)), torch.device("cuda"))
    assert (plain.backend, plain.kernel) == ("cute", backend._KERNELS[op, False])


def _fp8_args(op: str, w_group, a_group) -> dict:
    """The op's meta arguments with fp8 weights and activations (GEMM2's input: fp8 codes, out_dtype bf16)."""
    args = _meta_args(op)
    fp8 = dict(dtype=torch.float8_e4m3fn, device="meta")
    args.update(w=torch.empty(args["w"].shape, **fp8), w_dtype="fp8", w_group=list(w_group), a_dtype="fp8", a_group=list(a_group))
    if op == "down_reduce":
        args.update(a=torch.empty(args["a"].shape, **fp8))
    return args


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
@pytest.mark.parametrize(
    "w_group, a_group, label",
    [((-1, -1), (-1, -1), "cute+fp8"), ((1, -1), (1, -1), "cute+fp8"), ((128, 128), (1, 128), "cute+fp8"),
     ((128, 128), (1, -1), "cute+dequant")],
)  # fmt: skip
def test_fp8_recipes_run_on_the_codes(op, w_group, a_group, label, monkeypatch):
    """fp8 per-tensor, per-token and 128x128-block recipes (fp8_kernels.serves) run on the fp8 codes, and
    the choice says so by its label and reason (per expert, channel or block; per tensor, token or
    1x128 group), allocating no decoded weight (MAX_BYTES does not apply); a mix the kernels do not
    take (block weights with per-token activations) is decoded, where MAX_BYTES declines it here."""
    from cute_kernels import interface
    from lowering import backend
    from moe_ops import dequant_kernels

    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    monkeypatch.setattr(dequant_kernels, "MAX_BYTES", 1)
    choice = backend._choose(op, getattr(backend, f"{op}_recipe")(_fp8_args(op, w_group, a_group)), torch.device("cuda"))
    if label == "cute+fp8":
        assert (choice.backend, choice.kernel) == (label, backend._KERNELS[op, True]), choice
        w = {(1, -1): "channel", (-1, -1): "expert", (128, 128): "128x128 block"}[w_group]
        a = {(1, -1): "token", (-1, -1): "tensor", (1, 128): "1x128 group"}[a_group]
        assert choice.reason.startswith(f"fp8 codes multiplied by the kernels' fp8 WGMMA, scaled per {w} and per {a}"), choice.reason
    else:
        assert choice.backend == "reference" and "dequantizing path allocates at most" in choice.reason, choice


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_fp8_with_fp16_activations_is_decoded(op, monkeypatch):
    """The fp8 kernel variants CI compiles write bf16 (fp8_kernels.DTYPES): an fp16 layer of an fp8
    per-token recipe runs decoded (the fp16 kernels), and says so."""
    from cute_kernels import interface
    from lowering import backend

    monkeypatch.setattr(interface, "device_support", lambda device: (True, "sm_90"))
    args = _fp8_args(op, (1, -1), (1, -1))
    half = dict(dtype=torch.float16, device="meta")
    args.update(out_dtype=torch.float16, bias=torch.empty(args["bias"].shape, **half))
    if op == "gate_up":
        args.update(x=torch.empty(args["x"].shape, **half))
    else:
        args.update(norm_weight=torch.empty(args["norm_weight"].shape, **half))
    choice = backend._choose(op, getattr(backend, f"{op}_recipe")(args), torch.device("cuda"))
    assert choice.backend == "cute+dequant" and choice.reason.startswith("weights dequantized to torch.float16"), choice


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_decoded_weights_over_the_bound_are_declined(op, monkeypatch):
    """The dequantizing path allocates the decoded [E, N, K] weight; one larger than MAX_BYTES (an
    unsharded DeepSeek-V3's 14 GiB) gets the reference, with the size and the remedy in the reason."""
    from moe_ops import dequant_kernels

    args = _int4_args(op)
    e, n, k = args["w"].shape[0], args["w"].shape[1], args["w"].shape[2] * 2
    monkeypatch.setattr(dequant_kernels, "MAX_BYTES", e * n * k * 2 - 1)
    ok, why = _support(op, args)
    assert not ok and f"E={e}, N={n}, K={k}" in why and "expert_map" in why, why
    monkeypatch.setattr(dequant_kernels, "MAX_BYTES", e * n * k * 2)
    assert _support(op, args)[0]


def test_reference_on_cuda_warns_once_per_op_and_reason(monkeypatch):
    """The run-time warning is once per (op, reason): gate_up and down_reduce falling back for the same
    reason (a quantized scheme declines both) each say so once, the second not silenced by the first."""
    from lowering import backend

    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.setattr(backend, "_choose", lambda op, recipe, device, tensors=None: backend.Choice("reference", "reason A"))
    cuda = torch.device("cuda")
    for op in ("gate_up", "down_reduce"):
        with pytest.warns(UserWarning, match=f"moe_ops::{op} runs the reference composition on cuda: reason A"):
            backend._at_run_time(op, {}, cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for op in ("gate_up", "down_reduce"):
            backend._at_run_time(op, {}, cuda)


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_run_time_choice_gets_the_calls_pointers(monkeypatch, op):
    """The op's choice at run time is _at_run_time's (the one that warns, or raises under
    require_kernels) with the op's recipe, device and every tensor it hands the kernels by pointer: the
    tensors are what the 16-byte alignment check reads, so a choice without them would send a view off
    a 16-byte boundary to the kernels (a fault that ends the CUDA context)."""
    from lowering import backend

    calls = []
    monkeypatch.setattr(backend, "_at_run_time", lambda *a: calls.append(a) or backend.Choice("reference", "stub"))
    args = _meta_args(op)
    getattr(backend, f"choose_{op}")(args)
    ((name, recipe, device, tensors),) = calls
    assert (name, recipe, device) == (op, getattr(backend, f"{op}_recipe")(args), torch.device("meta"))
    names = [n for o, n in POINTER_ARGS if o == op]
    assert list(tensors) == names and all(tensors[n] is args[n] for n in names)


@pytest.mark.parametrize("device", ["cpu", "meta", "mps"])
def test_devices_other_than_cuda_get_the_reference_without_the_kernels_package(monkeypatch, device):
    """Off CUDA the reference is the implementation: the choice names the device and never consults
    cute_kernels (an optional dependency, absent or unimportable on such machines), whose own reasons
    would misstate why."""
    from lowering import backend

    monkeypatch.setattr(backend, "_cute_interface", lambda: pytest.fail("consulted cute_kernels off CUDA"))
    for op in ("gate_up", "down_reduce"):
        choice = backend._choose(op, getattr(backend, f"{op}_recipe")(_meta_args(op)), torch.device(device))
        assert choice == backend.Choice("reference", f"{device}: the CuTe DSL kernels run on CUDA GPUs (sm_90)")


def test_kernels_unavailable_without_tvm_ffi_say_what_to_install():
    """Without apache-tvm-ffi (the kernels' calling convention, cute_kernels/compile.py) cute_kernels
    does not import, and the reason the lowering gives for the reference names the install. In a
    fresh interpreter: the module caches of this one hold cute_kernels already."""
    pytest.importorskip("cutlass")
    code = "import sys; sys.modules['tvm_ffi'] = None\nfrom lowering import backend\nprint(backend._cute_interface()[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "cute_kernels unavailable (cute_kernels launches its kernels through TVM-FFI: pip install 'apache-tvm-ffi==" in out.stdout


def test_kernels_know_the_kinds_and_parameters_of_moe_ops():
    """The kernels' epilogue and moe_ops' activation table list the same kinds and the same parameters
    per kind: a kind the kernels did not know would be declined, and a parameter the epilogue thought
    unread would be dropped from its compile key (two limits sharing one compiled kernel)."""
    from cute_kernels import interface
    from cute_kernels.moe_gemm import READS

    from moe_ops.activation import ACTIVATIONS, PARAMETERS

    assert set(interface.ACTIVATIONS) == set(ACTIVATIONS)
    assert READS == PARAMETERS
