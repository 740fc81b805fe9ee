"""Routing: router logits [M, E] -> (topk_weights float32 [M, k], topk_ids int32 [M, k]).

Methods (chosen by the arguments of `route`):
- softmax, renormalize=False: softmax over all experts, then the k largest probabilities (Mixtral-style
  without renormalization).
- softmax, renormalize=True: the k largest probabilities renormalized to sum to 1 (Mixtral, Qwen3-MoE).
- sigmoid: sigmoid scores, the k largest; renormalized if asked (Llama4's top-1 uses renormalize=False).
- grouped top-k (num_expert_group set): experts split into groups; groups ranked by the sum of their top-2
  selection scores when a correction bias is given (DeepSeek-V3) and by their best score otherwise
  (DeepSeek-V2); the topk_group best groups are kept and the k experts are chosen among them. The bias
  only steers selection: weights come from the unbiased scores.
Every method finally multiplies the weights by routed_scaling_factor.

NaN logits never crash routing: they rank below every number, the ids stay in [0, E), and the weights
of a row with NaN logits are NaN (the routing is undefined there, and the output says so).
"""
from __future__ import annotations

from numbers import Real

import torch

from . import _checks, forward_only

SCORING = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
}


def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; NaN ranks last."""
    return torch.nan_to_num(scores, nan=float("-inf")).topk(k, dim=-1).indices


def _group_mask(
    selection: torch.Tensor, num_groups: int, topk_group: int, by_top2_sum: bool
) -> torch.Tensor:
    m, e = selection.shape
    grouped = torch.nan_to_num(selection, nan=float("-inf")).view(m, num_groups, e // num_groups)
    if by_top2_sum:
        group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
    else:
        group_score = grouped.amax(dim=-1)
    keep = group_score.topk(topk_group, dim=-1).indices
    mask = torch.zeros(m, num_groups, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, keep, True)
    return mask.repeat_interleave(e // num_groups, dim=1)


@torch.library.custom_op("moe_ops::route", mutates_args=())
def route_op(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing on any device. num_expert_group == 0 means no grouping."""
    scores = SCORING[scoring](router_logits.float())
    selection = scores
    if e_score_correction_bias is not None:
        selection = scores + e_score_correction_bias.float()
    if num_expert_group > 0:
        mask = _group_mask(selection, num_expert_group, topk_group, e_score_correction_bias is not None)
        selection = selection.masked_fill(~mask, float("-inf"))
    ids = _select(selection, top_k)
    weights = scores.gather(1, ids)
    # A row with a NaN logit has no defined routing: say so in its weights, whatever was picked
    # (sigmoid scores of the other experts would otherwise look valid). masked_fill keeps the strides.
    weights = weights.masked_fill(router_logits.isnan().any(dim=-1, keepdim=True), float("nan"))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


@route_op.register_fake
def _route_fake(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale):
    m = router_logits.shape[0]
    return (
        router_logits.new_empty((m, top_k), dtype=torch.float32),
        router_logits.new_empty((m, top_k), dtype=torch.int32),
    )


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose top_k experts per token.

    router_logits [M, E] (float32/bf16/fp16) -> (topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]).
    See the module docstring for the methods. Grouped top-k needs num_expert_group dividing E and
    1 <= topk_group <= num_expert_group, with top_k experts available in the kept groups.
    """
    _checks.expect_tensor("router_logits", router_logits)
    _checks.expect_ndim("router_logits", router_logits, 2, "[M, E]")
    _checks.expect_dtype("router_logits", router_logits, _checks.FLOAT_DTYPES)
    _checks.expect_choice("scoring", scoring, SCORING)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: got {top_k!r}; allowed: an int in [1, E={num_experts}]")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group and topk_group: got {num_expert_group!r} and {topk_group!r}; "
            "allowed: both None or both set"
        )
    for name, v in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{name}: got {v!r}; allowed: an int or None")
    if not isinstance(routed_scaling_factor, Real) or isinstance(routed_scaling_factor, bool):
        raise TypeError(
            f"routed_scaling_factor: expected a real number, got {type(routed_scaling_factor).__name__} {routed_scaling_factor!r}"
        )
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(
                f"num_expert_group: got {num_expert_group}; allowed: a divisor of E={num_experts}"
            )
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group: got {topk_group}; allowed: 1 to num_expert_group={num_expert_group}")
        if top_k > topk_group * (num_experts // num_expert_group):
            raise ValueError(
                f"top_k: got {top_k}; the {topk_group} kept groups hold only "
                f"{topk_group * (num_experts // num_expert_group)} experts"
            )
    if e_score_correction_bias is not None:
        _checks.expect_tensor("e_score_correction_bias", e_score_correction_bias)
        _checks.expect_shape("e_score_correction_bias", e_score_correction_bias, (num_experts,), "[E]")
        _checks.expect_dtype("e_score_correction_bias", e_score_correction_bias, _checks.FLOAT_DTYPES)
        _checks.expect_same_device(
            {"router_logits": router_logits, "e_score_correction_bias": e_score_correction_bias}
        )
    return route_op(
        router_logits,
        top_k,
        scoring,
        renormalize,
        num_expert_group or 0,
        topk_group or 0,
        e_score_correction_bias,
        float(routed_scaling_factor),
    )


forward_only.register(route_op)
