"""Expert activations: the table of kinds, the Activation spec, and moe_ops::activation.

Gated kinds read GEMM1's output [R, 2I] as gate and up halves, either concatenated ([gate | up], the
layout of w13 = [gate; up]) or interleaved (gate_0, up_0, gate_1, up_1, ..., gpt-oss checkpoints), and
return [R, I]; relu2 has no gate and maps [R, I] to [R, I]. Computed in float32, returned in x's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch
import torch.nn.functional as F

from . import _checks, forward_only


def _swigluoai(gate, up, alpha, limit):
    # gpt-oss: the gate is clamped from above only, the up projection on both sides, and 1 is added to it.
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def _silu_clamped(gate, up, alpha, limit):
    # DeepSeek-V4, GLM-5-Next, Hunyuan-V4: gpt-oss's clamps on plain SiLU-and-mul (no alpha, no + 1).
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _softcap(x, cap):
    return cap * torch.tanh(x / cap)


def _swiglu_softcapped(gate, up, alpha, limit):
    # Inkling-2: the sigmoid sees the raw gate; tanh softcaps bound the linear gate factor (at alpha) and
    # the up projection (at limit), where the clamped kinds clip.
    return _softcap(gate, alpha) * torch.sigmoid(gate) * _softcap(up, limit)


# kind -> (gated, f(gate_or_x, up, alpha, limit))
ACTIVATIONS = {
    "silu": (True, lambda g, u, alpha, limit: F.silu(g) * u),
    "gelu": (True, lambda g, u, alpha, limit: F.gelu(g) * u),
    "gelu_tanh": (True, lambda g, u, alpha, limit: F.gelu(g, approximate="tanh") * u),
    "swigluoai": (True, _swigluoai),
    "silu_clamped": (True, _silu_clamped),
    "swiglu_softcapped": (True, _swiglu_softcapped),
    "relu2": (False, lambda x, u, alpha, limit: F.relu(x).square()),
}
# The parameters each kind reads, with the values an Activation takes when they are not given (the other
# kinds ignore alpha and limit, which then keep swigluoai's defaults). gpt-oss: 1.702 and 7.0; Inkling-2:
# softcaps of 4.0 (gate) and 25.0 (up).
DEFAULTS = {
    "swigluoai": {"alpha": 1.702, "limit": 7.0},
    "silu_clamped": {"limit": 7.0},
    "swiglu_softcapped": {"alpha": 4.0, "limit": 25.0},
}
PARAMETERS = {kind: tuple(values) for kind, values in DEFAULTS.items()}
# The parameters that bound values (clamps, softcaps: a softcap also divides by its cap), which must be > 0.
_BOUNDS = {"swigluoai": ("limit",), "silu_clamped": ("limit",), "swiglu_softcapped": ("alpha", "limit")}


def check_parameters(kind: str, alpha: float, limit: float) -> None:
    """The values of alpha and limit (their types are the caller's: the op's schema, or Activation): no
    NaN, and each bound the kind reads > 0. Comparisons only: under torch.compile they may be SymFloats."""
    values = {"alpha": alpha, "limit": limit}
    for name, v in values.items():
        if v != v:
            raise ValueError(f"activation.{name}: got nan; allowed: a number")
    for name in _BOUNDS.get(kind, ()):
        if not values[name] > 0:
            raise ValueError(f"activation.{name}: got {values[name]}; allowed: > 0")


@dataclass(frozen=True)
class Activation:
    """An expert activation. kind: a key of ACTIVATIONS; alpha and limit parameterise the kinds of
    PARAMETERS: swigluoai's sigmoid scale and clamp (gpt-oss: 1.702 and 7.0), silu_clamped's clamp,
    swiglu_softcapped's softcaps of the gate factor (alpha) and of up (limit; Inkling-2: 4.0 and 25.0).
    None (the default) takes the kind's value in DEFAULTS; interleaved: gate and up alternate along
    GEMM1's output."""

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None
    interleaved: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, str):
            raise TypeError(f"activation.kind: expected a str, got {type(self.kind).__name__} {self.kind!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation: got {self.kind!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")
        # An omitted parameter takes the kind's default (so Activation("swiglu_softcapped") is Inkling-2's
        # gate, not one with gpt-oss's numbers as softcaps).
        defaults = {**DEFAULTS["swigluoai"], **DEFAULTS.get(self.kind, {})}
        for name in ("alpha", "limit"):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, defaults[name])
            elif not isinstance(v, Real) or isinstance(v, bool):
                raise TypeError(f"activation.{name}: expected a real number, got {type(v).__name__} {v!r}")
        check_parameters(self.kind, self.alpha, self.limit)
        _checks.expect_bool("activation.interleaved", self.interleaved)
        if self.interleaved and not self.gated:
            raise ValueError(f"activation: {self.kind!r} has no gate, so interleaved=True means nothing")

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.kind][0]


def resolve_activation(activation) -> Activation:
    """A kind name or an Activation -> Activation."""
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return Activation(activation)
    raise TypeError(f"activation: expected a str or moe_ops.Activation, got {type(activation).__name__}")


def split_gate_up(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2I] -> (gate, up), each [rows, I] views: even and odd columns when interleaved, else the
    first and second halves."""
    if interleaved:
        return x[:, 0::2], x[:, 1::2]
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def check_activation_recipe(kind: str, interleaved: bool) -> bool:
    """kind is a known activation and interleaved means something for it; returns gated."""
    _checks.expect_choice("kind", kind, ACTIVATIONS)
    gated = ACTIVATIONS[kind][0]
    if interleaved and not gated:
        raise ValueError(f"interleaved: {kind!r} has no gate, so interleaved=True means nothing; allowed: False")
    return gated


def check_activation_args(x: torch.Tensor, kind: str, interleaved: bool) -> bool:
    """The op's arguments (shapes and dtypes only, no values: safe under compile); returns gated."""
    gated = check_activation_recipe(kind, interleaved)
    _checks.expect_ndim("x", x, 2, "[R, 2I] (gated) or [R, I]")
    _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
    if gated and x.shape[1] % 2:
        raise ValueError(
            f"x: {kind!r} splits each row into gate and up halves; the width must be even, got shape {tuple(x.shape)}"
        )
    return gated


@torch.library.custom_op("moe_ops::activation", mutates_args=())
def activation(x: torch.Tensor, kind: str, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    """x [R, 2I] (gated) or [R, I] -> [R, I] in x's dtype."""
    gated = check_activation_args(x, kind, interleaved)
    check_parameters(kind, alpha, limit)
    fn = ACTIVATIONS[kind][1]
    xf = x.float()
    gate, up = split_gate_up(xf, interleaved) if gated else (xf, None)
    return fn(gate, up, alpha, limit).to(x.dtype).contiguous()


@activation.register_fake
def _activation_fake(x, kind, alpha, limit, interleaved):
    gated = check_activation_args(x, kind, interleaved)
    check_parameters(kind, alpha, limit)
    return x.new_empty((x.shape[0], x.shape[1] // 2 if gated else x.shape[1]))


forward_only.register(activation)
