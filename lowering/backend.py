"""Which implementation runs a fused op: a CuTe DSL kernel (cute_kernels) or the reference composition.

The choice depends only on the recipe (op arguments), the dtype and the device, so explain() can make
it at compile time from the graph's fake tensors and the op makes the same one at run time; only a
tensor whose address is off a 16-byte boundary (a view into another buffer), which fake tensors cannot
show, turns a call explain() reported as a kernel call into a reference one, with its warning. Nothing
falls back silently: explain() reports the reason, a CUDA call that no kernel serves warns once per
(op, reason) when it runs, and with `require_kernels` set (install(..., require_kernels=True) or
MOE_OPS_REQUIRE_KERNELS=1) it raises instead.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_ops import dequant_kernels, fp8_kernels, w4_kernels
from moe_ops.eager_kernels import COLUMN_MAJOR_REMEDY, gate_layout
from moe_ops.gemm import _A_PACKING
from moe_ops.quant import tiled

REQUIRE_KERNELS = {"value": os.environ.get("MOE_OPS_REQUIRE_KERNELS", "0") == "1"}


@dataclass(frozen=True)
class Choice:
    """Which backend runs one fused op's call and why; run(args) calls its kernel (None: the reference)."""

    backend: str  # "cute" or "reference"
    reason: str
    kernel: Callable | None = None

    def run(self, args: dict):
        return self.kernel(args)


def _cute_interface():
    """cute_kernels.interface, or None with the reason it cannot be imported."""
    try:
        from cute_kernels import interface
    except ImportError as e:  # the CuTe DSL is an optional dependency
        return None, f"cute_kernels unavailable ({e})"
    return interface, ""


def _contiguous(*tensors) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


def _run_gate_up(args: dict):
    from cute_kernels import interface

    out = interface.gate_up(
        args["x"], args["w"], args["bias"], args["expert_offsets"], args["gather_idx"],
        activation=args["activation"], alpha=args["alpha"], limit=args["limit"],
        gate_layout=gate_layout(args["activation"], args["interleaved"]), expert_ids=args["expert_ids"],
    )  # fmt: skip
    return out, out.new_empty((0,), dtype=torch.float32)


def _run_down_reduce(args: dict):
    from cute_kernels import interface

    norm = {} if args.get("norm_weight") is None else dict(norm_weight=args["norm_weight"], norm_eps=args["norm_eps"])
    return interface.down_reduce(
        args["a"], args["w"], args["bias"], args["expert_offsets"], args["topk_weights"], args["inverse"],
        weights_early=args["weights_early"], **norm,
    )


def _run_gate_up_dequant(args: dict):
    from cute_kernels import interface

    return dequant_kernels.gate_up(interface, gate_layout=gate_layout(args["activation"], args["interleaved"]), **args)


def _run_down_reduce_dequant(args: dict):
    from cute_kernels import interface

    return dequant_kernels.down_reduce(interface, **args)


# (op, quantized) -> the runner of a call the kernels serve.
_KERNELS = {
    ("gate_up", False): _run_gate_up,
    ("down_reduce", False): _run_down_reduce,
    ("gate_up", True): _run_gate_up_dequant,
    ("down_reduce", True): _run_down_reduce_dequant,
}


