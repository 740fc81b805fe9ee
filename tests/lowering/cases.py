"""Small MoE models for the lowering tests: each builds its weights and example inputs on the CPU."""
from __future__ import annotations

import torch
from torch import nn

import moe_ops
from moe_ops import quant as Q
from moe_ops.activation import activation as activation_op
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant.quantize import quantize
from moe_ops.reduce import weighted_reduce
from moe_ops.reference import moe_float64


class Experts(nn.Module):
    """fused_experts over buffers (static shapes under dynamic=True, like a real model's parameters)."""

    def __init__(self, w13, w2, activation="silu", config=None, w13_bias=None, w2_bias=None):
        super().__init__()
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)
        self.activation = activation
        self.tensors = {}
        for name, t in (config.tensors() if config is not None else {}).items():
            if t is not None:
                self.register_buffer(name, t)
                self.tensors[name] = name
        self.scheme = config.scheme if config is not None else Q.UNQUANTIZED
        self.register_buffer("b13", w13_bias)
        self.register_buffer("b2", w2_bias)

        # Built here, not in forward: torch 2.11's Dynamo cannot build a QuantConfig in-graph.
        self.config = Q.QuantConfig(self.scheme, **{k: getattr(self, v) for k, v in self.tensors.items()})

    def forward(self, x, topk_weights, topk_ids):
        return moe_ops.fused_experts(
            x, self.w13, self.w2, topk_weights, topk_ids,
            activation=self.activation, quant_config=self.config, w13_bias=self.b13, w2_bias=self.b2,
        )  # fmt: skip


def routing(m: int, e: int, k: int):
    return moe_ops.route(torch.randn(m, e), k)


def float_weights(e, h, i, dtype=torch.float32, gated=True):
    w13 = torch.randn(e, (2 if gated else 1) * i, h) / h**0.5
    w2 = torch.randn(e, h, i) / i**0.5
    return w13.to(dtype), w2.to(dtype)


def quantized(scheme, e=4, h=256, i=128, dtype=torch.float32):
    w13, w2 = float_weights(e, h, i)
    x = torch.randn(16, h)
    inter = moe_ops.expert_intermediates(x, w13, routing(16, e, 2)[1])
    q13, q2, config = Q.quantize_weights(scheme, w13, w2, calibration=x, intermediate_calibration=inter)
    return Experts(q13, q2, config=config), h, e, dtype


def case_bf16_swiglu():
    w13, w2 = float_weights(4, 128, 64, torch.bfloat16)
    return Experts(w13, w2), 128, 4, torch.bfloat16


def case_fp8_block():
    scheme = Q.QuantScheme(Q.ActivationQuant("fp8", Q.GroupShape(1, 128)), Q.WeightQuant("fp8", Q.GroupShape(128, 128)))
    return quantized(scheme)


def case_fp8_per_tensor():
    scheme = Q.QuantScheme(Q.ActivationQuant("fp8", Q.PER_TENSOR), Q.WeightQuant("fp8", Q.PER_TENSOR))
    return quantized(scheme)


def case_int4_w4a16():
    return quantized(Q.QuantScheme(None, Q.WeightQuant("int4", Q.GroupShape(1, 64), zero_point=True)))


def case_gpt_oss():
    w13, w2 = float_weights(4, 128, 64)
    act = moe_ops.Activation("swigluoai", alpha=1.702, limit=7.0, interleaved=True)
    b13, b2 = torch.randn(4, 128) / 10, torch.randn(4, 128) / 10
    # gpt-oss checkpoints store [E, H, 2I]: a transposed view is column-major per expert.
    w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    return Experts(w13, w2, activation=act, w13_bias=b13, w2_bias=b2), 128, 4, torch.float32


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Experts(*float_weights(4, 128, 64)) for _ in range(2))

    def forward(self, x, topk_weights, topk_ids):
        for layer in self.layers:
            x = x + layer(x, topk_weights, topk_ids)
        return x


def case_two_layers():
    return TwoLayers(), 128, 4, torch.float32


class SecondUser(nn.Module):
    """A chain written with the primitive ops whose activation output is also returned (scaled, as a
    debugging hook might): not fusable. The second user is elementwise: a reduction there made
    torch 2.11's Inductor guard on its size (need_use_acc_helper) and recompile, which is not what
    these tests are about."""

    def __init__(self):
        super().__init__()
        w13, w2 = float_weights(4, 128, 64)
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, x, topk_weights, topk_ids):
        # The primitives do not check shapes; a model does (fused_experts would), which also keeps H
        # a constant rather than a symbol under dynamic=True.
        if x.shape[1] != self.w13.shape[2]:
            raise ValueError(f"x: expected [M, {self.w13.shape[2]}], got {tuple(x.shape)}")
        offsets, gather_idx, inverse = routing_plan(topk_ids, 4, None)
        none = [-1, -1]
        h = grouped_gemm(x, None, None, "none", none, self.w13, None, None, None, "none", none, None, offsets, gather_idx, x.dtype)
        a = activation_op(h, "silu", 1.702, 7.0, False)
        y = grouped_gemm(a, None, None, "none", none, self.w2, None, None, None, "none", none, None, offsets, None, x.dtype)
        return weighted_reduce(y, topk_weights, inverse, offsets), a * 2.0


