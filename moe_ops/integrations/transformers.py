"""transformers (5.x) integration: the experts implementation "moe_ops" of transformers' ExpertsInterface.

After `import moe_ops`, `from_pretrained(..., experts_implementation="moe_ops")` or
`config._experts_implementation = "moe_ops"` runs every `@use_experts_implementation` experts module
through moe_ops.fused_experts; one whose gating moe_ops cannot express (a custom _apply_gate not in
CUSTOM_GATES, a post-expert norm not in POST_EXPERT_NORMS, an unknown act_fn) raises NotImplementedError
saying which. The experts class's flags are honoured: concatenated or interleaved gate/up
(is_concatenated), transposed weights (is_transposed: read as column-major views, no copy;
row_major_experts re-stores them in place for the CuTe DSL kernels, which read row-major experts),
biases (has_bias), has_gate, and its act_fn (an activation module, or torch.nn.functional.silu / gelu
itself as LFM2-MoE holds it; or a CUSTOM_GATES class's own gating). Expert-parallel sentinel ids (>=
num_experts) are dropped. Fine-grained fp8 checkpoints (Qwen3-FP8, DeepSeek-V3: transformers swaps
their experts for its FP8Experts, which dispatch through FP8ExpertsInterface) run their e4m3 codes and
square block scales as moe_ops' fp8_w8a8_block (moe_ops_fp8_experts_forward). quantize_experts re-stores
float experts in a moe_ops weight scheme in place (gpt-oss, which transformers dequantizes to bf16 without
its hub kernels, back to its checkpoint's own mxfp4 values). Importing moe_ops does not
import transformers: the implementation is registered in each interface when its module is first
imported (or at once if it already was).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import operator
import sys

import torch

from ..activation import Activation
from ..expert_norm import PostExpertNorm
from ..fused_experts import fused_experts
from ..quant import QuantScheme, fp8_w8a8_block, quantize_weights, tile_mxfp4_weights

NAME = "moe_ops"
_MODULE = "transformers.integrations.moe"
# transformers' fine-grained fp8 integration, whose FP8Experts dispatch through an interface of their own.
FP8_MODULE = "transformers.integrations.finegrained_fp8"

# transformers activation classes (by name, so this file needs no transformers import) -> our kind.
_ACT_FN = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "GELUPytorchTanh": "gelu_tanh",
    "ReLUSquaredActivation": "relu2",
    "FastGELUActivation": "gelu_tanh",  # tanh-GELU's formula, written with x * x
}
# act_fn given as a plain function (LFM2-MoE's experts hold F.silu itself) -> our kind, matched by identity.
_ACT_FUNCTIONS = ((torch.nn.functional.silu, "silu"), (torch.nn.functional.gelu, "gelu"))


# Experts classes whose own _apply_gate moe_ops computes, by class name: (kind, the attribute holding
# alpha, the one holding limit; dotted paths reach into act_fn), read from the module. Kind None: the
# default gate with act_fn, which the class only computes in float32, as moe_ops computes every
# activation. Named, not guessed from attributes: a gate with gpt-oss's attribute names and other
# arithmetic would be silently wrong. Each entry's _apply_gate was read in transformers 5.24
# (models/<type>/modeling_<type>.py).
CUSTOM_GATES = {
    # gate.clamp(max=limit) * sigmoid(alpha * that) * (up.clamp(-limit, limit) + 1)
    "GptOssExperts": ("swigluoai", "alpha", "limit"),
    "OpenAIPrivacyFilterExperts": ("swigluoai", "alpha", "limit"),
    "MiniMaxM3VLExperts": ("swigluoai", "swiglu_alpha", "swiglu_limit"),
    # silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    "DeepseekV4Experts": ("silu_clamped", None, "limit"),
    "Glm5NextTextExperts": ("silu_clamped", None, "swiglu_limit"),
    "HYV4Experts": ("silu_clamped", None, "swiglu_limit"),
    "HYV4VLExperts": ("silu_clamped", None, "swiglu_limit"),
    # act_fn(gate, up): gate_softcap(gate) * sigmoid(gate) * up_softcap(up), softcap(x) = cap * tanh(x / cap)
    "Inkling2Experts": ("swiglu_softcapped", "act_fn.gate_softcap.softcap", "act_fn.up_softcap.softcap"),
    "Inkling2LoopExperts": ("swiglu_softcapped", "act_fn.gate_softcap.softcap", "act_fn.up_softcap.softcap"),
    # (act_fn(gate.float()) * up.float()).to(gate.dtype)
    "BeamExperts": (None, None, None),
}


# post_expert_norm modules (has_post_expert_norm=True) that moe_ops.PostExpertNorm computes, by class name:
# x.float() * (1 + weight).float(), rounded to x's dtype, then x * rsqrt(mean(x^2) + eps) (transformers 5.24).
POST_EXPERT_NORMS = ("MuseSparkTextInputScaledRMSNorm",)


def experts_norm(experts: torch.nn.Module) -> PostExpertNorm | None:
    """The moe_ops PostExpertNorm of an experts module's post-expert norm, None without one, or
    NotImplementedError."""
    if not getattr(experts, "has_post_expert_norm", False):
        return None
    norm = getattr(experts, "post_expert_norm", None)
    name = type(norm).__name__
    if name not in POST_EXPERT_NORMS:
        raise NotImplementedError(
            f"{type(experts).__name__}: its post-expert norm {name} has no moe_ops equivalent (moe_ops computes "
            f"{', '.join(POST_EXPERT_NORMS)})"
        )
    return PostExpertNorm(norm.weight, float(norm.eps))


def _custom_gate(experts: torch.nn.Module, apply_gate) -> tuple | None:
    """The CUSTOM_GATES entry of the class that defines the _apply_gate this module runs (a subclass
    overriding it again is not that entry's arithmetic), or None."""
    for klass in type(experts).__mro__:
        if "_apply_gate" in vars(klass):
            return CUSTOM_GATES.get(klass.__name__) if vars(klass)["_apply_gate"] is apply_gate else None
    return None


def experts_activation(experts: torch.nn.Module) -> Activation:
    """The moe_ops Activation equivalent to an experts module's gating, or NotImplementedError."""
    cls = type(experts).__name__
    interleaved = not getattr(experts, "is_concatenated", True)
    apply_gate = getattr(type(experts), "_apply_gate", None)
    default_gate = getattr(sys.modules.get(_MODULE), "_default_apply_gate", None)
    if experts.has_gate and apply_gate is not None and apply_gate is not default_gate:
        entry = _custom_gate(experts, apply_gate)
        if entry is None:
            raise NotImplementedError(
                f"{cls}: its custom _apply_gate has no moe_ops equivalent (moe_ops computes those of "
                f"{', '.join(CUSTOM_GATES)})"
            )
        kind, alpha, limit = entry
        if kind is not None:
            params = {"alpha": float(operator.attrgetter(alpha)(experts))} if alpha else {}
            return Activation(kind, limit=float(operator.attrgetter(limit)(experts)), interleaved=interleaved, **params)
    kind = _act_fn_kind(experts)
    return Activation(kind, interleaved=interleaved) if kind != "relu2" else Activation(kind)


def _act_fn_kind(experts: torch.nn.Module) -> str:
    """The moe_ops activation kind of an experts module's act_fn, checked against its has_gate, or
    NotImplementedError."""
    cls = type(experts).__name__
    act_fn = getattr(experts, "act_fn", None)
    act_name = type(act_fn).__name__
    kind = _ACT_FN.get(act_name)
    if kind is None:
        kind = next((k for fn, k in _ACT_FUNCTIONS if act_fn is fn), None)
        act_name = getattr(act_fn, "__qualname__", act_name) if callable(act_fn) else act_name
    if kind == "gelu" and getattr(experts.act_fn, "approximate", "none") == "tanh":
        kind = "gelu_tanh"
    if kind is None:
        known = [*_ACT_FN, *(f"torch.nn.functional.{fn.__name__}" for fn, _ in _ACT_FUNCTIONS)]
        raise NotImplementedError(f"{cls}: activation {act_name} has no moe_ops equivalent; known: {', '.join(known)}")
    if experts.has_gate == (kind == "relu2"):
        raise NotImplementedError(f"{cls}: activation {kind} with has_gate={experts.has_gate} is not supported")
    return kind


def _up_name(experts: torch.nn.Module) -> str:
    """The attribute holding an experts module's first projection: gate_up_proj with a gate, else up_proj."""
    return "gate_up_proj" if experts.has_gate else "up_proj"


def _expert_views(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, N13, H], w2 [E, H, I]) of an experts module: transformers stores transposed experts as [E, H, N],
    whose transposed view is [E, N, H] column-major."""
    up, down = getattr(experts, _up_name(experts)), experts.down_proj
    return (up.transpose(1, 2), down.transpose(1, 2)) if experts.is_transposed else (up, down)


def moe_ops_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """ExpertsInterface forward: hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k] -> [S, H]."""
    config = getattr(self, QUANT_CONFIG_ATTR, None)
    if config is not None:  # quantize_experts: row-major codes [E, N, ...], scales in the config
        w13, w2, x = getattr(self, _up_name(self)), self.down_proj, hidden_states
    else:
        w13, w2 = _expert_views(self)
        for name, w in ((_up_name(self), w13), ("down_proj", w2)):
            if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                # A quantized checkpoint's experts (fp8 storage, say) would have their scales elsewhere: reading
                # the codes as values would be silently wrong, and casting the input to them meaningless.
                raise NotImplementedError(
                    f"{type(self).__name__}.{name}: dtype {w.dtype}; the moe_ops experts implementation reads float "
                    "experts (float32/float16/bfloat16), not quantized checkpoints (quantize_experts quantizes "
                    "float ones)"
                )
        x = hidden_states.to(w13.dtype)
    b13 = b2 = None
    if self.has_bias:
        b13 = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        b2 = self.down_proj_bias
    ids, expert_map = _routing(self, top_k_index)
    out = fused_experts(
        x, w13, w2, top_k_weights.float(), ids, activation=experts_activation(self), quant_config=config,
        w13_bias=b13, w2_bias=b2, expert_map=expert_map, post_expert_norm=experts_norm(self),
    )  # fmt: skip
    return out.to(hidden_states.dtype)


def _routing(experts: torch.nn.Module, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(topk_ids, expert_map) for fused_experts: under expert parallelism the sentinels (ids >=
    num_experts) point at one extra global slot mapped to -1: no work, no output."""
    if not getattr(experts, "_is_expert_parallel", False):
        return top_k_index, None
    ids = top_k_index.clamp(max=experts.num_experts)
    expert_map = torch.arange(experts.num_experts + 1, device=ids.device, dtype=torch.int32)
    expert_map[-1] = -1
    return ids, expert_map


