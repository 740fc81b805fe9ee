"""fused_experts: the MoE experts computation as a chain of moe_ops custom ops.

routing_plan -> [quantize] -> grouped_gemm (gathers tokens) -> activation -> [quantize] -> grouped_gemm
-> [post_expert_norm] -> weighted_reduce. Each op appears as one node in a compiled graph, which is what
the lowering fuses. An eager call on a Hopper GPU runs the CuTe DSL kernels directly instead (eager_kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks, eager_kernels
from .activation import Activation, resolve_activation
from .activation import activation as activation_op
from .backends import check_device_supports
from .expert_norm import PostExpertNorm, post_expert_norm as post_expert_norm_op
from .gemm import grouped_gemm
from .plan import routing_plan
from .quant import tiled
from .quant.config import QuantConfig
from .quant.quantize import quantize
from .quant.scheme import UNQUANTIZED, ActivationQuant, op_args
from .reduce import weighted_reduce


_UNQUANTIZED_CONFIG = QuantConfig(UNQUANTIZED)


@dataclass(frozen=True)
class LayerShape:
    """The layer's sizes as fused_experts' arguments give them, after their checks."""

    num_experts: int  # local experts (w13.shape[0])
    hidden: int
    intermediate: int
    n13: int  # rows of each expert's w13: 2I gated, I otherwise
    top_k: int


def _check_expert_map(expert_map, num_experts: int) -> int:
    """expert_map [E_global] of -1 or local ids (eager: values checked); returns E_global (E without one)."""
    if expert_map is None:
        return num_experts
    _checks.expect_tensor("expert_map", expert_map)
    _checks.expect_ndim("expert_map", expert_map, 1, "[E_global]")
    _checks.expect_dtype("expert_map", expert_map, _checks.INDEX_DTYPES)
    _checks.expect_values_in_range("expert_map", expert_map, -1, num_experts, f"-1 or a local expert id < E={num_experts}")
    return expert_map.shape[0]


def check_inputs(
    hidden_states, w13, w2, topk_weights, topk_ids, act: Activation, config: QuantConfig, w13_bias, w2_bias, expert_map,
    norm: PostExpertNorm | None = None, check_ids: bool = True,
) -> LayerShape:
    """Validate everything fused_experts receives; raise ValueError/TypeError naming the argument.
    check_ids=False skips the eager value check of topk_ids (for ids from moe_ops.route)."""
    for name, t in (("hidden_states", hidden_states), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        _checks.expect_tensor(name, t)
    for name, t in (("w13_bias", w13_bias), ("w2_bias", w2_bias), ("expert_map", expert_map)):
        if t is not None:
            _checks.expect_tensor(name, t)
    _checks.expect_ndim("hidden_states", hidden_states, 2, "[M, H]")
    _checks.expect_dtype("hidden_states", hidden_states, _checks.FLOAT_DTYPES)
    _checks.expect_last_dim_contiguous("hidden_states", hidden_states)
    _checks.expect_ndim("w13", w13, 3, "[E, 2I, H] (or [E, I, H] without a gate)")
    _checks.expect_ndim("w2", w2, 3, "[E, H, I]")
    _checks.expect_ndim("topk_weights", topk_weights, 2, "[M, k]")
    _checks.expect_ndim("topk_ids", topk_ids, 2, "[M, k]")
    _checks.expect_dtype("topk_weights", topk_weights, (torch.float32,))
    _checks.expect_dtype("topk_ids", topk_ids, _checks.INDEX_DTYPES)
    device = _checks.expect_same_device(
        {"hidden_states": hidden_states, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids,
         "w13_bias": w13_bias, "w2_bias": w2_bias, "expert_map": expert_map,
         "post_expert_norm.weight": None if norm is None else norm.weight,
         **{f"quant_config.{k}": v for k, v in config.tensors().items()}}
    )  # fmt: skip
    m, hidden = hidden_states.shape
    num_experts = w13.shape[0]
    wq = config.scheme.weight
    # The weights' dtype before any size: packed codes read as another format's give sizes, and a size
    # error, that hide the cause (uint8 int4 codes without their quant_config said "w13 needs 32 rows").
    config.check_weight_dtypes(w13, w2)
    if config.scheme.tiled is not None:
        check_tiled_activation(act, config.scheme.tiled)
        intermediate = w13.shape[1] // 2  # a tiled w2's shape holds no K
    else:
        intermediate = w2.shape[2] * (1 if wq is None else wq.packing)
    n13 = 2 * intermediate if act.gated else intermediate
    if w2.shape[0] != num_experts:
        raise ValueError(f"w2: has {w2.shape[0]} experts, w13 has {num_experts}")
    if w2.shape[1] != hidden:
        raise ValueError(f"w2: expected shape [E, H={hidden}, I], got {tuple(w2.shape)}")
    if w13.shape[1] != n13:
        raise ValueError(
            f"w13: activation {act.kind!r} needs {n13} rows per expert ({'2I' if act.gated else 'I'} with I={intermediate} "
            f"from w2), got shape {tuple(w13.shape)}"
        )
    packing = 1 if wq is None else wq.packing
    if config.scheme.tiled is None and w13.shape[2] * packing != hidden:
        raise ValueError(f"w13: expected {hidden // packing} columns (H={hidden}), got shape {tuple(w13.shape)}")
    if wq is None:
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype != hidden_states.dtype:
                raise TypeError(f"{name}: dtype {w.dtype} differs from hidden_states' {hidden_states.dtype}; allowed: the same dtype")
            _checks.expect_matrix_layout(name, w)
    else:
        for name, w in (("w13", w13), ("w2", w2)):
            if not w.is_contiguous():
                raise ValueError(f"{name}: quantized ({wq.dtype}) weights must be contiguous, got strides {w.stride()}")
    config.check_weights(w13, w2, hidden, intermediate, n13)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != m:
        raise ValueError(
            f"topk_weights and topk_ids: expected both [M={m}, k], got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )
    top_k = topk_ids.shape[1]
    if top_k < 1:
        raise ValueError(f"topk_ids: top_k={top_k} (shape {tuple(topk_ids.shape)}); allowed: top_k >= 1")
    num_global = _check_expert_map(expert_map, num_experts)
    if top_k > num_global:
        raise ValueError(f"topk_ids: top_k={top_k} is larger than the number of experts E={num_global}")
    if norm is not None:
        _checks.expect_shape("post_expert_norm.weight", norm.weight, (hidden,), "[H]")
    for name, bias, n in (("w13_bias", w13_bias, n13), ("w2_bias", w2_bias, hidden)):
        if bias is not None:
            _checks.expect_tensor(name, bias)
            _checks.expect_shape(name, bias, (num_experts, n), "[E, N]")
            _checks.expect_dtype(name, bias, _checks.FLOAT_DTYPES)
    if check_ids:
        _checks.expect_values_in_range(
            "topk_ids", topk_ids, 0, num_global, "expert ids" + (" (global, indexing expert_map)" if expert_map is not None else "")
        )
    check_device_supports(config.name, device)
    return LayerShape(num_experts, hidden, intermediate, n13, top_k)


def check_tiled_activation(act: Activation, gates: str) -> None:
    """A layer tiled with WeightQuant.tiled = gates runs a gated activation reading its rows that way."""
    reads = tiled.gates_read(act.gated, act.interleaved)
    if reads != gates:
        got = f"{act.kind!r}" + (f" with {reads} gates" if reads else ", which has no gate")
        raise ValueError(
            f"activation: the weights were tiled for a gated activation with {gates} gates "
            f"(tile_mxfp4_weights' interleaved={gates == 'interleaved'}), got {got}"
        )


def _quantize_input(x: torch.Tensor, aq: ActivationQuant | None, t: dict):
    if aq is None:
        return x, None
    return quantize(x, aq.dtype, list(aq.group.astuple()), t["a_scale"], t["a_global_scale"])


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str | Activation = "silu",
    quant_config: QuantConfig | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    post_expert_norm: PostExpertNorm | None = None,
    _ids_from_route: bool = False,
) -> torch.Tensor:
    """The experts of a MoE layer: out[m] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(hidden_states[m]).

    hidden_states [M, H] (float32/bf16/fp16); w13 [E, 2I, H] = [gate; up] (or [E, I, H] for an activation
    without a gate; each expert's matrix row- or column-major), w2 [E, H, I]; topk_weights [M, k] float32;
    topk_ids [M, k] int32/int64. expert(x) = act(x @ w13[e].T + w13_bias[e]) @ w2[e].T + w2_bias[e].
    Quantized schemes store w13/w2 as QuantConfig describes (packed formats hold K/2 columns).
    expert_map [E_global] maps global ids to local ones, -1 for experts on other ranks (they contribute
    nothing). apply_router_weight_on_input multiplies the input by the weight instead (top_k == 1).
    post_expert_norm normalizes each expert's output before the router weights it (MuseSpark,
    expert_norm.py). Returns [M, H] in hidden_states' dtype.

    Eager calls check expert ids against [0, E_global) (a host sync); compiled and CUDA-graph-captured
    calls skip that check and treat an out-of-range id like an expert on another rank. (_ids_from_route,
    internal: FusedMoE's ids come from its own moe_ops.route, in range by construction, so its eager
    calls skip the check and its sync.) An eager call on
    an sm_90 GPU runs the CuTe DSL kernels where they serve it, else the op chain with a warning once
    per reason (eager_kernels.py); compiled, the chain is what the lowering fuses.
    """
    act = resolve_activation(activation)
    _checks.expect_bool("apply_router_weight_on_input", apply_router_weight_on_input)
    if post_expert_norm is not None and not isinstance(post_expert_norm, PostExpertNorm):
        raise TypeError(f"post_expert_norm: expected moe_ops.PostExpertNorm or None, got {type(post_expert_norm).__name__}")
    config = quant_config if quant_config is not None else _UNQUANTIZED_CONFIG
    if not isinstance(config, QuantConfig):
        raise TypeError(f"quant_config: expected moe_ops.QuantConfig or None, got {type(config).__name__}")
    for name, given, inside in (("w13_bias", w13_bias, config.w13_bias), ("w2_bias", w2_bias, config.w2_bias)):
        if given is not None and inside is not None:
            raise ValueError(f"{name}: given both as an argument and in quant_config; give it once")
    w13_bias = w13_bias if w13_bias is not None else config.w13_bias
    w2_bias = w2_bias if w2_bias is not None else config.w2_bias
    shape = check_inputs(
        hidden_states, w13, w2, topk_weights, topk_ids, act, config, w13_bias, w2_bias, expert_map, post_expert_norm,
        check_ids=not _ids_from_route,
    )
    if apply_router_weight_on_input:
        if shape.top_k != 1:
            raise ValueError(f"apply_router_weight_on_input: needs top_k == 1, got top_k={shape.top_k}")
        hidden_states = (hidden_states.float() * topk_weights).to(hidden_states.dtype)
        topk_weights = torch.ones_like(topk_weights)

    if eager_kernels.applies(hidden_states):
        x, weights = hidden_states.contiguous(), topk_weights.contiguous()
        interface, why = eager_kernels.why_not(x, w13, w2, weights, act, config, w13_bias, w2_bias, post_expert_norm)
        if why is None:
            return eager_kernels.run(
                interface, x, w13, w2, weights, topk_ids, act, w13_bias, w2_bias, expert_map, post_expert_norm, config
            )  # fmt: skip
        eager_kernels.warn_once(why, hidden_states.device)

    scheme = config.scheme
    out_dtype = hidden_states.dtype
    a_dtype, a_group = op_args(scheme.activation)
    w13_dtype, w2_dtype, w_group = tiled.weight_op_args(scheme.weight)
    t13, t2 = config.gemm("13"), config.gemm("2")

    offsets, gather_idx, inverse = routing_plan(topk_ids, shape.num_experts, expert_map)
    a1, a1_scale = _quantize_input(hidden_states, scheme.activation, t13)
    h = grouped_gemm(
        a1, a1_scale, t13["a_global_scale"], a_dtype, a_group,
        w13, t13["w_scale"], t13["w_global_scale"], t13["w_zero"], w13_dtype, w_group,
        w13_bias, offsets, gather_idx, out_dtype,
    )  # fmt: skip
    h = activation_op(h, act.kind, float(act.alpha), float(act.limit), act.interleaved)
    a2, a2_scale = _quantize_input(h, scheme.activation, t2)
    y = grouped_gemm(
        a2, a2_scale, t2["a_global_scale"], a_dtype, a_group,
        w2, t2["w_scale"], t2["w_global_scale"], t2["w_zero"], w2_dtype, w_group,
        w2_bias, offsets, None, out_dtype,
    )  # fmt: skip
    if post_expert_norm is not None:
        y = post_expert_norm_op(y, post_expert_norm.weight, float(post_expert_norm.eps))
    return weighted_reduce(y, topk_weights, inverse, offsets)


@torch.no_grad()
def expert_intermediates(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str | Activation = "silu",
    w13_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM2's inputs for float weights, for calibrating static activation scales: float32 [M*k, I], the
    routed pairs' act(hidden_states[m] @ w13[e].T + w13_bias[e]) grouped by expert (rows of pairs on
    other ranks are zero). hidden_states [M, H]; w13 [E, 2I, H] (or [E, I, H]) unquantized; topk_ids
    [M, k]. Computed in float32 with the reference ops, so it can run on samples before quantizing."""
    act = resolve_activation(activation)
    for name, t in (("hidden_states", hidden_states), ("w13", w13), ("topk_ids", topk_ids)):
        _checks.expect_tensor(name, t)
    for name, t in (("w13_bias", w13_bias), ("expert_map", expert_map)):
        if t is not None:
            _checks.expect_tensor(name, t)
    _checks.expect_ndim("hidden_states", hidden_states, 2, "[M, H]")
    _checks.expect_dtype("hidden_states", hidden_states, _checks.SOURCE_FLOAT_DTYPES)
    _checks.expect_ndim("w13", w13, 3, "[E, 2I, H] (or [E, I, H] without a gate)")
    _checks.expect_dtype("w13", w13, _checks.SOURCE_FLOAT_DTYPES)
    _checks.expect_ndim("topk_ids", topk_ids, 2, "[M, k]")
    _checks.expect_dtype("topk_ids", topk_ids, _checks.INDEX_DTYPES)
    num_experts, n13, hidden = w13.shape
    m = hidden_states.shape[0]
    if hidden != hidden_states.shape[1]:
        raise ValueError(f"w13: expected [E, N, H={hidden_states.shape[1]}] for hidden_states {tuple(hidden_states.shape)}, got {tuple(w13.shape)}")
    if act.gated and n13 % 2:
        raise ValueError(f"w13: activation {act.kind!r} splits each expert's {n13} rows into gate and up halves; N must be even, got {tuple(w13.shape)}")
    if topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids: expected [M={m}, k], got {tuple(topk_ids.shape)}")
    if w13_bias is not None:
        _checks.expect_shape("w13_bias", w13_bias, (num_experts, n13), "[E, N]")
        _checks.expect_dtype("w13_bias", w13_bias, _checks.SOURCE_FLOAT_DTYPES)
    num_global = _check_expert_map(expert_map, num_experts)
    _checks.expect_same_device(
        {"hidden_states": hidden_states, "w13": w13, "topk_ids": topk_ids, "w13_bias": w13_bias, "expert_map": expert_map}
    )
    _checks.expect_values_in_range("topk_ids", topk_ids, 0, num_global, "expert ids")
    offsets, gather_idx, _ = routing_plan(topk_ids, w13.shape[0], expert_map)
    bias = w13_bias.float() if w13_bias is not None else None
    h = grouped_gemm(
        hidden_states.float(), None, None, "none", [-1, -1], w13.float(), None, None, None, "none", [-1, -1],
        bias, offsets, gather_idx, torch.float32,
    )  # fmt: skip
    return activation_op(h, act.kind, float(act.alpha), float(act.limit), act.interleaved)
