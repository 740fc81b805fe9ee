"""The lowering on transformers models whose experts run through the "moe_ops" implementation: every
MoE layer is fused, and which backend each fused op gets on a Hopper GPU. gpt-oss's transposed experts
reach the kernels only once row_major_experts has re-stored them. On the CPU the sm_90 decision is
made from the recipe alone; on the GPU (pytest -m gpu) the compiled models run the kernels
(require_kernels) and match transformers' eager experts."""
from __future__ import annotations

import pytest
import torch

import lowering
from lowering import backend
from moe_ops.reference import relative_error, tolerance

from moe_ops.integrations import transformers as INTEGRATION

# Importing these skips the module where transformers is not installed, as it skips that one.
from ..moe_ops.test_transformers import _build, _config, _experts, _input_ids
# Sizes the kernels serve (hidden and intermediate multiples of 64).
KERNEL_SIZES = dict(hidden_size=128, intermediate_size=64, moe_intermediate_size=64)


def _kernel_sized(name: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    model = _build(name, config=_config(name, **KERNEL_SIZES)).to(dtype=dtype, device=device)
    model.set_experts_implementation("moe_ops")
    return model


def _as_on_sm90(op: str, recipe: dict, device: torch.device, tensors=None) -> backend.Choice:
    """The choice a Hopper GPU would make for this recipe (its device checks aside)."""
    from cute_kernels import interface

    ok, why = backend._support(op, recipe, interface)
    return backend.Choice("cute" if ok else "reference", why)


def _backends(model, ids) -> list[str]:
    torch._dynamo.reset()
    with torch.no_grad():
        return [row.backend for row in lowering.explain(model, ids).layers]


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_transformers_layers_fuse_and_reach_the_kernels_once_row_major(monkeypatch, name):
    pytest.importorskip("cute_kernels.interface")
    monkeypatch.setattr(backend, "_choose", _as_on_sm90)
    model = _kernel_sized(name)
    ids = _input_ids(seed=11)
    rows = _backends(model, ids)
    assert len(rows) == len(_experts(model))
    if name == "gpt_oss":
        # [E, K, N] experts read as column-major views: declined by name, with the call that fixes it
        for row in rows:
            assert row.count("reference (column-major (transposed) expert weights") == 2, row
            assert "row_major_experts(model)" in row
        assert INTEGRATION.row_major_experts(model) == [n for n, m in model.named_modules() if m in _experts(model)]
        rows = _backends(model, ids)
    else:
        assert INTEGRATION.row_major_experts(model) == []
    for row in rows:
        assert row.startswith("gate_up: cute (") and "; down_reduce: cute (" in row, row


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_compiled_transformers_models_run_the_kernels(name):
    """bf16 models on the GPU, compiled with the lowering and require_kernels: each experts module's
    output equals transformers' eager experts on the same inputs (its inputs as the compiled model gave
    them, caught by forward hooks, which compile into the one graph), and the logits match the eager
    model's. gpt-oss without row_major_experts is refused under require_kernels (so the kernels, not the
    reference, gave the compiled outputs).

    The per-layer check is the one that can fail: these small models' logits hardly depend on their
    experts (qwen3_moe's bf16 logits moved by 0.4-0.5% with the experts' outputs zeroed, CPU), while
    each layer's output scaled by 1.05 is 5% off and the CPU reference's is 0.4-0.5% off."""
    model = _kernel_sized(name, device="cuda")
    ids = _input_ids(seed=12, shape=(3, 17)).cuda()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        eager = model(ids).logits.float()
    model.set_experts_implementation("moe_ops")
    torch._dynamo.reset()
    seen = []
    with torch.no_grad(), lowering.enabled(require_kernels=True):
        if name == "gpt_oss":
            with pytest.raises(Exception, match=r"column-major .*row_major_experts\(model\)"):
                torch.compile(model)(ids)
            torch._dynamo.reset()
            INTEGRATION.row_major_experts(model)
        hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args, out))) for m in _experts(model)]
        try:
            compiled = torch.compile(model)
            logits = compiled(ids).logits.float()
            layers = list(seen)
            again = compiled(ids).logits.float()
        finally:
            for h in hooks:
                h.remove()
    assert len(layers) == len(_experts(model))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for i, (experts, args, out) in enumerate(layers):
            err = relative_error(out, experts(*args))
            assert err <= tolerance(torch.bfloat16), f"layer {i}: relative error {err}"
    assert torch.isfinite(logits).all()
    assert relative_error(logits, eager) <= 4 * tolerance(torch.bfloat16)
    assert torch.equal(logits, again)  # deterministic