def fp8_experts_activation(experts: torch.nn.Module) -> Activation:
    """The moe_ops Activation of transformers' FP8Experts gating, or NotImplementedError. FP8Experts
    replaces a model's experts module and gates with its own _apply_gate (transformers 5.24), on
    [gate; up] halves, branching on its attributes in this order: softcaps (mlp_gate_softcap,
    mlp_up_softcap: Inkling-2's swiglu_softcapped), swiglu_alpha (gpt-oss's swigluoai, clamped at
    swiglu_limit), a clamp alone (limit: silu_clamped with SiLU), else act_fn(gate) * up."""
    cls = type(experts).__name__
    fp8 = sys.modules[FP8_MODULE]
    if type(experts)._apply_gate is not fp8.FP8Experts._apply_gate:
        raise NotImplementedError(f"{cls}: an _apply_gate other than FP8Experts' own has no moe_ops equivalent")
    if not experts.has_gate:
        return Activation(_act_fn_kind(experts))
    # getattr: transformers before the softcap branch (5.17) has neither attribute nor branch.
    if getattr(experts, "gate_softcap", None) is not None:
        return Activation("swiglu_softcapped", alpha=float(experts.gate_softcap), limit=float(experts.up_softcap))
    if experts.swiglu_alpha is not None:
        return Activation("swigluoai", alpha=float(experts.swiglu_alpha), limit=float(experts.swiglu_limit))
    kind = _act_fn_kind(experts)
    if experts.limit is None:
        return Activation(kind)
    if kind != "silu":
        raise NotImplementedError(f"{cls}: a clamped gate (limit={experts.limit}) with activation {kind}; moe_ops clamps SiLU only (silu_clamped)")
    return Activation("silu_clamped", limit=float(experts.limit))