def _support(op: str, recipe: dict, interface) -> tuple[bool, str]:
    # A quantized recipe runs on weights (and activations) decoded to compute_dtype: the kernels are
    # asked about that recipe (dequant_kernels.py).
    quantized = recipe["quantized"]
    dtype = recipe["compute_dtype"]
    common = dict(
        dtype=dtype, weight_dtype=dtype if quantized else recipe["w_storage"], has_bias=recipe["has_bias"],
        hidden=recipe["hidden"], intermediate=recipe["intermediate"], num_experts=recipe["num_experts"],
        weight_row_major=quantized or recipe["w_row_major"],
    )  # fmt: skip
    if recipe["w_column_major"] and not quantized:
        # Before the contiguity check, which such a weight fails too: this reason says what to change.
        return False, interface.COLUMN_MAJOR + COLUMN_MAJOR_REMEDY
    if not recipe["contiguous"]:
        return False, "a non-contiguous input; the kernels take contiguous tensors"
    wide = {name: dtype for name, dtype in recipe["index_dtypes"].items() if dtype != torch.int32}
    if wide:
        given = ", ".join(f"{name} in {dtype}" for name, dtype in wide.items())
        return False, f"{given}; the kernels read int32 index tensors (the routing plan's)"
    if recipe["out_dtype"] != dtype:
        return False, f"output in {recipe['out_dtype']} from inputs in {dtype}; the kernels write the inputs' dtype"
    if op == "gate_up":
        ok, why = interface.gate_up_support(activation=recipe["activation"], gate_layout=gate_layout(recipe["activation"], recipe["interleaved"]), **common)
        n, k, which = recipe["n"], recipe["hidden"], "w13"
    else:
        if recipe["router_weight_dtype"] != torch.float32:
            return False, f"router weights in {recipe['router_weight_dtype']}; the kernels take float32"
        ok, why = interface.down_reduce_support(norm_dtype=recipe["norm_dtype"], **common)
        n, k, which = recipe["hidden"], recipe["intermediate"], "w2"
    if not ok or not quantized:
        return ok, why
    if _fp8(recipe):
        return True, fp8_kernels.reason(recipe["a_group"], recipe["w_group"]) + why
    if _w4(recipe):
        return True, (w4_kernels.TILED_REASON if tiled.is_tiled(recipe["w_dtype"]) else w4_kernels.REASON) + why
    if tiled.is_tiled(recipe["w_dtype"]):
        return False, w4_kernels.TILED_ONLY
    too_big = dequant_kernels.why_not(which, recipe["num_experts"], n, k, dtype)
    if too_big is not None:
        return False, too_big
    return True, dequant_kernels.REASON.format(dtype=dtype) + why


def _w4(recipe: dict) -> bool:
    """Whether a quantized recipe runs on the w4a16 kernels (w4_kernels.py) rather than decoded."""
    return w4_kernels.serves(
        recipe["a_dtype"], recipe["w_dtype"], recipe["w_group"], recipe["compute_dtype"], recipe.get("activation"),
        recipe.get("out_quant_dtype", "none"),
    )  # fmt: skip


def _fp8(recipe: dict) -> bool:
    """Whether a quantized recipe runs on the kernels' fp8 WGMMA (fp8_kernels.py) rather than decoded."""
    return fp8_kernels.serves(recipe["a_dtype"], recipe["a_group"], recipe["w_dtype"], recipe["w_group"], recipe["compute_dtype"])


def _choose(op: str, recipe: dict, device: torch.device, tensors: dict | None = None) -> Choice:
    """The backend of a call with this recipe on this device. tensors: a call's real tensors by argument
    name, whose addresses the kernels need aligned (explain() has fake ones and cannot check this)."""
    if device.type != "cuda":
        choice = Choice("reference", f"{device.type}: the CuTe DSL kernels run on CUDA GPUs (sm_90)")
    else:
        interface, why = _cute_interface()
        ok = interface is not None
        if ok:
            ok, why = interface.device_support(device)
        if ok:
            ok, why = _support(op, recipe, interface)
        if ok and tensors and (off := interface.misaligned(**tensors)) is not None:
            ok, why = False, off
        if ok:
            quantized = recipe["quantized"]
            label = ("cute+fp8" if _fp8(recipe) else "cute+w4" if _w4(recipe) else "cute+dequant") if quantized else "cute"
            choice = Choice(label, why, _KERNELS[op, quantized])
        else:
            choice = Choice("reference", why)
    if choice.kernel is None and device.type == "cuda" and REQUIRE_KERNELS["value"]:
        raise RuntimeError(f"moe_ops::{op}: no CuTe DSL kernel serves this recipe ({choice.reason}) and require_kernels is set")
    return choice


def _column_major(w: torch.Tensor) -> bool:
    """Whether each expert's [N, K] matrix is column-major and the experts dense: a transposed view of a
    contiguous [E, K, N] (not a row-major weight whose N or K is 1, which is both)."""
    return not w.is_contiguous() and w.transpose(1, 2).is_contiguous()


def _index_dtypes(args: dict, *names: str) -> dict:
    """The dtypes of the index tensors the kernels read through int32 pointers. The primitive ops take
    int64 ones too (a hand-written chain's own plan, a cumsum's offsets), so the recipe must name them."""
    return {name: args[name].dtype for name in names}


