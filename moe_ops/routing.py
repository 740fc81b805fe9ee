"""Routing: router logits [M, E] -> (topk_weights float32 [M, k], topk_ids int32 [M, k]).

Methods (chosen by the arguments of `route`):
- softmax, renormalize=False: softmax over all experts, then the k largest probabilities (Mixtral-style
  without renormalization).
- softmax, renormalize=True: the k largest probabilities renormalized to sum to 1 (Mixtral, Qwen3-MoE;
  also gpt-oss, whose softmax over the k largest logits is the same).
- sigmoid: sigmoid scores, the k largest; renormalized if asked (Llama4's top-1 uses renormalize=False).
- sqrtsoftplus: sqrt(softplus) scores, as sigmoid (DeepSeek-V4, with a correction bias, renormalized).
- grouped top-k (num_expert_group set): experts split into groups; groups ranked by the sum of their top-2
  selection scores when a correction bias is given (DeepSeek-V3) and by their best score otherwise
  (DeepSeek-V2); the topk_group best groups are kept and the k experts are chosen among them. The bias
  only steers selection: weights come from the unbiased scores.
Every method finally multiplies the weights by routed_scaling_factor.

Each row's ids come best first (by selection score: without a correction bias the logit itself, which
ranks as the exact score does), and an exact tie goes to the lower expert id, as in vLLM's routing
kernels, on every device: ties are common with bf16 logits (with E = 128, k = 8 and logits of standard
deviation 2, about 6% of tokens have one at the k-th place).

NaN logits never crash routing: they rank below every number, the ids stay in [0, E), and the weights
of a row with NaN logits are NaN (the routing is undefined there, and the output says so); a NaN
correction bias makes every row's weights NaN. So are the weights of a softmax row with a +inf logit or
with only -inf logits, where softmax is undefined (as in torch.softmax, hence in the models' own
routing); sigmoid scores take their limits 1 and 0 at +-inf,
and renormalizing k zero sigmoid scores (logits of -inf, or below about -104 in float32) gives NaN, as in
vLLM's grouped_topk.

On CUDA every method runs as one Triton kernel (route_kernel.py; the same ids, the weights to float32
rounding) for E up to 1024 (with expert groups: groups times group size, each rounded up to a power of
two); with larger E a CUDA call runs the reference ops below, as every other device does, and warns
once per size.
"""
from __future__ import annotations

import math
import warnings
from numbers import Real

import torch

from . import _checks, eager_kernels, forward_only

SCORING = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    # DeepSeek-V4: sqrt(softplus(x)), torch's softplus (x itself above 20).
    "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt(),
}