def moe_ops_fp8_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """FP8ExpertsInterface forward of transformers' FP8Experts (fine-grained fp8 checkpoints: Qwen3-FP8,
    DeepSeek-V3): hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k] -> [S, H]. Its e4m3
    codes and square weight blocks run as moe_ops' fp8_w8a8_block, activations quantized per token in
    1 x block groups as the module's own dynamic scheme does; float32 or UE8M0 scales (powers of two,
    read as float32). Static activation scales (one per expert), per-tensor weight scales and fp4
    experts raise NotImplementedError, as does a bias (FP8Experts has none)."""
    cls = type(self).__name__
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_scale = self.gate_up_proj_scale_inv if self.has_gate else self.up_proj_scale_inv
    for name, w in ((_up_name(self), up), ("down_proj", self.down_proj)):
        if w.dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"{cls}.{name}: dtype {w.dtype}; moe_ops runs fp8 (torch.float8_e4m3fn) experts, not fp4 ones")
    if self.activation_scheme != "dynamic":
        raise NotImplementedError(
            f"{cls}: activation_scheme {self.activation_scheme!r}; moe_ops runs 'dynamic' (per-token 1 x block groups), "
            "not per-expert static activation scales"
        )
    block = tuple(self.block_size) if self.block_size is not None else None
    if block is None or len(block) != 2 or block[0] != block[1]:
        raise NotImplementedError(f"{cls}: weight_block_size {self.block_size}; moe_ops runs square weight blocks ([b, b], DeepSeek-V3's [128, 128])")
    if self.has_bias:
        raise NotImplementedError(f"{cls}: biases; moe_ops' fp8 experts implementation runs FP8Experts, which has none")
    config = fp8_w8a8_block(up_scale.float(), self.down_proj_scale_inv.float(), block_size=int(block[0]))
    ids, expert_map = _routing(self, top_k_index)
    out = fused_experts(
        hidden_states, up, self.down_proj, top_k_weights.float(), ids,
        activation=fp8_experts_activation(self), expert_map=expert_map, quant_config=config,
    )  # fmt: skip
    return out.to(hidden_states.dtype)


