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
from .quant import tiled
from .quant.config import (
    QuantConfig,
    dequantize_weight,
    needs_calibration,
    quantize_weight,
    static_activation_scales,
    tile_mxfp4_weights,
)
from .quant.scheme import UNQUANTIZED, QuantScheme
from .router import Router
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
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(" + "|".join(_EXPERT_PARTS) + r")\.(weight|bias)$")
# Stacked names (moe_ops' own and transformers' fused experts) -> (our tensor, weight or bias).
_STACKED = {
    "w13": ("w13", "weight"), "gate_up_proj": ("w13", "weight"), "w2": ("w2", "weight"), "down_proj": ("w2", "weight"),
    "w13_bias": ("w13", "bias"), "gate_up_proj_bias": ("w13", "bias"), "w2_bias": ("w2", "bias"), "down_proj_bias": ("w2", "bias"),
}  # fmt: skip
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
        _checks.expect_bool("correction_bias", correction_bias)
        _checks.expect_bool("expert_bias", expert_bias)
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
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"dtype: got {dtype}; allowed: {', '.join(map(str, _checks.FLOAT_DTYPES))}")
        if isinstance(device, str):
            try:
                device = torch.device(device)
            except RuntimeError as e:  # torch's message lists every device type it knows
                raise ValueError(f"device: got {device!r}; allowed: a torch.device or a string such as 'cpu', 'cuda', 'cuda:1'") from e
        factory = dict(device=device, dtype=dtype)
        # nn.Linear's parameters and names; its forward is one kernel at decode sizes (router.py).
        self.router = Router(hidden_size, num_experts, bias=False, **factory)
        self.n13 = (2 if self.activation.gated else 1) * intermediate_size
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, device=device, dtype=torch.float32), requires_grad=False) if correction_bias else None
        )
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, self.n13, **factory)) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **factory)) if expert_bias else None
        w13 = torch.randn(num_experts, self.n13, hidden_size, device=device) / math.sqrt(hidden_size)
        w2 = torch.randn(num_experts, hidden_size, intermediate_size, device=device) / math.sqrt(intermediate_size)
        if scheme.weight is not None:
            for name in _CONFIG_BUFFERS:
                self.register_buffer(name, None)
        self._set_expert_weights(w13.to(dtype), w2.to(dtype), calibration=torch.randn(64, hidden_size, device=device))
        route(torch.zeros(1, num_experts), top_k, **self.routing)  # validates the routing options now

    def _set_expert_weights(self, w13: torch.Tensor | None, w2: torch.Tensor | None, calibration=None) -> None:
        """Store float weights w13 [E, n13, H] and w2 [E, H, I] (None keeps that projection as stored),
        quantized to the module's scheme; a scheme that needs_calibration then takes its activation
        scales from calibration (sample hidden states) through the router. Nothing is written unless
        everything succeeds."""
        wq = self.scheme.weight
        if self.scheme.tiled is not None:
            raise ValueError("weights: this layer's expert weights are tiled (tile_weights()); load expert weights before tiling")
        new = {which: w if wq is None else quantize_weight(w, wq, which) for which, w in (("w13", w13), ("w2", w2)) if w is not None}
        scales = {}
        if needs_calibration(self.scheme):
            x = self._calibration_inputs(calibration)
            # GEMM2's inputs as forward computes them: from the stored (dequantized) w13, as calibrate() does.
            # (Every scheme with static activation scales quantizes its weights: SCHEMES has no other.)
            if w13 is None:
                float13 = self.float_weights()[0]
            else:
                q = new["w13"]
                float13 = dequantize_weight(q["q"], wq, q["scale"], q["global_scale"], q["zero"])
            scales = self._static_scales(x, float13)
        for which, q in new.items():
            if wq is None:
                setattr(self, which, nn.Parameter(q, requires_grad=False))
                continue
            self.register_buffer(which, q["q"])
            for key in ("scale", "global_scale", "zero"):
                self.register_buffer(f"{which}_{key}", q[key])
        self._write_scales(scales)

    def _static_scales(self, x: torch.Tensor, w13: torch.Tensor) -> dict[str, torch.Tensor]:
        """The static activation scales for tokens x [T, H] (the layer's dtype) and float w13, routed by
        this layer's router: GEMM1's from x, GEMM2's from the routed pairs' activation outputs."""
        with torch.no_grad():
            _, topk_ids = self.routing_for(x)
        inter = expert_intermediates(x, w13, topk_ids, activation=self.activation, w13_bias=self.w13_bias)
        # Named for what the caller gave: the intermediates are computed here, not passed in.
        _checks.expect_finite("calibration", inter, " in GEMM2's inputs computed from it (GEMM1 of these samples overflows)")
        return static_activation_scales(self.scheme, x, inter)

    def _write_scales(self, scales: dict[str, torch.Tensor]) -> None:
        for name, t in scales.items():
            self.register_buffer(name, t.to(self.w13.device))
        self._refresh_quant_config()

    def _calibration_inputs(self, samples) -> torch.Tensor:
        """Sample hidden states [..., H] -> [T, H] in the router's dtype, on its device."""
        _checks.expect_tensor("calibration", samples)
        _checks.expect_dtype("calibration", samples, _checks.SOURCE_FLOAT_DTYPES)  # converted to the router's dtype below
        if samples.is_meta and not self.router.weight.is_meta:
            raise ValueError(f"calibration: on meta, which holds no values; the layer is on {self.router.weight.device}")
        if samples.dim() < 1 or samples.shape[-1] != self.hidden_size or samples.numel() == 0:
            raise ValueError(
                f"calibration: expected sample hidden states [..., H={self.hidden_size}] with at least one token, "
                f"got shape {tuple(samples.shape)}"
            )
        _checks.expect_finite("calibration", samples, _checks.NAN_SCALES)
        weight = self.router.weight
        return samples.detach().reshape(-1, self.hidden_size).to(device=weight.device, dtype=weight.dtype)

    @torch.no_grad()
    def calibrate(self, samples: torch.Tensor) -> None:
        """Set the static activation scales (nvfp4: global scales) from sample hidden states [..., H]:
        GEMM1's from their amax, GEMM2's from the amax of the activation outputs of the pairs this layer's
        router picks for them, with the current (dequantized) weights. Call it again after changing
        the router or the weights by other means than load_weights(..., calibration=...)."""
        if not needs_calibration(self.scheme):
            raise ValueError(f"calibrate: scheme {self.scheme.describe()} has no static activation scales to calibrate")
        x = self._calibration_inputs(samples)
        self._write_scales(self._static_scales(x, self.float_weights()[0]))

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
        # dtypes and follow device moves only. Neither may the correction bias: it stays float32 (as
        # transformers keeps it), since bf16 rounding of it changes which experts DeepSeek-V3 picks (16
        # of 4096 tokens in a review's case). Unquantized weights, expert biases and the router convert.
        quantized = () if self.scheme.weight is None else ("w13", "w2", *_CONFIG_BUFFERS)
        keep = {id(t) for t in (getattr(self, n) for n in (*quantized, "e_score_correction_bias")) if t is not None}

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
        autocast the router casts for itself and unquantized experts compute in the layer's dtype):
        otherwise ValueError / TypeError before anything runs."""
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
        if x.stride(-1) != 1:  # a transposed view, as nn.Linear takes it (the ops read rows of H)
            x = x.contiguous()
        topk_weights, topk_ids = self.routing_for(x)
        # Under autocast unquantized experts run in the layer's dtype (the ops take activations in the
        # weights' dtype; autocast does not reach custom ops) and the output comes back in the input's.
        experts_x = x.to(self.w13.dtype) if self.scheme.weight is None else x
        # The ids come from route() over this layer's E experts: in range, so an eager call skips their
        # value check, a host sync that would stall the host until the GPU caught up.
        out = fused_experts(
            experts_x, self.w13, self.w2, topk_weights, topk_ids,
            activation=self.activation, quant_config=self._quant_config,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias, _ids_from_route=True,
        )  # fmt: skip
        return out.to(hidden_states.dtype).reshape(shape)

    @torch.no_grad()
    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        calibration: torch.Tensor | None = None,
        transposed: bool = False,
    ) -> None:
        """Load float checkpoint tensors (quantized on load for a quantized scheme).

        Accepts per-expert names "...experts.<e>.<part>.weight" (and ".bias") with part
        gate_proj/up_proj/down_proj or w1/w3/w2 (Mixtral), every expert required; or stacked tensors
        "w13"/"gate_up_proj" [E, 2I, H], "w2"/"down_proj" [E, H, I], "w13_bias"/"gate_up_proj_bias"
        [E, 2I] and "w2_bias"/"down_proj_bias" [E, H] (any prefix; stacked w13 tensors are taken in the
        layer's own gate/up layout, per-expert gate and up rows are interleaved for an interleaved
        activation); the router as "gate.weight"/"router.weight"; "e_score_correction_bias".
        Every tensor must be used exactly once: unknown names, non-float tensors, expert ids >=
        num_experts, a gate for an activation without one, biases for a layer without them, or two
        entries for the same tensor raise ValueError/TypeError. A projection not given keeps its stored
        weights untouched. The layer keeps copies (contiguous, in its dtype and on its device), never
        the given tensors themselves. Nothing is written unless everything succeeds.

        calibration: sample hidden states [..., H]. Required for a scheme with static activation scales
        (they depend on the weights, biases and router: see calibrate), refused for any other.
        transposed: the stacked weights come as [E, H, 2I] and [E, I, H] (transformers' experts with
        is_transposed, e.g. gpt-oss). Shapes cannot tell the layouts apart where I == H (gpt-oss:
        2880) or 2I == H, so the layout is said, never guessed. Per-expert weights are [out, in] always.
        """
        _checks.expect_bool("transposed", transposed)
        items = self._checkpoint_items(weights)
        static = needs_calibration(self.scheme)
        if calibration is not None and not static:
            raise ValueError(f"calibration: scheme {self.scheme.describe()} has no static activation scales to calibrate; pass None")
        if static and items and calibration is None:
            raise ValueError(
                f"calibration: scheme {self.scheme.describe()} has static activation scales, which must be calibrated for "
                "the loaded tensors; pass sample hidden states [..., H] (load_weights(..., calibration=x))"
            )
        if calibration is not None:
            self._calibration_inputs(calibration)
        per_expert: dict[tuple[str, str, str], dict[int, tuple[str, torch.Tensor]]] = {}
        stacked: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}
        copies: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}  # destination -> (name, dest, src)
        seen: dict[tuple, str] = {}
        for name, tensor in items:
            key = self._destination(name)
            if key in seen:
                raise ValueError(f"weights: {seen[key]!r} and {name!r} both give {'.'.join(map(str, key[1:]))}; give one")
            seen[key] = name
            if key[0] == "expert":
                _, which, part, kind, expert = key
                per_expert.setdefault((which, part, kind), {})[expert] = (name, tensor)
            elif key[0] == "stacked":
                stacked[key[1:]] = (name, tensor)
            else:
                dest = getattr(self.router, key[1]) if key[0] == "router" else self.e_score_correction_bias
                copies[key] = (name, dest, tensor)
        new = {}
        parts = {"w13": ("gate", "up") if self.activation.gated else ("up",), "w2": ("down",)}
        for which in ("w13", "w2"):
            for kind in ("weight", "bias"):
                given_per_expert = [p for p in parts[which] if (which, p, kind) in per_expert]
                if (which, kind) in stacked and given_per_expert:
                    raise ValueError(f"weights: {which} {kind} given both stacked ({stacked[which, kind][0]!r}) and per expert; give one")
                shape = (self.num_experts, self.n13 if which == "w13" else self.hidden_size)
                shape += ((self.hidden_size if which == "w13" else self.intermediate_size),) if kind == "weight" else ()
                given = (which, kind) in stacked or given_per_expert
                if kind == "bias" and given and getattr(self, f"{which}_bias") is None:
                    raise ValueError(f"weights: {which}_bias given, but the layer has no expert biases (expert_bias=False)")
                t = stacked[which, kind][1] if (which, kind) in stacked else self._stack(per_expert, which, kind, parts[which], shape)
                if t is None:
                    continue
                # A stacked weight has two layouts; `want` is the one the caller said the checkpoint uses.
                layouts = {False: shape, True: (shape[0], shape[2], shape[1])} if kind == "weight" and (which, kind) in stacked else None
                want = layouts[transposed] if layouts else shape
                if tuple(t.shape) != want:
                    # A weight in the other layout (not square) is the likely mistake: say so.
                    other = layouts is not None and tuple(t.shape) == layouts[not transposed]
                    hint = f" (the {'untransposed' if transposed else 'transposed'} layout: pass transposed={not transposed})" if other else ""
                    raise ValueError(f"weights[{which}{'_bias' if kind == 'bias' else ''}]: expected shape {want}, got {tuple(t.shape)}{hint}")
                if layouts and transposed:
                    t = t.transpose(1, 2)
                new[which, kind] = t
        for name, dest, src in copies.values():
            if tuple(dest.shape) != tuple(src.shape):
                raise ValueError(f"weights[{name!r}]: expected shape {tuple(dest.shape)}, got {tuple(src.shape)}")
        for which in ("w13", "w2"):
            if (which, "bias") in new:
                copies[which, "bias"] = (which, getattr(self, f"{which}_bias"), new[which, "bias"])
        if not items and calibration is None:
            return
        # Transactional: the router and biases are written first (the scales are calibrated through them),
        # and restored if quantizing or calibrating then fails.
        backup = [(dest, dest.detach().clone()) for _, dest, _ in copies.values()]
        try:
            for name, dest, src in copies.values():
                dest.copy_(src)
                # Finite as given (_checkpoint_items) but past the layer's dtype's range (fp16's 65504): inf here.
                _checks.expect_finite(f"weights[{name!r}]", dest, f" once converted to the layer's {dest.dtype}: a value past its range")
            device, dtype = self.router.weight.device, self.router.weight.dtype
            # Always a copy: the layer must not share storage with the caller's tensors (a later in-place
            # change to the checkpoint or to the model it came from would silently change this layer).
            copy = dict(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
            w13, w2 = (new[w, "weight"].to(**copy) if (w, "weight") in new else None for w in ("w13", "w2"))
            for which, w in (("w13", w13), ("w2", w2)):
                if w is not None:
                    _checks.expect_finite(f"weights (the layer's {which})", w, f" once converted to the layer's {dtype}: a value past its range")
            if w13 is not None or w2 is not None or static:
                self._set_expert_weights(w13, w2, calibration)
        except BaseException:
            for dest, old in backup:
                dest.copy_(old)
            raise

    def _checkpoint_items(self, weights) -> list[tuple[str, torch.Tensor]]:
        """weights as (name, tensor) pairs, each a float tensor with values (not on meta, unless the layer
        is) and finite: an inf or NaN weight would make every token routed to it NaN."""
        if isinstance(weights, Mapping):
            items = list(weights.items())
        elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes, torch.Tensor)):
            items = list(weights)
        else:
            raise TypeError(f"weights: expected a mapping or an iterable of (name, tensor) pairs, got {type(weights).__name__}")
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"weights: expected (name: str, tensor) pairs, got {item!r:.80}")
            name, t = item
            _checks.expect_tensor(f"weights[{name!r}]", t)
            _checks.expect_dtype(f"weights[{name!r}]", t, _checks.SOURCE_FLOAT_DTYPES)
            if t.is_meta and not self.router.weight.is_meta:
                raise ValueError(f"weights[{name!r}]: on meta, which holds no values; the layer is on {self.router.weight.device}")
            _checks.expect_finite(f"weights[{name!r}]", t)
        return items

    def _destination(self, name: str) -> tuple:
        """Which tensor a checkpoint name loads: ("expert", which, part, kind, e), ("stacked", which, kind),
        ("router", "weight" | "bias") or ("correction",)."""
        if (m := _PER_EXPERT.search(name)) is not None:
            expert, (which, part), kind = int(m.group(1)), _EXPERT_PARTS[m.group(2)], m.group(3)
            if expert >= self.num_experts:
                raise ValueError(f"weights[{name!r}]: expert {expert} >= num_experts={self.num_experts}")
            if part == "gate" and not self.activation.gated:
                raise ValueError(f"weights[{name!r}]: activation {self.activation.kind!r} has no gate projection")
            return ("expert", which, part, kind, expert)
        if (key := next((k for k in _STACKED if name == k or name.endswith("." + k)), None)) is not None:
            return ("stacked", *_STACKED[key])
        if (key := next((k for k in _ROUTER if name == k or name.endswith("." + k)), None)) is not None:
            if getattr(self.router, _ROUTER[key]) is None:
                raise ValueError(f"weights[{name!r}]: the router has no bias")
            return ("router", _ROUTER[key])
        if name.split(".")[-1] == "e_score_correction_bias" and self.e_score_correction_bias is not None:
            return ("correction",)
        raise ValueError(f"weights: unknown name {name!r}; expected per-expert, stacked or router names (see load_weights)")

    def _stack(self, per_expert, which: str, kind: str, parts: tuple[str, ...], shape: tuple) -> torch.Tensor | None:
        """Per-expert tensors ([rows, K] weights, [rows] biases) of `parts` -> [E, *shape[1:]]: the parts
        concatenated along rows, or interleaved row by row (gate_0, up_0, ...) for an interleaved
        activation; None when none were given."""
        found = [per_expert.get((which, p, kind), {}) for p in parts]
        if not any(found):
            return None
        part_shape = (shape[1] // len(parts), *shape[2:])
        for part, tensors in zip(parts, found):
            missing = sorted(set(range(self.num_experts)) - set(tensors))
            if missing:
                raise ValueError(f"weights: {part} projection{' bias' if kind == 'bias' else ''} missing for experts {missing[:8]}{'...' if len(missing) > 8 else ''}")
            for name, t in tensors.values():
                if tuple(t.shape) != part_shape:
                    raise ValueError(f"weights[{name!r}]: expected shape {part_shape}, got {tuple(t.shape)}")
        interleave = self.activation.interleaved and len(parts) == 2
        per_e = [[f[e][1] for f in found] for e in range(self.num_experts)]
        return torch.stack([torch.stack(ts, dim=1).reshape(shape[1:]) if interleave else torch.cat(ts) for ts in per_e])

    @torch.no_grad()
    def tile_weights(self) -> None:
        """Re-lay this mxfp4_w4a16 layer's weights, once, in the w4a16 kernels' layout (quant.tile_mxfp4_weights):
        uint8 tiles [E, N, B] replace the codes and their scales, and each call reads them as they are instead of
        re-laying the experts it routes to (bench/NOTES.md v56). The activation must be gated; load weights
        before (a tiled layer takes none). Values and outputs are unchanged."""
        t13, t2, config = tile_mxfp4_weights(self.w13, self.w2, self._quant_config, interleaved=self.activation.interleaved)
        self.scheme = config.scheme
        for name, t in (("w13", t13), ("w2", t2), ("w13_scale", None), ("w2_scale", None)):
            self.register_buffer(name, t)
        self._refresh_quant_config()

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert weights in float32 (dequantized for a quantized scheme): w13 [E, n13, H], w2 [E, H, I]."""
        c = self.quant_config()
        wq = self.scheme.weight
        if self.scheme.tiled is not None:
            f13, f2 = tiled.gemm_formats(self.scheme.tiled)
            return tiled.dequantize(self.w13, f13, self.hidden_size), tiled.dequantize(self.w2, f2, self.intermediate_size)
        return (
            dequantize_weight(self.w13, wq, c.w13_scale, c.w13_global_scale, c.w13_zero),
            dequantize_weight(self.w2, wq, c.w2_scale, c.w2_global_scale, c.w2_zero),
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation.kind}, scheme={self.scheme.name}"
            + (" (tiled)" if self.scheme.tiled is not None else "")
        )