def gate_up_recipe(args: dict) -> dict:
    """The recipe of a gate_up call: what the kernel choice depends on (never tensor values)."""
    w = args["w"]
    gated = args["activation"] != "relu2"
    return dict(
        dtype=args["x"].dtype, compute_dtype=args["x"].dtype, w_storage=w.dtype, out_dtype=args["out_dtype"],
        a_dtype=args["a_dtype"], a_group=tuple(args["a_group"]), w_dtype=args["w_dtype"], w_group=tuple(args["w_group"]),
        has_bias=args["bias"] is not None, activation=args["activation"], alpha=float(args["alpha"]), n=w.shape[1],
        limit=float(args["limit"]), interleaved=bool(args["interleaved"]),
        out_quant_dtype=args["out_quant_dtype"], out_quant_group=tuple(args["out_quant_group"]),
        w_row_major=w.stride(2) == 1, w_column_major=_column_major(w), hidden=args["x"].shape[1], num_experts=w.shape[0],
        intermediate=w.shape[1] // 2 if gated else w.shape[1],
        quantized=args["a_dtype"] != "none" or args["w_dtype"] != "none" or args["out_quant_dtype"] != "none",
        contiguous=_contiguous(args["x"], w, args["bias"], args["expert_offsets"], args["gather_idx"]),
        index_dtypes=_index_dtypes(args, "expert_offsets", "gather_idx"),
    )  # fmt: skip


def down_reduce_recipe(args: dict) -> dict:
    """The recipe of a down_reduce call: what the kernel choice depends on (never tensor values)."""
    w = args["w"]
    # A quantized intermediate is decoded to the output's dtype for the kernels (dequant_kernels.py).
    compute = args["out_dtype"] if args["a_dtype"] != "none" else args["a"].dtype
    return dict(
        dtype=args["a"].dtype, compute_dtype=compute, w_storage=w.dtype, out_dtype=args["out_dtype"],
        a_dtype=args["a_dtype"], a_group=tuple(args["a_group"]), w_dtype=args["w_dtype"], w_group=tuple(args["w_group"]),
        has_bias=args["bias"] is not None, w_row_major=w.stride(2) == 1, w_column_major=_column_major(w), hidden=w.shape[1],
        intermediate=args["a"].shape[1] * _A_PACKING[args["a_dtype"]],  # GEMM2's K (a tiled w's shape holds none)
        num_experts=w.shape[0],
        quantized=args["a_dtype"] != "none" or args["w_dtype"] != "none",
        router_weight_dtype=args["topk_weights"].dtype,
        norm_dtype=args["norm_weight"].dtype if args.get("norm_weight") is not None else None,
        contiguous=_contiguous(
            args["a"], w, args["bias"], args["expert_offsets"], args["topk_weights"], args["inverse"], args.get("norm_weight")
        ),
        index_dtypes=_index_dtypes(args, "expert_offsets", "inverse"),
    )  # fmt: skip


# The tensors the kernels take by pointer, by op: their addresses decide too (interface.misaligned).
_POINTERS = {
    "gate_up": ("x", "w", "bias", "expert_offsets", "gather_idx"),
    "down_reduce": ("a", "w", "bias", "expert_offsets", "topk_weights", "inverse", "norm_weight"),
}


def _pointers(op: str, args: dict, recipe: dict) -> dict:
    names = _POINTERS[op]
    if _fp8(recipe):
        names += ("a_scale", "w_scale")  # read by the fp8 kernels; the decoder has no such need
    return {name: args.get(name) for name in names}


_WARNED: set[tuple[str, str]] = set()


def _at_run_time(op: str, recipe: dict, device: torch.device, tensors: dict | None = None) -> Choice:
    """_choose for a call about to run: a CUDA call that the reference serves warns, once per (op, reason).
    (explain() calls _choose itself, at compile time, and reports the reason instead.)"""
    choice = _choose(op, recipe, device, tensors)
    if choice.kernel is None and device.type == "cuda" and (op, choice.reason) not in _WARNED:
        _WARNED.add((op, choice.reason))
        warnings.warn(f"moe_ops::{op} runs the reference composition on {device}: {choice.reason}", stacklevel=3)
    return choice


def choose_gate_up(args: dict) -> Choice:
    """The backend for a gate_up call about to run with these arguments (the op's schema names)."""
    recipe = gate_up_recipe(args)
    return _at_run_time("gate_up", recipe, args["x"].device, _pointers("gate_up", args, recipe))


def choose_down_reduce(args: dict) -> Choice:
    """The backend for a down_reduce call about to run with these arguments (the op's schema names)."""
    recipe = down_reduce_recipe(args)
    return _at_run_time("down_reduce", recipe, args["a"].device, _pointers("down_reduce", args, recipe))