_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
# The attribute holding a quantized experts module's moe_ops QuantConfig (quantize_experts).
QUANT_CONFIG_ATTR = "moe_ops_quant_config"


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each experts module of `model` built by transformers' use_experts_implementation (which
    gives it has_gate and is_transposed)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def quantize_experts(model: torch.nn.Module, scheme: QuantScheme, *, tile: bool | None = None) -> list[str]:
    """Quantize, in place, the float expert weights of every experts module in `model` (those transformers'
    ExpertsInterface dispatches) to the weight-only moe_ops `scheme`; returns the modules' names.

    Each module's gate_up_proj (or up_proj) and down_proj become row-major codes [E, N, K / values per byte]
    (whatever is_transposed says) and its QuantConfig (the scales) is held as the module's
    `moe_ops_quant_config`: from then on it runs with experts_implementation "moe_ops" only (transformers' own
    implementations read float weights), which this sets in each module's config, and the scales are not in
    its state_dict. Biases stay the module's
    own parameters. Quantize on the weights' device (an mxfp4 layer is tiled there), after any `.to()`: a later
    `.to(device)` leaves the scales behind, and a later `.to(dtype)` casts fp8 codes (a float dtype) to values.
    tile: lay mxfp4_w4a16 weights out for the w4a16 kernels once, here (quant.tile_mxfp4_weights); None: where
    the weights are on CUDA and the activation is gated.

    gpt-oss loaded without transformers' hub kernels is dequantized by transformers to bf16; with
    QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32))) this restores its checkpoint's own values (a bf16
    value decoded from mxfp4 quantizes back to itself) at 4.25 bits per weight, on the w4a16 kernels.
    Every module is checked and quantized before any is changed (TypeError/ValueError naming the argument or the
    module, NotImplementedError for gating moe_ops cannot compute)."""
    _check_model(model)
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme: expected a moe_ops QuantScheme, got {type(scheme).__name__}")
    if scheme.activation is not None:
        raise ValueError(f"scheme: {scheme.describe()} quantizes activations; quantize_experts takes weight-only schemes")
    if scheme.tiled is not None:
        raise ValueError(f"scheme: {scheme.describe()} is tiled; give the untiled scheme (tile= tiles it)")
    if tile is not None and not isinstance(tile, bool):
        raise TypeError(f"tile: expected None or a bool, got {tile!r}")
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(
            f"model: {type(model).__name__} holds no experts module built by transformers' use_experts_implementation "
            "(with has_gate and is_transposed); nothing to quantize"
        )
    done = []
    for name, module in modules:
        if getattr(module, QUANT_CONFIG_ATTR, None) is not None:
            raise ValueError(f"{name}: its experts are quantized already ({getattr(module, QUANT_CONFIG_ATTR).name})")
        act = experts_activation(module)
        q13, q2, config = quantize_weights(scheme, *_expert_views(module))
        tiles = tile if tile is not None else (q13.is_cuda and config.name == "mxfp4_w4a16" and act.gated)
        if tiles:
            q13, q2, config = tile_mxfp4_weights(q13, q2, config, interleaved=act.interleaved)
        done.append((name, module, _up_name(module), q13, q2, config))
    for _, module, up_name, q13, q2, config in done:
        setattr(module, up_name, torch.nn.Parameter(q13, requires_grad=False))
        module.down_proj = torch.nn.Parameter(q2, requires_grad=False)
        setattr(module, QUANT_CONFIG_ATTR, config)
        # transformers' own implementations would multiply the codes as values (or fail on uint8).
        module.config._experts_implementation = NAME
    return [name for name, *_ in done]


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model or a module holding experts), got {type(model).__name__}")


