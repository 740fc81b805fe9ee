"""Eager fused_experts on a Hopper GPU: the CuTe DSL kernels (cute_kernels.interface) instead of the op chain.

Compiled, fused_experts is the chain of moe_ops ops that the lowering replaces with its two fused ops. An
eager call has no compiler to do that: run op by op on the GPU, the chain is the reference (torch's
grouped_mm with float32 intermediates: 54-58 kernels per call of the qwen3 and gpt-oss shapes). So an
eager call whose recipe the kernels serve runs them directly, as the lowering's fused ops would: the
routing plan, then gate_up (gather + GEMM1 + activation) and down_reduce (GEMM2 + the router-weighted
token sum), four launches, the same outputs bit for bit as the compiled layer's (bench/NOTES.md v41
has the times). A quantized scheme runs them on weights decoded per call (dequant_kernels.py). The op
chain still runs where it must:
- under torch.compile, torch.export and torch.jit.trace (a tracer records the chain's ops), on tensors
  without values (fake, meta) and off CUDA;
- where the kernels cannot serve the call: in grad mode with an input that requires grad (the chain's
  ops carry the backward that raises, forward_only.py; the kernels' output would have no grad_fn at
  all), another GPU than sm_90, column-major weights, ... Such a CUDA call warns
  once per reason: nothing falls back silently (the lowering's fused ops warn the same way).
"""
from __future__ import annotations

import warnings

import torch

from . import _checks, dequant_kernels, fp8_kernels, w4_kernels
from .activation import ACTIVATIONS, Activation
from .quant.config import QuantConfig
from .quant import tiled
from .quant.scheme import op_args

# Where column-major experts usually come from (transformers' transposed experts: gpt-oss, Aria), and
# the one call that re-stores them for the kernels (the lowering's reason says it too).
COLUMN_MAJOR_REMEDY = (
    " (a transformers model's transposed experts: moe_ops.integrations.transformers.row_major_experts(model) "
    "re-stores them once)"
)

_WARNED: set[str] = set()


def _interface():
    """cute_kernels.interface, or None with the reason it cannot be imported (an optional dependency)."""
    try:
        from cute_kernels import interface
    except ImportError as e:
        return None, f"cute_kernels unavailable ({e})"
    return interface, ""


def applies(t: torch.Tensor) -> bool:
    """Whether a call on t may leave the op chain for the kernels: t is a real CUDA tensor and no tracer
    records the call (torch.compile, torch.export, torch.jit.trace: each records ops, and would miss
    the kernels' launches). routing.route asks it too, to call its op's CUDA impl without the
    dispatcher."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return t.device.type == "cuda" and _checks.has_values(t)


def gate_layout(kind: str, interleaved: bool) -> str:
    """How the kernels read GEMM1's rows for an activation: "concat" ([gate; up]), "interleaved"
    (gate and up alternating) or "none" (no gate). The lowering's fused ops map their recipe with it too."""
    if not ACTIVATIONS[kind][0]:
        return "none"
    return "interleaved" if interleaved else "concat"


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None entries skipped): grad mode and one of
    them requires grad. Such a call needs the ops, which carry the backward that raises."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


GRAD = (
    "an input requires grad: the kernels have no backward, the ops' backward raises (forward_only.py); "
    "run under torch.no_grad() or torch.inference_mode() for the kernels"
)


def why_not(x, w13, w2, topk_weights, act: Activation, config: QuantConfig, w13_bias, w2_bias, norm=None) -> tuple[object, str | None]:
    """(interface, None) when the kernels serve this call (its arguments checked by fused_experts
    already), else (interface or None, the reason). norm: a PostExpertNorm or None."""
    norm_weight = norm.weight if norm is not None else None
    if needs_grad(x, w13, w2, topk_weights, w13_bias, w2_bias, norm_weight):
        return None, GRAD
    interface, why = _interface()
    if interface is None:
        return None, why
    ok, why = interface.device_support(x.device)
    if not ok:
        return interface, why
    num_experts, n13 = w13.shape[:2]
    hidden = x.shape[1]  # w13's K is packed (K/2) for 4-bit formats
    scheme = config.scheme
    quantized = scheme.activation is not None or scheme.weight is not None
    # Quantized weights are decoded to x's dtype (dequant_kernels.py): contiguous, so row-major.
    row_major = quantized or (w13.stride(2) == 1 and w2.stride(2) == 1)
    if not row_major:
        return interface, interface.COLUMN_MAJOR + COLUMN_MAJOR_REMEDY
    for name, t in (("w13", w13), ("w2", w2), ("w13_bias", w13_bias), ("w2_bias", w2_bias), ("post_expert_norm.weight", norm_weight)):
        if t is not None and not t.is_contiguous():
            return interface, f"{name}: strides {t.stride()} are not contiguous; the kernels take contiguous tensors"
    intermediate = n13 // 2 if scheme.tiled is not None else w2.shape[2] * (scheme.weight.packing if scheme.weight is not None else 1)
    common = dict(
        dtype=x.dtype, weight_dtype=x.dtype if quantized else w13.dtype, hidden=hidden, intermediate=intermediate,
        num_experts=num_experts, weight_row_major=True,
    )  # fmt: skip
    for ok, why in (
        interface.gate_up_support(activation=act.kind, gate_layout=gate_layout(act.kind, act.interleaved), has_bias=w13_bias is not None, **common),
        interface.down_reduce_support(
            has_bias=w2_bias is not None, norm_dtype=norm_weight.dtype if norm_weight is not None else None, **common
        ),
    ):
        if not ok:
            return interface, why
    (a_dtype, _), (w13_dtype, w2_dtype, w_group) = op_args(scheme.activation), tiled.weight_op_args(scheme.weight)
    w4 = w4_kernels.serves(a_dtype, w13_dtype, w_group, x.dtype, act.kind) and w4_kernels.serves(a_dtype, w2_dtype, w_group, x.dtype)
    if scheme.tiled is not None and not w4:
        return interface, w4_kernels.TILED_ONLY
    if quantized and not w4 and not fp8_kernels.serves(*op_args(scheme.activation), *op_args(scheme.weight), x.dtype):
        for which, n, k in (("w13", n13, hidden), ("w2", hidden, intermediate)):
            too_big = dequant_kernels.why_not(which, num_experts, n, k, x.dtype)
            if too_big is not None:
                return interface, too_big
    why = interface.misaligned(
        x=x, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias, topk_weights=topk_weights, norm_weight=norm_weight
    )
    return interface, why


