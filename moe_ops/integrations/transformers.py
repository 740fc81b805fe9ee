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
num_experts) are dropped. Importing moe_ops does not import transformers: the implementation is
registered when transformers.integrations.moe is first imported (or at once if it already was).
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

NAME = "moe_ops"
_MODULE = "transformers.integrations.moe"

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
    return Activation(kind, interleaved=interleaved) if kind != "relu2" else Activation(kind)


def moe_ops_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """ExpertsInterface forward: hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k] -> [S, H]."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    for name, w in (("gate_up_proj" if self.has_gate else "up_proj", up), ("down_proj", self.down_proj)):
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            # A quantized checkpoint's experts (fp8 storage, say) would have their scales elsewhere: reading
            # the codes as values would be silently wrong, and casting the input to them meaningless.
            raise NotImplementedError(
                f"{type(self).__name__}.{name}: dtype {w.dtype}; the moe_ops experts implementation reads float "
                "experts (float32/float16/bfloat16), not quantized checkpoints"
            )
    # transformers stores transposed experts as [E, H, N]; a transposed view is [E, N, H] column-major.
    w13 = up.transpose(1, 2) if self.is_transposed else up
    w2 = self.down_proj.transpose(1, 2) if self.is_transposed else self.down_proj
    b13 = b2 = None
    if self.has_bias:
        b13 = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        b2 = self.down_proj_bias
    expert_map = None
    ids = top_k_index
    if getattr(self, "_is_expert_parallel", False):
        # Sentinels (ids >= num_experts) point at one extra global slot mapped to -1: no work, no output.
        ids = top_k_index.clamp(max=self.num_experts)
        expert_map = torch.arange(self.num_experts + 1, device=ids.device, dtype=torch.int32)
        expert_map[-1] = -1
    out = fused_experts(
        hidden_states.to(w13.dtype), w13, w2, top_k_weights.float(), ids,
        activation=experts_activation(self), w13_bias=b13, w2_bias=b2, expert_map=expert_map,
        post_expert_norm=experts_norm(self),
    )  # fmt: skip
    return out.to(hidden_states.dtype)


_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


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
    changed = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not getattr(module, "is_transposed", False):
                continue
            params = [p for p in (getattr(module, w, None) for w in _WEIGHTS) if isinstance(p, torch.nn.Parameter) and p.dim() == 3]
            moved = [p for p in params if not p.transpose(1, 2).is_contiguous()]
            for p in moved:
                # .data keeps the Parameter object (optimizer state, hooks, tied references) and gives it
                # the new storage; the old one is freed with its last reference.
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
            if moved:
                changed.append(name)
    return changed


def register(module=None) -> None:
    """Register "moe_ops" in transformers' ExpertsInterface (idempotent)."""
    module = module or sys.modules[_MODULE]
    module.ExpertsInterface.register(NAME, moe_ops_experts_forward)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers moe_ops the moment transformers.integrations.moe finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            register(module)

        spec.loader.exec_module = exec_and_register
        return spec


def install_hook() -> None:
    """Register "moe_ops" now if transformers' moe module is imported, else when it is (importing
    moe_ops must not import transformers: it is optional and slow to import)."""
    if _MODULE in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None and not any(
        isinstance(f, _RegisterOnImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterOnImport())
