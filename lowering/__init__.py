"""lowering: an Inductor post-grad pass that fuses each MoE op chain of moe_ops into two fused ops,
moe_ops.gate_up and moe_ops.down_reduce, whose CUDA kernels come from cute_kernels.

    import lowering
    lowering.install()                       # or: with lowering.enabled(): ...
    model = torch.compile(model)             # every MoE layer now runs as two fused ops
    print(lowering.explain(model, x))        # the post-pass graph and a table per MoE layer
    with lowering.recording() as fused: ...  # the same for whatever compiles inside the block
"""
from . import fused_ops  # registers moe_ops::gate_up and moe_ops::down_reduce
from .explain import Explanation, explain, recording
from .graph_pass import MoEFusionPass, fuse
from .install import enabled, install, installed, uninstall

__all__ = ["Explanation", "MoEFusionPass", "enabled", "explain", "fuse", "install", "installed", "recording", "uninstall", "fused_ops"]
