"""The two fused ops the lowering puts in place of each MoE op chain.

moe_ops::gate_up    = gather rows + [quantize] + grouped GEMM1 (+ bias) + activation + [re-quantize]
    (x [M, H], ..., expert_offsets [E+1], gather_idx [P]) -> (intermediate [P, I'], scale)
    where the intermediate is GEMM2's input: quantized storage (I' = I / packing) with its scales when
    out_quant_dtype is not "none", else [P, I] in out_dtype with an empty float32 scale [0].
    expert_ids (default None): the routing plan's topk_ids [M, k] when they are the local experts (no
    expert_map); at M = 1 the kernel reads them before the plan completes, to start its weights
    early (cute_kernels/moe_gemm.py). A hint: the output depends on the plan only.
moe_ops::down_reduce = grouped GEMM2 (+ bias) + [post-expert norm] + router weight + reduction of
    each token's k rows
    (intermediate [P, I'], ..., expert_offsets, topk_weights [M, k], inverse [P]) -> [M, H];
    the router weight and the sum come after GEMM2, in the token sum, which finds each pair's grouped
    row by inverse. norm_weight [H] (default None): each of GEMM2's rows first goes through
    moe_ops::post_expert_norm with norm_eps (MuseSpark).
    weights_early (default False): w and expert_offsets were written before the kernel
    launched just before this op started, and that kernel writes neither, as when gate_up over the
    same plan comes right before it; the kernel then starts loading w before waiting for that kernel
    (graph_pass.py sets it where the graph proves it).

Each carries its recipe as op arguments (activation kind and parameters, quantization dtypes and
groups, bias presence), which is what cute_kernels specialises on. On the CPU (and on CUDA when no
kernel serves the recipe) they run the composition of moe_ops' reference ops; backend.py decides.
"""
from __future__ import annotations

import torch

from moe_ops import _checks
from moe_ops.activation import ACTIVATIONS, check_activation_recipe
from moe_ops.activation import activation as activation_op
from moe_ops.expert_norm import check_norm_args, post_expert_norm
from moe_ops.gemm import check_gemm_args, grouped_gemm
from moe_ops.quant import tiled
from moe_ops.quant.formats import scale_shape
from moe_ops.quant.quantize import _SCALE_DTYPE, ACTIVATION_STORAGE, check_quantize_recipe, quantize
from moe_ops.reduce import check_reduce_rows, weighted_reduce

from . import backend


def _quantize_or_pass(x, dtype, group, scale, global_scale):
    if dtype == "none":
        return x, None
    return quantize(x, dtype, group, scale, global_scale)


_QUANT_CHOICES = ("none", *ACTIVATION_STORAGE)


def check_gate_up_args(
    x, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, activation, alpha, limit, interleaved,
    out_quant_dtype, out_quant_group, out_scale, out_global_scale, out_dtype, expert_ids=None,
) -> None:  # fmt: skip
    """gate_up's arguments as its stages read them (shapes, dtypes and devices, no values: safe under
    compile), checked by the real and the fake impl alike before anything runs, so that a call the fake
    impl traced is one the real impl accepts, on the kernels' path as on the reference's."""
    _checks.expect_choice("a_dtype", a_dtype, _QUANT_CHOICES)
    _checks.expect_choice("out_quant_dtype", out_quant_dtype, _QUANT_CHOICES)
    # GEMM1 reads x as the float rows it quantizes: its K is x's width, whatever a_dtype.
    check_gemm_args(
        x, None, None, "none", a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, gather_idx, out_dtype, a_name="x",
    )  # fmt: skip
    if a_dtype != "none":
        check_quantize_recipe(a_dtype, a_group, a_scale, a_global_scale, x.shape[1],
                              names=("a_dtype", "a_group", "a_scale", "a_global_scale"))  # fmt: skip
    gated = check_activation_recipe(activation, interleaved)
    tiled.check_gemm1_format(w_dtype, gated, interleaved)
    n = w.shape[1]
    if gated and n % 2:
        raise ValueError(f"w: {activation!r} splits GEMM1's N={n} outputs into gate and up halves; N must be even, got shape {tuple(w.shape)}")
    if out_quant_dtype != "none":
        check_quantize_recipe(
            out_quant_dtype, out_quant_group, out_scale, out_global_scale, n // 2 if gated else n,
            names=("out_quant_dtype", "out_quant_group", "out_scale", "out_global_scale"), what="the intermediate",
        )  # fmt: skip
    if expert_ids is not None:
        _checks.expect_ndim("expert_ids", expert_ids, 2, "[M, k] (the routing plan's topk_ids)")
        _checks.expect_dtype("expert_ids", expert_ids, _checks.INDEX_DTYPES)
        # One id per routed pair is all the kernels read; x may hold more rows than the plan routes (a
        # hand-written chain over a padded buffer), so its row count is not compared.
        if expert_ids.numel() != gather_idx.shape[0]:
            raise ValueError(
                f"expert_ids: expected the plan's topk_ids [M, k] with M*k = {gather_idx.shape[0]} routed pairs, "
                f"got shape {tuple(expert_ids.shape)}"
            )
    _checks.expect_same_device(
        {"x": x, "w": w, "a_scale": a_scale, "a_global_scale": a_global_scale, "out_scale": out_scale,
         "out_global_scale": out_global_scale, "expert_ids": expert_ids}
    )  # fmt: skip


