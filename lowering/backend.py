"""Which implementation runs a fused op: a CuTe DSL kernel (cute_kernels) or the reference composition.

The choice depends only on the recipe (op arguments), the dtype and the device, so explain() can make
it at compile time from the graph's fake tensors and the op makes the same one at run time. Nothing
falls back silently: explain() reports the reason, and with `require_kernels` set (install(...,
require_kernels=True) or MOE_OPS_REQUIRE_KERNELS=1) a CUDA call that no kernel serves raises instead.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

REQUIRE_KERNELS = {"value": os.environ.get("MOE_OPS_REQUIRE_KERNELS", "0") == "1"}


@dataclass(frozen=True)
class Choice:
    backend: str  # "cute" or "reference"
    reason: str
    kernel: Callable | None = None

    def run(self, args: dict):
        return self.kernel(**args)


def _cute_interface():
    """cute_kernels.interface, or None with the reason it cannot be imported."""
    try:
        from cute_kernels import interface
    except ImportError as e:  # the CuTe DSL is an optional dependency
        return None, f"cute_kernels unavailable ({e})"
    return interface, ""


def _choose(op: str, recipe: dict, device: torch.device) -> Choice:
    if device.type != "cuda":
        return Choice("reference", f"{device.type}: the CuTe DSL kernels run on CUDA GPUs (sm_90)")
    interface, why = _cute_interface()
    if interface is None:
        choice = Choice("reference", why)
    else:
        kernel, reason = interface.find_kernel(op, recipe, device)
        choice = Choice("cute", reason, kernel) if kernel is not None else Choice("reference", reason)
    if choice.kernel is None and REQUIRE_KERNELS["value"]:
        raise RuntimeError(f"moe_ops::{op}: no CuTe DSL kernel serves this recipe ({choice.reason}) and require_kernels is set")
    return choice


def gate_up_recipe(args: dict) -> dict:
    """The recipe of a gate_up call: everything but the tensors' values."""
    return dict(
        x_dtype=args["x"].dtype, w_storage=args["w"].dtype, out_dtype=args["out_dtype"],
        a_dtype=args["a_dtype"], a_group=tuple(args["a_group"]), w_dtype=args["w_dtype"], w_group=tuple(args["w_group"]),
        has_bias=args["bias"] is not None, activation=args["activation"], alpha=float(args["alpha"]),
        limit=float(args["limit"]), interleaved=bool(args["interleaved"]),
        out_quant_dtype=args["out_quant_dtype"], out_quant_group=tuple(args["out_quant_group"]),
        w_row_major=args["w"].stride(2) == 1,
    )  # fmt: skip


def down_reduce_recipe(args: dict) -> dict:
    return dict(
        a_storage=args["a"].dtype, w_storage=args["w"].dtype, out_dtype=args["out_dtype"],
        a_dtype=args["a_dtype"], a_group=tuple(args["a_group"]), w_dtype=args["w_dtype"], w_group=tuple(args["w_group"]),
        has_bias=args["bias"] is not None, w_row_major=args["w"].stride(2) == 1,
    )  # fmt: skip


def choose_gate_up(args: dict) -> Choice:
    return _choose("gate_up", gate_up_recipe(args), args["x"].device)


def choose_down_reduce(args: dict) -> Choice:
    return _choose("down_reduce", down_reduce_recipe(args), args["a"].device)
