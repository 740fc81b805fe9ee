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


# kind -> (gated, f(gate_or_x, up, alpha, limit))
ACTIVATIONS = {
    "silu": (True, lambda g, u, alpha, limit: F.silu(g) * u),
    "gelu": (True, lambda g, u, alpha, limit: F.gelu(g) * u),
    "gelu_tanh": (True, lambda g, u, alpha, limit: F.gelu(g, approximate="tanh") * u),
    "swigluoai": (True, _swigluoai),
    "silu_clamped": (True, _silu_clamped),
    "relu2": (False, lambda x, u, alpha, limit: F.relu(x).square()),
}
# The parameters each kind reads (the others ignore alpha and limit).
PARAMETERS = {"swigluoai": ("alpha", "limit"), "silu_clamped": ("limit",)}


@dataclass(frozen=True)
class Activation:
    """An expert activation. kind: a key of ACTIVATIONS; alpha and limit parameterise swigluoai
    (gpt-oss uses 1.702 and 7.0), limit silu_clamped (PARAMETERS); interleaved: gate and up
    alternate along GEMM1's output."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    interleaved: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, str):
            raise TypeError(f"activation.kind: expected a str, got {type(self.kind).__name__} {self.kind!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")
        for name in ("alpha", "limit"):
            v = getattr(self, name)
            if not isinstance(v, Real) or isinstance(v, bool):
                raise TypeError(f"activation.{name}: expected a real number, got {type(v).__name__} {v!r}")
            if v != v:  # NaN (a comparison: under torch.compile v may be a SymFloat)
                raise ValueError(f"activation.{name}: got nan; allowed: a number")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"activation.interleaved: expected a bool, got {type(self.interleaved).__name__} {self.interleaved!r}")
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation: got {self.kind!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")
        if self.interleaved and not self.gated:
            raise ValueError(f"activation: {self.kind!r} has no gate, so interleaved=True means nothing")
        if not self.limit > 0:
            raise ValueError(f"activation.limit: got {self.limit}; allowed: > 0")

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
    fn = ACTIVATIONS[kind][1]
    xf = x.float()
    gate, up = split_gate_up(xf, interleaved) if gated else (xf, None)
    return fn(gate, up, alpha, limit).to(x.dtype).contiguous()


@activation.register_fake
def _activation_fake(x, kind, alpha, limit, interleaved):
    gated = check_activation_args(x, kind, interleaved)
    return x.new_empty((x.shape[0], x.shape[1] // 2 if gated else x.shape[1]))


forward_only.register(activation)