def _rank(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., n] -> int64 [..., k]: positions of the k largest scores, best first; an exact tie goes
    to the lower position and NaN ranks below every number (-inf included)."""
    # A stable sort rather than topk: topk breaks ties in no stated order, differently per device and
    # size (on the CPU, 8 equal scores give position 6 first), so equal bf16 logits would pick an expert
    # other than the model's kernels do (lower id wins) and differ between CPU and GPU.
    keys = torch.nan_to_num(scores, nan=float("-inf"))
    return keys.sort(dim=-1, descending=True, stable=True).indices[..., :k]


# How a group of experts is scored for the group ranking, by whether a correction bias is given:
# DeepSeek-V3 sums the group's two best selection scores, DeepSeek-V2 takes its best one.
GROUP_SCORE = {
    True: lambda grouped: grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1),
    False: lambda grouped: grouped.amax(dim=-1),
}


def _group_mask(selection: torch.Tensor, num_groups: int, topk_group: int, with_bias: bool) -> torch.Tensor:
    """selection [M, E] -> bool [M, E]: True for the experts of each row's topk_group best groups (E split
    into num_groups consecutive groups of E / num_groups)."""
    m, e = selection.shape
    grouped = torch.nan_to_num(selection, nan=float("-inf")).view(m, num_groups, e // num_groups)
    keep = _rank(GROUP_SCORE[with_bias](grouped), topk_group)
    mask = torch.zeros(m, num_groups, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, keep, True)
    return mask.repeat_interleave(e // num_groups, dim=1)


def check_route_args(
    router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, e_score_correction_bias, routed_scaling_factor
) -> None:  # fmt: skip
    """moe_ops::route's arguments as the op takes them (num_expert_group == topk_group == 0: no grouping),
    checked by its real and fake impl alike; shapes, dtypes and devices only (safe under compile)."""
    _checks.expect_tensor("router_logits", router_logits)
    _checks.expect_ndim("router_logits", router_logits, 2, "[M, E]")
    _checks.expect_dtype("router_logits", router_logits, _checks.FLOAT_DTYPES)
    _checks.expect_choice("scoring", scoring, SCORING)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"top_k: got {type(top_k).__name__} {top_k!r}; allowed: an int in [1, E={num_experts}]")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: got {top_k!r}; allowed: an int in [1, E={num_experts}]")
    # The op's schema takes a bool: None would silently mean False, anything else a RuntimeError.
    _checks.expect_bool("renormalize", renormalize)
    for name, v in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: got {type(v).__name__} {v!r}; allowed: an int or None")
    if not isinstance(routed_scaling_factor, Real) or isinstance(routed_scaling_factor, bool):
        raise TypeError(
            f"routed_scaling_factor: expected a real number, got {type(routed_scaling_factor).__name__} {routed_scaling_factor!r}"
        )
    # Comparisons, not math.isfinite: under torch.compile the factor may be a SymFloat.
    if not -math.inf < routed_scaling_factor < math.inf:
        raise ValueError(f"routed_scaling_factor: got {routed_scaling_factor!r}; allowed: a finite number")
    if num_expert_group == 0 and topk_group != 0:
        raise ValueError(f"topk_group: got {topk_group} without grouping (num_expert_group 0 or None); allowed: 0 or None")
    if num_expert_group != 0:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"num_expert_group: got {num_expert_group}; allowed: a divisor of E={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group: got {topk_group}; allowed: 1 to num_expert_group={num_expert_group}")
        kept_experts = topk_group * (num_experts // num_expert_group)
        if top_k > kept_experts:
            raise ValueError(
                f"top_k: got {top_k}; the {topk_group} kept groups hold only {kept_experts} experts; "
                f"allowed: at most topk_group * E / num_expert_group = {kept_experts}"
            )
    if e_score_correction_bias is not None:
        _checks.expect_tensor("e_score_correction_bias", e_score_correction_bias)
        _checks.expect_shape("e_score_correction_bias", e_score_correction_bias, (num_experts,), "[E]")
        _checks.expect_dtype("e_score_correction_bias", e_score_correction_bias, _checks.FLOAT_DTYPES)
        _checks.expect_same_device({"router_logits": router_logits, "e_score_correction_bias": e_score_correction_bias})


def _route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing on any device (the body of moe_ops::route):
    router_logits [M, E] -> (topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]), both contiguous.
    num_expert_group == 0 means no grouping. No host synchronisation: it only queues tensor ops."""
    check_route_args(
        router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, e_score_correction_bias, routed_scaling_factor
    )
    logits = router_logits.float()
    scores = SCORING[scoring](logits)
    if e_score_correction_bias is not None:
        selection = scores + e_score_correction_bias.float()
    else:
        # Every scoring is increasing in the logit, so the logits rank as the exact scores do; the
        # float32 scores would not: sigmoid is exactly 1.0 above a logit of ~16.6 (bf16 logits tie from
        # 13.44), and such distinct logits would tie and go to the lower id, where Llama4 takes the larger.
        selection = logits
    if num_expert_group > 0:
        mask = _group_mask(selection, num_expert_group, topk_group, e_score_correction_bias is not None)
        selection = selection.masked_fill(~mask, float("-inf"))
    ids = _rank(selection, top_k)
    weights = scores.gather(1, ids)
    # A row with a NaN logit has no defined routing: say so in its weights, whatever was picked
    # (sigmoid scores of the other experts would otherwise look valid). masked_fill keeps the strides.
    undefined = router_logits.isnan().any(dim=-1, keepdim=True)
    if e_score_correction_bias is not None:  # a NaN bias leaves every row's selection undefined
        undefined = undefined | e_score_correction_bias.isnan().any()
    weights = weights.masked_fill(undefined, float("nan"))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    # ids is a column slice of the sorted [M, E] order: with M <= 1 it counts as contiguous yet keeps the
    # stride E, so allocate the output's own contiguous strides (those of the fake impl).
    return weights.contiguous(), ids.to(torch.int32, memory_format=torch.contiguous_format)


route_op = torch.library.custom_op("moe_ops::route", _route, mutates_args=())

_WARNED: set[str] = set()


@route_op.register_kernel("cuda")
def _route_cuda(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale):
    """One Triton kernel (route_kernel.py) where it serves the sizes, else the reference ops above. The
    same ids and, to float32 rounding, the same weights either way."""
    check_route_args(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale)
    return _run_cuda(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale)


def _run_cuda(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale):
    """_route_cuda on arguments already checked."""
    from .route_kernel import route_triton, why_not

    why = why_not(router_logits.shape[1], num_expert_group)
    if why is None:
        return route_triton(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale)
    if why not in _WARNED:  # nothing falls back silently: once per reason, as the fused ops do
        _WARNED.add(why)
        warnings.warn(f"moe_ops::route runs the reference ops on {router_logits.device}: {why}", stacklevel=2)
    return _route(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale)


@route_op.register_fake
def _route_fake(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale):
    """Contiguous float32 and int32 [M, top_k], as _route returns."""
    check_route_args(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, scale)
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
    # None becomes the op's 0 (no grouping), so the pairing and the types of these two are checked first;
    # then everything, here (the op's schema would reject a wrong type with a bare RuntimeError) and in
    # the op's own impls (a compiled graph calls the op directly).
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group and topk_group: got {num_expert_group!r} and {topk_group!r}; "
            "allowed: both None or both set"
        )
    for name, v in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"{name}: got {type(v).__name__} {v!r}; allowed: an int or None")
    if num_expert_group == 0:  # 0 means "no grouping" to the op; here that is None
        _checks.expect_tensor("router_logits", router_logits)
        raise ValueError(f"num_expert_group: got 0; allowed: a divisor of E={router_logits.shape[-1]}, or None for no grouping")
    args = (router_logits, top_k, scoring, renormalize, num_expert_group or 0, topk_group or 0, e_score_correction_bias)
    check_route_args(*args, routed_scaling_factor)
    if eager_kernels.applies(router_logits) and not eager_kernels.needs_grad(router_logits, e_score_correction_bias):
        # An eager CUDA call that autograd does not need: the op's CUDA impl without the dispatcher, which
        # cost ~100 µs of host time per call (bench/NOTES.md v41 item 3). The same outputs.
        return _run_cuda(*args, float(routed_scaling_factor))
    return route_op(*args, float(routed_scaling_factor))


forward_only.register(route_op)