def gate_up_reference(
    x, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, activation, alpha, limit, interleaved,
    out_quant_dtype, out_quant_group, out_scale, out_global_scale, out_dtype, expert_ids=None,
):  # fmt: skip
    """The reference composition of gate_up: the primitive ops in chain order (expert_ids is the
    kernels' hint)."""
    a, s = _quantize_or_pass(x, a_dtype, a_group, a_scale, a_global_scale)
    h = grouped_gemm(
        a, s, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, gather_idx, out_dtype,
    )  # fmt: skip
    h = activation_op(h, activation, alpha, limit, interleaved)
    q, qs = _quantize_or_pass(h, out_quant_dtype, out_quant_group, out_scale, out_global_scale)
    return q, (qs if qs is not None else h.new_empty((0,), dtype=torch.float32))


@torch.library.custom_op("moe_ops::gate_up", mutates_args=())
def gate_up(
    x: torch.Tensor,
    a_scale: torch.Tensor | None,
    a_global_scale: torch.Tensor | None,
    a_dtype: str,
    a_group: list[int],
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_global_scale: torch.Tensor | None,
    w_zero: torch.Tensor | None,
    w_dtype: str,
    w_group: list[int],
    bias: torch.Tensor | None,
    expert_offsets: torch.Tensor,
    gather_idx: torch.Tensor,
    activation: str,
    alpha: float,
    limit: float,
    interleaved: bool,
    out_quant_dtype: str,
    out_quant_group: list[int],
    out_scale: torch.Tensor | None,
    out_global_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    expert_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gather + [quantize] + GEMM1 + activation + [re-quantize]; see the module docstring."""
    args = locals().copy()
    check_gate_up_args(**args)
    choice = backend.choose_gate_up(args)
    return choice.run(args) if choice.kernel is not None else gate_up_reference(**args)


@gate_up.register_fake
def _gate_up_fake(
    x, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, gather_idx, activation, alpha, limit, interleaved,
    out_quant_dtype, out_quant_group, out_scale, out_global_scale, out_dtype, expert_ids=None,
):  # fmt: skip
    check_gate_up_args(**locals())
    rows = gather_idx.shape[0]
    n = w.shape[1]
    inter = n // 2 if ACTIVATIONS[activation][0] else n
    if out_quant_dtype == "none":
        return x.new_empty((rows, inter), dtype=out_dtype), x.new_empty((0,), dtype=torch.float32)
    packing = 2 if out_quant_dtype == "nvfp4" else 1
    sr, sc = scale_shape((out_quant_group[0], out_quant_group[1]), rows, inter)
    return (
        x.new_empty((rows, inter // packing), dtype=ACTIVATION_STORAGE[out_quant_dtype]),
        x.new_empty((sr, sc), dtype=_SCALE_DTYPE[out_quant_dtype]),
    )


def check_down_reduce_args(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, topk_weights, inverse, out_dtype, weights_early=False, norm_weight=None, norm_eps=1e-6,
) -> None:  # fmt: skip
    """down_reduce's arguments, as check_gate_up_args: GEMM2 over a's rows, [their norm,] then each
    token's k rows, which inverse indexes ([P], P = M*k)."""
    check_gemm_args(
        a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, None, out_dtype,
    )  # fmt: skip
    tiled.check_gemm2_format(w_dtype)
    check_reduce_rows(f"a {tuple(a.shape)}", a.shape[0], topk_weights, inverse, expert_offsets)
    _checks.expect_same_device({"a": a, "topk_weights": topk_weights, "inverse": inverse, "norm_weight": norm_weight})
    if norm_weight is not None:
        # GEMM2's rows as the norm reads them: [P, H] in out_dtype
        check_norm_args(a.new_empty((0, w.shape[1]), dtype=out_dtype), norm_weight, norm_eps)


def down_reduce_reference(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, topk_weights, inverse, out_dtype, weights_early=False, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    """The reference composition of down_reduce (weights_early is for the kernels' launch order)."""
    y = grouped_gemm(
        a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
        bias, expert_offsets, None, out_dtype,
    )  # fmt: skip
    if norm_weight is not None:
        y = post_expert_norm(y, norm_weight, norm_eps)
    return weighted_reduce(y, topk_weights, inverse, expert_offsets)


@torch.library.custom_op("moe_ops::down_reduce", mutates_args=())
def down_reduce(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    a_global_scale: torch.Tensor | None,
    a_dtype: str,
    a_group: list[int],
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_global_scale: torch.Tensor | None,
    w_zero: torch.Tensor | None,
    w_dtype: str,
    w_group: list[int],
    bias: torch.Tensor | None,
    expert_offsets: torch.Tensor,
    topk_weights: torch.Tensor,
    inverse: torch.Tensor,
    out_dtype: torch.dtype,
    weights_early: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Fused GEMM2 + [post-expert norm] + router weight + per-token reduction; see the module docstring."""
    args = locals().copy()
    check_down_reduce_args(**args)
    choice = backend.choose_down_reduce(args)
    return choice.run(args) if choice.kernel is not None else down_reduce_reference(**args)


@down_reduce.register_fake
def _down_reduce_fake(
    a, a_scale, a_global_scale, a_dtype, a_group, w, w_scale, w_global_scale, w_zero, w_dtype, w_group,
    bias, expert_offsets, topk_weights, inverse, out_dtype, weights_early=False, norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    check_down_reduce_args(**locals())
    return a.new_empty((topk_weights.shape[0], w.shape[1]), dtype=out_dtype)
