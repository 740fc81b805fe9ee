"""moe_ops: Mixture-of-Experts layers as torch.library custom ops (namespace moe_ops) that compile with
torch.compile and capture in CUDA graphs, with plain-PyTorch reference kernels for every device.

Public API: fused_experts, route, router_linear (router logits; Router, the nn.Linear that computes them), expert_intermediates (calibration samples for static scales), FusedMoE, Activation,
PostExpertNorm, the quantization vocabulary (moe_ops.quant),
support_table() for which backend serves which scheme where, and value_checks(False) to skip the eager
checks that read tensor values (and their host synchronisation).
"""
from . import quant
from ._checks import value_checks
from .activation import ACTIVATIONS, Activation
from .backends import support_table
from .expert_norm import PostExpertNorm
from .fused_experts import expert_intermediates, fused_experts
from .quant import QuantConfig, QuantScheme
from .router import Router, router_linear
from .integrations.transformers import install_hook as _install_transformers_hook
from .routing import route

_install_transformers_hook()

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "FusedMoE",
    "PostExpertNorm",
    "QuantConfig",
    "QuantScheme",
    "Router",
    "expert_intermediates",
    "fused_experts",
    "quant",
    "route",
    "router_linear",
    "support_table",
    "value_checks",
]


def __getattr__(name):
    # FusedMoE pulls in torch.nn machinery and the transformers hook lazily.
    if name == "FusedMoE":
        from .layer import FusedMoE

        return FusedMoE
    raise AttributeError(f"module 'moe_ops' has no attribute {name!r}")