def run(
    interface, x, w13, w2, topk_weights, topk_ids, act: Activation, w13_bias, w2_bias, expert_map, norm=None,
    config: QuantConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """fused_experts through the kernels, for a call why_not() accepted: [M, H] in x's dtype."""
    # The routing plan op's CUDA kernel, called directly: fused_experts checked its arguments already,
    # and the op's dispatch cost ~80 µs of host time per call in situ (bench/NOTES.md v41 item 3).
    # Imported here, as the op imports it: Triton's import is slow and only CUDA calls need it.
    from .plan_kernel import routing_plan_triton

    offsets, gather_idx, inverse = routing_plan_triton(topk_ids, w13.shape[0], expert_map)
    if config is not None and (config.scheme.activation is not None or config.scheme.weight is not None):
        ids = topk_ids if expert_map is None else None
        return _run_quantized(interface, x, w13, w2, topk_weights, act, w13_bias, w2_bias, norm, config, offsets, gather_idx, inverse, ids)
    h = interface.gate_up(
        x, w13, w13_bias, offsets, gather_idx, activation=act.kind, alpha=act.alpha, limit=act.limit,
        gate_layout=gate_layout(act.kind, act.interleaved), expert_ids=topk_ids if expert_map is None else None,
    )  # fmt: skip
    # GEMM2 may start loading w2 before GEMM1 ends: w2 and the offsets were written before GEMM1 launched.
    norm_args = {} if norm is None else dict(norm_weight=norm.weight, norm_eps=norm.eps)
    return interface.down_reduce(h, w2, w2_bias, offsets, topk_weights, inverse, weights_early=True, **norm_args)


def _run_quantized(interface, x, w13, w2, topk_weights, act, w13_bias, w2_bias, norm, config, offsets, gather_idx, inverse, expert_ids):
    """The quantized chain with the lowering's fused-op arguments, through dequant_kernels (the compiled
    layer calls the same two functions, so the two agree bit for bit). expert_ids: the kernels' M = 1
    weight hint (local ids), or None."""
    scheme = config.scheme
    (a_dtype, a_group), (w13_dtype, w2_dtype, w_group) = op_args(scheme.activation), tiled.weight_op_args(scheme.weight)
    t13, t2 = config.gemm("13"), config.gemm("2")
    q, q_scale = dequant_kernels.gate_up(
        interface, x=x, a_scale=t13["a_scale"], a_global_scale=t13["a_global_scale"], a_dtype=a_dtype, a_group=a_group,
        w=w13, w_scale=t13["w_scale"], w_global_scale=t13["w_global_scale"], w_zero=t13["w_zero"], w_dtype=w13_dtype,
        w_group=w_group, bias=w13_bias, expert_offsets=offsets, gather_idx=gather_idx, activation=act.kind,
        alpha=float(act.alpha), limit=float(act.limit), interleaved=act.interleaved,
        gate_layout=gate_layout(act.kind, act.interleaved), out_quant_dtype=a_dtype, out_quant_group=a_group,
        out_scale=t2["a_scale"], out_global_scale=t2["a_global_scale"], out_dtype=x.dtype, expert_ids=expert_ids,
    )  # fmt: skip
    return dequant_kernels.down_reduce(
        interface, a=q, a_scale=q_scale if a_dtype != "none" else None, a_global_scale=t2["a_global_scale"],
        a_dtype=a_dtype, a_group=a_group, w=w2, w_scale=t2["w_scale"], w_global_scale=t2["w_global_scale"],
        w_zero=t2["w_zero"], w_dtype=w2_dtype, w_group=w_group, bias=w2_bias, expert_offsets=offsets,
        topk_weights=topk_weights, inverse=inverse, out_dtype=x.dtype, weights_early=True,
        norm_weight=None if norm is None else norm.weight, norm_eps=1e-6 if norm is None else norm.eps,
    )  # fmt: skip


def warn_once(why: str, device: torch.device) -> None:
    """The chain runs on CUDA instead of the kernels: say so, once per reason."""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"moe_ops.fused_experts runs the reference ops on {device}: {why}", stacklevel=3)
