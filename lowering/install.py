"""Installing the pass into Inductor's post_grad_custom_post_pass, composing with what is there."""
from __future__ import annotations

import contextlib

from torch._inductor import config as inductor_config

from moe_ops import _checks

from . import backend
from .graph_pass import MoEFusionPass

# The require_kernels setting from before the first install() that changed it. The installed pass
# itself is read from Inductor's config, never kept here: a torch._inductor.config.patch around an
# enabled() or explain() would otherwise leave a remembered pass that is no longer (or again) the one
# installed, and uninstall() could not remove it.
_state: dict = {"require_kernels": None}


def installed() -> MoEFusionPass | None:
    """The installed pass, or None."""
    current = inductor_config.post_grad_custom_post_pass
    return current if isinstance(current, MoEFusionPass) else None


def install(*, require_kernels: bool | None = None) -> MoEFusionPass:
    """Install the MoE fusion pass (idempotent). A post_grad_custom_post_pass already set keeps running,
    before ours. require_kernels: raise at run time when a CUDA call finds no CuTe DSL kernel for its
    recipe instead of running the reference (None: leave the setting as it is)."""
    _checks.expect_bool("require_kernels", require_kernels, optional=True)
    if require_kernels is not None:
        if _state["require_kernels"] is None:
            _state["require_kernels"] = backend.REQUIRE_KERNELS["value"]
        backend.REQUIRE_KERNELS["value"] = require_kernels
    if (current := installed()) is not None:
        return current
    inductor_config.post_grad_custom_post_pass = MoEFusionPass(inductor_config.post_grad_custom_post_pass)
    return inductor_config.post_grad_custom_post_pass


def uninstall() -> None:
    """Restore the post_grad_custom_post_pass that was set before install() (idempotent)."""
    if (current := installed()) is not None:
        inductor_config.post_grad_custom_post_pass = current.previous
    if _state["require_kernels"] is not None:
        backend.REQUIRE_KERNELS["value"] = _state["require_kernels"]
    _state["require_kernels"] = None


@contextlib.contextmanager
def enabled(*, require_kernels: bool | None = None):
    """Context manager: the pass is installed inside, and the previous state restored after (if the
    pass was installed already, it stays installed)."""
    was_installed = installed() is not None
    require_before = backend.REQUIRE_KERNELS["value"]
    ours = install(require_kernels=require_kernels)
    try:
        yield ours
    finally:
        if not was_installed:
            uninstall()
        backend.REQUIRE_KERNELS["value"] = require_before
