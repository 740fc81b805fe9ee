"""FusedMoE: an nn.Module holding a router and the expert weights in moe_ops' layout.

w13 [E, 2I, H] = [gate; up] (or [E, I, H] without a gate), w2 [E, H, I]; for a quantized scheme
the weights are stored as QuantConfig describes, with their scales as buffers of the same names
(w13_scale, w2_scale, ...). forward(x [..., H]) routes each token and runs fused_experts.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from . import _checks
from .activation import Activation, resolve_activation
from .fused_experts import expert_intermediates, fused_experts
from .quant.config import QuantConfig, needs_calibration, quantize_weights, static_activation_scales
from .quant.scheme import UNQUANTIZED, QuantScheme
from .routing import route

# Per-expert checkpoint names -> (which stacked tensor, which part of it).
_EXPERT_PARTS = {
    "gate_proj": ("w13", "gate"),
    "w1": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "w3": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w2": ("w2", "down"),
}
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(" + "|".join(_EXPERT_PARTS) + r")\.weight$")
# Stacked 3-D names (moe_ops' own and transformers' fused experts) -> our tensor.
_STACKED = {"w13": "w13", "gate_up_proj": "w13", "w2": "w2", "down_proj": "w2"}
_ROUTER = {"gate.weight": "weight", "router.weight": "weight", "gate.bias": "bias", "router.bias": "bias"}
_CONFIG_BUFFERS = (
    "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "w13_zero", "w2_zero",
    "a13_scale", "a2_scale", "a13_global_scale", "a2_global_scale",
)  # fmt: skip


class FusedMoE(nn.Module):
    """A MoE layer: router (nn.Linear H -> E) + top-k routing + experts through moe_ops.fused_experts.

    Routing options are those of moe_ops.route; correction_bias adds DeepSeek-V3's
    e_score_correction_bias buffer [E]; expert_bias adds w13_bias [E, 2I] and w2_bias [E, H];
    quant_config is a QuantScheme (the tensors are the module's buffers). Weights start random.
    A scheme with static activation scales (or nvfp4 activations) takes them from sample hidden states:
    load_weights(..., calibration=x) or calibrate(x), through the layer's router and weights.
    .to(dtype) / .half() convert the router, biases and unquantized weights; quantized weights, their
    scales and zero points keep their dtypes (device moves apply to every tensor).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str | Activation = "silu",
        scoring: str = "softmax",
        renormalize: bool = True,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = False,
        expert_bias: bool = False,
        quant_config: QuantScheme | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 1")
        if top_k > num_experts:
            raise ValueError(f"top_k: got {top_k}; allowed: at most num_experts={num_experts}")
        scheme = quant_config if quant_config is not None else UNQUANTIZED
        if not isinstance(scheme, QuantScheme):
            raise TypeError(f"quant_config: expected a moe_ops.QuantScheme or None, got {type(scheme).__name__}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = resolve_activation(activation)
        self.scheme = scheme
        self.routing = dict(
            scoring=scoring,
            renormalize=renormalize,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )
        dtype = dtype or torch.get_default_dtype()
        factory = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.n13 = (2 if self.activation.gated else 1) * intermediate_size
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, device=device), requires_grad=False) if correction_bias else None
        )
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, self.n13, **factory)) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **factory)) if expert_bias else None
        w13 = torch.randn(num_experts, self.n13, hidden_size, device=device) / math.sqrt(hidden_size)
        w2 = torch.randn(num_experts, hidden_size, intermediate_size, device=device) / math.sqrt(intermediate_size)
        self._set_expert_weights(w13.to(dtype), w2.to(dtype), calibration=torch.randn(64, hidden_size, device=device))
        route(torch.zeros(1, num_experts), top_k, **self.routing)  # validates the routing options now

    def _set_expert_weights(self, w13: torch.Tensor, w2: torch.Tensor, calibration: torch.Tensor | None = None) -> None:
        """Store float weights, quantizing them to the module's scheme; calibration: sample hidden states
        for a scheme that needs_calibration (checked by the caller)."""
        if self.scheme.weight is None:
            self.w13 = nn.Parameter(w13, requires_grad=False)
            self.w2 = nn.Parameter(w2, requires_grad=False)
            self._refresh_quant_config()
            return
        inter = None
        if needs_calibration(self.scheme):
            calibration = self._calibration_inputs(calibration)
            inter = self._intermediates(calibration, w13)
        q13, q2, config = quantize_weights(self.scheme, w13, w2, calibration=calibration, intermediate_calibration=inter)
        self.register_buffer("w13", q13)
        self.register_buffer("w2", q2)
        for name in _CONFIG_BUFFERS:
            self.register_buffer(name, getattr(config, name))
        self._refresh_quant_config()

    def _calibration_inputs(self, samples) -> torch.Tensor:
        """Sample hidden states [..., H] -> [T, H] in the router's dtype, on its device."""
        _checks.expect_tensor("calibration", samples)
        _checks.expect_dtype("calibration", samples, _checks.FLOAT_DTYPES)
        if samples.dim() < 1 or samples.shape[-1] != self.hidden_size or samples.numel() == 0:
            raise ValueError(
                f"calibration: expected sample hidden states [..., H={self.hidden_size}] with at least one token, "
                f"got shape {tuple(samples.shape)}"
            )
        weight = self.router.weight
        return samples.detach().reshape(-1, self.hidden_size).to(device=weight.device, dtype=weight.dtype)

    def _intermediates(self, x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
        """GEMM2's inputs for tokens x [T, H] with float w13, routed by this layer's router."""
        with torch.no_grad():
            _, topk_ids = self.routing_for(x)
        return expert_intermediates(x, w13, topk_ids, activation=self.activation, w13_bias=self.w13_bias)

    @torch.no_grad()
    def calibrate(self, samples: torch.Tensor) -> None:
        """Set the static activation scales (nvfp4: global scales) from sample hidden states [..., H]:
        GEMM1's from their amax, GEMM2's from the amax of the activation outputs of the pairs this layer's
        router picks for them, with the current (dequantized) weights. Call it again after changing
        the router or the weights by other means than load_weights(..., calibration=...)."""
        if not needs_calibration(self.scheme):
            raise ValueError(f"calibrate: scheme {self.scheme.describe()} has no static activation scales to calibrate")
        x = self._calibration_inputs(samples)
        scales = static_activation_scales(self.scheme, x, self._intermediates(x, self.float_weights()[0]))
        for name, t in scales.items():
            self.register_buffer(name, t.to(self.w13.device))
        self._refresh_quant_config()

    def quant_config(self) -> QuantConfig:
        """The QuantConfig of this layer's buffers (biases are passed separately). Built when the
        buffers change (construction, load_weights, .to()), never in forward: torch 2.11's Dynamo
        cannot build it inside a compiled region."""
        return self._quant_config

    def _refresh_quant_config(self) -> None:
        buffers = {} if self.scheme.weight is None else {name: getattr(self, name) for name in _CONFIG_BUFFERS}
        self._quant_config = QuantConfig(self.scheme, **buffers)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() replace the buffers; the config must point at the new ones.
        # A dtype conversion (.to(torch.bfloat16), .half(), .float()) must not reach the quantized
        # storage (fp8 counts as floating point) nor its scales and zero points: those keep their
        # dtypes and follow device moves only. Unquantized weights, biases and the router convert.
        quantized = () if self.scheme.weight is None else ("w13", "w2", *_CONFIG_BUFFERS)
        keep = {id(t) for t in (getattr(self, n) for n in quantized) if t is not None}

        def keep_quantized_dtypes(t):
            if id(t) not in keep:
                return fn(t)
            target = fn(t.new_empty(0))  # where and in which dtype fn would put t, without converting t
            return fn(t) if target.dtype == t.dtype else t.to(device=target.device)

        out = super()._apply(keep_quantized_dtypes, recurse)
        self._refresh_quant_config()
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # load_state_dict(..., assign=True) (the meta-device init path) replaces the buffers rather than
        # copying into them; the config must point at the loaded ones, not at the replaced tensors.
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._refresh_quant_config()

    def routing_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (topk_weights float32 [M, k], topk_ids int32 [M, k]) from this layer's router."""
        return route(self.router(x), self.top_k, e_score_correction_bias=self.e_score_correction_bias, **self.routing)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]. x must be on the layer's device and in its dtype (the router's; under
        autocast the router casts for itself): otherwise ValueError / TypeError before anything runs."""
        _checks.expect_tensor("hidden_states", hidden_states)
        _checks.expect_dtype("hidden_states", hidden_states, _checks.FLOAT_DTYPES)
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [..., H={self.hidden_size}], got shape {tuple(hidden_states.shape)}")
        weight = self.router.weight
        if hidden_states.device != weight.device:
            raise ValueError(f"hidden_states: on {hidden_states.device}, but the layer is on {weight.device}; allowed: {weight.device}")
        if hidden_states.dtype != weight.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(
                f"hidden_states: dtype {hidden_states.dtype} differs from the layer's {weight.dtype}; allowed: {weight.dtype} "
                "(convert the input, or the layer with .to(dtype))"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        topk_weights, topk_ids = self.routing_for(x)
        out = fused_experts(
            x, self.w13, self.w2, topk_weights, topk_ids,
            activation=self.activation, quant_config=self._quant_config,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias,
        )  # fmt: skip
        return out.reshape(shape)

    @torch.no_grad()
    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        calibration: torch.Tensor | None = None,
    ) -> None:
        """Load float checkpoint tensors (quantized on load for a quantized scheme).

        Accepts per-expert names "...experts.<e>.<part>.weight" with part gate_proj/up_proj/down_proj
        or w1/w3/w2 (Mixtral), every expert required; or stacked 3-D tensors "w13"/"gate_up_proj"
        [E, 2I, H] and "w2"/"down_proj" [E, H, I] (any prefix); the router as "gate.weight" or
        "router.weight"; "e_score_correction_bias". Every tensor must be used: unknown names, expert
        ids >= num_experts, a gate for an activation without one, or per-expert and stacked tensors for
        the same projection raise ValueError. Nothing is written unless everything checks out. The layer
        keeps copies (contiguous, in its dtype and on its device), never the given tensors themselves.
        calibration: sample hidden states [..., H], required when expert weights are loaded into a scheme
        with static activation scales (see calibrate; they are calibrated after the router is loaded).
        """
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        per_expert: dict[tuple[str, str], dict[int, tuple[str, torch.Tensor]]] = {}
        stacked: dict[str, tuple[str, torch.Tensor]] = {}
        copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # applied once everything is checked
        for name, tensor in items:
            if (m := _PER_EXPERT.search(name)) is not None:
                expert, part = int(m.group(1)), _EXPERT_PARTS[m.group(2)]
                if expert >= self.num_experts:
                    raise ValueError(f"weights[{name!r}]: expert {expert} >= num_experts={self.num_experts}")
                if part == ("w13", "gate") and not self.activation.gated:
                    raise ValueError(f"weights[{name!r}]: activation {self.activation.kind!r} has no gate projection")
                per_expert.setdefault(part, {})[expert] = (name, tensor)
            elif (key := next((k for k in _STACKED if name == k or name.endswith("." + k)), None)) is not None:
                stacked[_STACKED[key]] = (name, tensor)
            elif (key := next((k for k in _ROUTER if name == k or name.endswith("." + k)), None)) is not None:
                dest = getattr(self.router, _ROUTER[key])
                if dest is None:
                    raise ValueError(f"weights[{name!r}]: the router has no bias")
                copies.append((name, dest, tensor))
            elif name.split(".")[-1] == "e_score_correction_bias" and self.e_score_correction_bias is not None:
                copies.append((name, self.e_score_correction_bias, tensor))
            else:
                raise ValueError(f"weights: unknown name {name!r}; expected per-expert, stacked or router names (see load_weights)")
        for which in ("w13", "w2"):
            if which in stacked and any(k[0] == which for k in per_expert):
                raise ValueError(f"weights: {which} given both stacked ({stacked[which][0]!r}) and per expert; give one")
        for name, dest, src in copies:
            if tuple(dest.shape) != tuple(src.shape):
                raise ValueError(f"weights[{name!r}]: expected shape {tuple(dest.shape)}, got {tuple(src.shape)}")
        current13, current2 = self.float_weights()
        parts13 = ("gate", "up") if self.activation.gated else ("up",)
        w13 = stacked["w13"][1] if "w13" in stacked else self._stack(per_expert, "w13", parts13, current13.shape[1:])
        w2 = stacked["w2"][1] if "w2" in stacked else self._stack(per_expert, "w2", ("down",), current2.shape[1:])
        for which, t, want in (("w13", w13, current13.shape), ("w2", w2, current2.shape)):
            if t is not None and tuple(t.shape) != tuple(want):
                raise ValueError(f"weights[{which}]: expected shape {tuple(want)}, got {tuple(t.shape)}")
        if (w13 is not None or w2 is not None) and needs_calibration(self.scheme):
            if calibration is None:
                raise ValueError(
                    f"calibration: scheme {self.scheme.describe()} has static activation scales, which must be "
                    "calibrated for the loaded weights; pass sample hidden states [..., H] (load_weights(..., calibration=x))"
                )
            self._calibration_inputs(calibration)  # checked before anything is written
        for _, dest, src in copies:
            dest.copy_(src)
        if w13 is None and w2 is None:
            return
        dtype = self.router.weight.dtype
        w13 = current13 if w13 is None else w13
        w2 = current2 if w2 is None else w2
        # Always a copy: the layer must not share storage with the caller's tensors (a later in-place
        # change to the checkpoint or to the model it came from would silently change this layer).
        copy = dict(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
        self._set_expert_weights(w13.to(device=current13.device, **copy), w2.to(device=current2.device, **copy), calibration)

    def _stack(self, per_expert, which: str, parts: tuple[str, ...], matrix_shape) -> torch.Tensor | None:
        """Stack per-expert tensors [rows, K] into [E, sum(rows), K]; None when none were given."""
        found = [per_expert.get((which, p), {}) for p in parts]
        if not any(found):
            return None
        rows = matrix_shape[0] // len(parts)
        for part, tensors in zip(parts, found):
            missing = sorted(set(range(self.num_experts)) - set(tensors))
            if missing:
                raise ValueError(f"weights: {part} projection missing for experts {missing[:8]}{'...' if len(missing) > 8 else ''}")
            for name, t in tensors.values():
                if tuple(t.shape) != (rows, matrix_shape[1]):
                    raise ValueError(f"weights[{name!r}]: expected shape {(rows, matrix_shape[1])}, got {tuple(t.shape)}")
        return torch.stack([torch.cat([f[e][1] for f in found], dim=0) for e in range(self.num_experts)])

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert weights in float32 (dequantized for a quantized scheme): w13 [E, n13, H], w2 [E, H, I]."""
        from .quant.config import dequantize_weight

        c = self.quant_config()
        wq = self.scheme.weight
        return (
            dequantize_weight(self.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero),
            dequantize_weight(self.w2, wq, c.w2_scale, c.w2_global_scale, c.w2_zero),
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation.kind}, scheme={self.scheme.name}"
        )