def case_second_user():
    return SecondUser(), 128, 4, torch.float32


class Primitives(SecondUser):
    """The same chain without the second user: written with the primitive ops, and fusable."""

    def forward(self, x, topk_weights, topk_ids):
        return super().forward(x, topk_weights, topk_ids)[0]


def case_primitives():
    return Primitives(), 128, 4, torch.float32


class HandQuantized(nn.Module):
    """A chain written with the primitive ops whose first GEMM's input is quantized by hand:
    moe_ops.quantize makes it as `made` (dtype, group) with global scale `made_gs`, and the GEMM reads
    it as `read` with global scale `read_gs` ("made": the very same tensor as made_gs). Equal recipes
    (one global scale) are what fused_experts writes and are fusable; a quantize with another recipe
    than the GEMM's is not, since gate_up quantizes with the GEMM's. at="gemm2": the second GEMM's input
    is the one quantized by hand (and the first's is not), which is fusable whatever the two recipes:
    gate_up re-quantizes with the quantize's recipe and down_reduce reads with the GEMM's."""

    def __init__(self, made, read, made_gs=None, read_gs=None, at="gemm1"):
        super().__init__()
        self.at = at
        w13, w2 = float_weights(4, 128, 64)
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)
        self.register_buffer("made_gs", made_gs)
        self.register_buffer("read_gs", None if isinstance(read_gs, str) else read_gs)
        self.shared_gs = read_gs == "made"
        self.made, self.read = made, read

    def forward(self, x, topk_weights, topk_ids):
        if x.shape[1] != self.w13.shape[2]:
            raise ValueError(f"x: expected [M, {self.w13.shape[2]}], got {tuple(x.shape)}")
        offsets, gather_idx, inverse = routing_plan(topk_ids, 4, None)
        none = [-1, -1]
        read_gs = self.made_gs if self.shared_gs else self.read_gs

        def gemm(a, w, gather, hand_quantized):
            s, a_gs, a_dtype, a_group = None, None, "none", none
            if hand_quantized:
                a, s = quantize(a, self.made[0], self.made[1], None, self.made_gs)
                a_gs, (a_dtype, a_group) = read_gs, self.read
            return grouped_gemm(a, s, a_gs, a_dtype, a_group, w, None, None, None, "none", none, None, offsets, gather, x.dtype)

        h = gemm(x, self.w13, gather_idx, self.at == "gemm1")
        a = activation_op(h, "silu", 1.702, 7.0, False)
        y = gemm(a, self.w2, None, self.at == "gemm2")
        return weighted_reduce(y, topk_weights, inverse, offsets)


class MixedLayers(nn.Module):
    """MoE layers in the order `order` spells, F a fusable one (Experts) and U one that is not (SecondUser:
    its activation is also returned), each layer's input computed from the layer before's output. Returns
    the last layer's output and every U layer's side output."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.layers = nn.ModuleList(SecondUser() if c == "U" else Experts(*float_weights(4, 128, 64)) for c in order)

    def forward(self, x, topk_weights, topk_ids):
        sides = []
        for c, layer in zip(self.order, self.layers):
            y = layer(x, topk_weights, topk_ids)
            if c == "U":
                y, side = y
                sides.append(side)
            x = x + y
        return x, *sides


CASES = {
    "bf16_swiglu": case_bf16_swiglu,
    "fp8_block": case_fp8_block,
    "fp8_per_tensor": case_fp8_per_tensor,
    "int4_w4a16": case_int4_w4a16,
    "gpt_oss": case_gpt_oss,
    "two_layers": case_two_layers,
    "second_user": case_second_user,
    "primitives": case_primitives,
}


def inputs(h: int, e: int, dtype, m: int = 7, k: int = 2):
    topk_weights, topk_ids = routing(m, e, k)
    return torch.randn(m, h).to(dtype), topk_weights, topk_ids


def on(args: list, device) -> list:
    """An op's argument list with its tensors moved to `device`."""
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def layer_float64(layer: moe_ops.FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """moe_float64 of a FusedMoE for x [M, H]: its own routing and float weights, the intermediate
    rounded to x's dtype where that is narrower than float32 (as the layer stores it)."""
    tw, ti = layer.routing_for(x)
    w13, w2 = layer.float_weights()
    narrow = x.dtype if x.dtype != torch.float32 else None
    return moe_float64(x, w13, w2, tw, ti, activation=layer.activation, intermediate_dtype=narrow)
