"""explain()'s per-layer table for chains a fused_experts layer cannot write (its two GEMMs quantized
differently: one weight quantized and the other not, only GEMM2's input quantized), and its backend
column under require_kernels."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowering
from moe_ops import quant as Q
from moe_ops.activation import activation as activation_op
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant.quantize import quantize
from moe_ops.reduce import weighted_reduce

from . import cases
from .test_pass import _meta_gate_up_args, _one_layer_verdict, inputs

NONE = [-1, -1]


class MixedRecipes(nn.Module):
    """A chain written with the primitive ops (H=128, E=4, as _one_layer_verdict's inputs) whose GEMMs
    differ: `w13_int4` quantizes GEMM1's weights only (int4 1x64 with zero points, GEMM2's stay
    float32), `act_fp8` quantizes GEMM2's input only (fp8 per row, so gate_up re-quantizes its output
    while x stays unquantized)."""

    def __init__(self, w13_int4: bool, act_fp8: bool):
        super().__init__()
        w13, w2 = cases.float_weights(4, 128, 64)
        self.w13_int4, self.act_fp8 = w13_int4, act_fp8
        scale = zero = None
        if w13_int4:
            scheme = Q.QuantScheme(None, Q.WeightQuant("int4", Q.GroupShape(1, 64), zero_point=True))
            w13, _, config = Q.quantize_weights(scheme, w13, w2)
            scale, zero = config.gemm("13")["w_scale"], config.gemm("13")["w_zero"]
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", scale)
        self.register_buffer("w13_zero", zero)
        self.register_buffer("w2", w2)

    def forward(self, x, topk_weights, topk_ids):
        if x.shape[1] != self.w2.shape[1]:
            raise ValueError(f"x: expected [M, {self.w2.shape[1]}], got {tuple(x.shape)}")
        offsets, gather_idx, inverse = routing_plan(topk_ids, 4, None)
        w_dtype, w_group = ("int4", [1, 64]) if self.w13_int4 else ("none", NONE)
        h = grouped_gemm(x, None, None, "none", NONE, self.w13, self.w13_scale, None, self.w13_zero, w_dtype, w_group,
                         None, offsets, gather_idx, x.dtype)  # fmt: skip
        a = activation_op(h, "silu", 1.702, 7.0, False)
        s, a_dtype, a_group = None, "none", NONE
        if self.act_fp8:
            a_dtype, a_group = "fp8", [1, -1]
            a, s = quantize(a, a_dtype, a_group, None, None)
        y = grouped_gemm(a, s, None, a_dtype, a_group, self.w2, None, None, None, "none", NONE, None, offsets, None, x.dtype)
        return weighted_reduce(y, topk_weights, inverse, offsets)


@pytest.mark.parametrize(
    "w13_int4, act_fp8, recipe",
    [
        # Each GEMM's weight quantization: showing w13's alone read as if w2 were int4 too.
        (True, False, "act=silu; a-quant=none; w-quant=int4 1x64 zero-point (w13), none (w2); re-quant=none; bias=no"),
        # The re-quantization is gate_up's out_quant_* (GEMM2's input), not its a-quant (GEMM1's input).
        (False, True, "act=silu; a-quant=none; w-quant=none; re-quant=fp8 per-row; bias=no"),
    ],
    ids=["w13_int4_only", "gemm2_input_fp8_only"],
)
def test_explain_recipe_of_gemms_quantized_differently(w13_int4, act_fp8, recipe):
    """The fused layer's recipe text reads each GEMM's own quantization; the layer is fused and compiled
    equals eager."""
    model = MixedRecipes(w13_int4, act_fp8)
    _one_layer_verdict(model, fusable=True)
    (row,) = lowering.explain(model, *inputs(128, 4, torch.float32)).layers
    assert row.recipe == recipe


def test_explain_backend_column_under_require_kernels(monkeypatch):
    """With require_kernels set, a CUDA layer no kernel serves would raise when it runs; explain(), which
    only reports, must write that in the backend column ('none (...)') rather than raise itself. (On a
    CPU machine: the device check is stubbed to a Hopper GPU, fake tensors need no memory.)"""
    from cute_kernels import interface
    from lowering import backend
    from lowering.explain import _backend_text

    monkeypatch.setattr(interface, "device_support", lambda device: (True, "a Hopper GPU"))
    monkeypatch.setitem(backend.REQUIRE_KERNELS, "value", True)
    cuda = torch.device("cuda")
    assert _backend_text("gate_up", _meta_gate_up_args(), cuda).startswith("gate_up: cute (")
    text = _backend_text("gate_up", _meta_gate_up_args(out_dtype=torch.float32), cuda)
    assert text.startswith("gate_up: none (moe_ops::gate_up: no CuTe DSL kernel serves this recipe (output in torch.float32")
    assert text.endswith("and require_kernels is set)")