def row_major_experts(model: torch.nn.Module) -> list[str]:
    """Re-store, in place, the weights of every transposed experts module in `model` (is_transposed:
    gpt-oss, Aria) so that the [E, N, K] views moe_ops reads are row-major; returns the modules' names.

    transformers keeps such weights as contiguous [E, K, N] (gate_up_proj [E, H, 2I], down_proj
    [E, I, H]), which moe_ops reads as column-major [E, N, K] views. The reference takes them, but
    the CuTe DSL kernels read row-major experts only, so the lowering runs those layers on the
    reference (explain() and a warning say so). Afterwards each parameter has the same shape and
    values, strides (N*K, 1, K): transformers' own experts implementations read it as before, and
    `.to()` keeps the layout. Call it once after loading and before torch.compile or CUDA-graph
    capture; each parameter is copied once, so it needs free memory for the largest of them.
    """
    _check_model(model)
    changed = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not getattr(module, "is_transposed", False) or getattr(module, QUANT_CONFIG_ATTR, None) is not None:
                continue  # (quantize_experts stores row-major codes)
            params = [p for p in (getattr(module, w, None) for w in _WEIGHTS) if isinstance(p, torch.nn.Parameter) and p.dim() == 3]
            moved = [p for p in params if not p.transpose(1, 2).is_contiguous()]
            for p in moved:
                # .data keeps the Parameter object (optimizer state, hooks, tied references) and gives it
                # the new storage; the old one is freed with its last reference.
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
            if moved:
                changed.append(name)
    return changed


def _register_experts(module) -> None:
    module.ExpertsInterface.register(NAME, moe_ops_experts_forward)


def _register_fp8_experts(module) -> None:
    module.FP8ExpertsInterface.register(NAME, moe_ops_fp8_experts_forward)


# transformers module -> how "moe_ops" registers in the experts interface it defines.
_REGISTER = {_MODULE: _register_experts, FP8_MODULE: _register_fp8_experts}


def register(module=None) -> None:
    """Register "moe_ops" in transformers' ExpertsInterface, or in the interface of `module` (one of
    _REGISTER's; idempotent)."""
    module = module or sys.modules[_MODULE]
    _REGISTER[module.__name__](module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers moe_ops the moment each module of _REGISTER finishes importing."""

    def __init__(self, names):
        self.pending = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            register(module)

        spec.loader.exec_module = exec_and_register
        return spec


def install_hook() -> None:
    """Register "moe_ops" now in each of transformers' experts interfaces already imported, else when
    they are (importing moe_ops must not import transformers: it is optional and slow to import)."""
    pending = []
    for name in _REGISTER:
        if name in sys.modules:
            register(sys.modules[name])
        else:
            pending.append(name)
    if pending and importlib.util.find_spec("transformers") is not None and not any(
        isinstance(f, _RegisterOnImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterOnImport(pending))
