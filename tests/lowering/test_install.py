"""install()/uninstall() sequences beyond one install and one uninstall: require_kernels set by several
installs, another pass set over ours, and installing over a list of previous passes."""
from __future__ import annotations

import importlib

import pytest
from torch._inductor import config as inductor_config

import lowering
from lowering import backend

from .test_pass import CountingPass, compile_primitives_case

_install = importlib.import_module("lowering.install")  # `lowering.install` is the function


@pytest.fixture(autouse=True)
def restore_lowering_state():
    """Every test leaves Inductor's post_grad_custom_post_pass, require_kernels and install()'s memory of
    it as it found them, also when it fails (later tests in the process compile with them)."""
    saved = (inductor_config.post_grad_custom_post_pass, backend.REQUIRE_KERNELS["value"], dict(_install._state))
    yield
    inductor_config.post_grad_custom_post_pass, backend.REQUIRE_KERNELS["value"] = saved[:2]
    _install._state.clear()
    _install._state.update(saved[2])


@pytest.mark.parametrize("before", [False, True])
def test_uninstall_restores_require_kernels_from_before_the_first_install(before):
    """install(require_kernels=...) twice with different values, then uninstall(): the setting goes back
    to what it was before the first install, not to the value the second install replaced."""
    backend.REQUIRE_KERNELS["value"] = before
    lowering.install(require_kernels=not before)
    lowering.install(require_kernels=before)
    assert backend.REQUIRE_KERNELS["value"] is before
    lowering.uninstall()
    assert backend.REQUIRE_KERNELS["value"] is before and lowering.installed() is None
    # install() remembers nothing after uninstall(): a new install saves the value as it is now.
    backend.REQUIRE_KERNELS["value"] = not before
    lowering.install(require_kernels=before)
    lowering.uninstall()
    assert backend.REQUIRE_KERNELS["value"] is (not before)


def test_uninstall_restores_require_kernels_when_another_pass_replaced_ours():
    """install(require_kernels=True), then another post_grad_custom_post_pass set over ours (so ours is
    no longer installed), then uninstall(): the other pass stays, and require_kernels still goes back,
    or every later CUDA call without a kernel would raise."""
    backend.REQUIRE_KERNELS["value"] = False
    lowering.install(require_kernels=True)
    other = CountingPass()
    inductor_config.post_grad_custom_post_pass = other
    lowering.uninstall()
    assert inductor_config.post_grad_custom_post_pass is other
    assert backend.REQUIRE_KERNELS["value"] is False


@pytest.mark.parametrize("container", [list, tuple])
def test_install_over_a_list_of_passes(container):
    """Inductor takes a list or tuple of passes as post_grad_custom_post_pass. Installed over one, the
    MoE pass runs each of them, in order, on the unfused graph before fusing, combines their uuids with
    its own, and uninstall() puts the same list back."""
    calls = []

    class Named(CountingPass):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, graph):
            super().__call__(graph)
            calls.append(self.name)

        def uuid(self):
            return f"{self.name}-v1"

    first, second = Named("first"), Named("second")
    previous = container([first, second])
    inductor_config.post_grad_custom_post_pass = previous
    moe_pass = lowering.install()
    assert moe_pass.previous is previous
    uuid = moe_pass.uuid()
    assert isinstance(uuid, tuple) and uuid[1:] == ("first-v1", "second-v1") and uuid[0]
    code = compile_primitives_case()
    assert calls == ["first", "second"]
    assert first.saw_weighted_reduce == second.saw_weighted_reduce == [True]
    assert "torch.ops.moe_ops.gate_up.default(" in code and "moe_ops.grouped_gemm" not in code
    lowering.uninstall()
    assert inductor_config.post_grad_custom_post_pass is previous


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("installed_before", [False, True])
def test_enabled_restores_require_kernels_when_the_block_raises(before, installed_before):
    """An exception out of `with enabled(require_kernels=...)` (a failing compile or call) restores
    require_kernels as a normal exit does, whether or not the pass was installed before, and leaves the
    pass installed exactly when it was. Otherwise every later CUDA call without a kernel would keep
    raising (or keep running the reference where the caller wanted an error)."""
    backend.REQUIRE_KERNELS["value"] = before
    outer = lowering.install() if installed_before else None
    with pytest.raises(KeyError, match="inside"):
        with lowering.enabled(require_kernels=not before):
            assert backend.REQUIRE_KERNELS["value"] is (not before)
            raise KeyError("inside")
    assert backend.REQUIRE_KERNELS["value"] is before
    assert lowering.installed() is outer


@pytest.mark.parametrize("value", ["false", 0, 1.0])
def test_require_kernels_takes_a_bool(value):
    """A truthy string used to switch strict mode on ("false" is a non-empty string); nothing changes."""
    before = (lowering.installed(), backend.REQUIRE_KERNELS["value"])
    with pytest.raises(TypeError, match=rf"require_kernels: expected a bool or None, got {type(value).__name__}"):
        lowering.install(require_kernels=value)
    with pytest.raises(TypeError, match=r"require_kernels: expected a bool or None"):
        with lowering.enabled(require_kernels=value):
            pass
    assert (lowering.installed(), backend.REQUIRE_KERNELS["value"]) == before
