"""The pass in grad mode: a layer compiled without no_grad (its router weight requires grad) still gets
its chain fused, and computes what the unfused layer computes under no_grad."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import lowering
import moe_ops
from moe_ops.reference import relative_error, tolerance

from .cases import layer_float64

E, K, H, I = 8, 2, 64, 128


def test_chain_fused_in_grad_mode():
    layer = moe_ops.FusedMoE(E, K, H, I, dtype=torch.float32, device="cpu")
    x = torch.randn(6, H)
    with torch.no_grad():
        want = layer(x)
    torch._dynamo.reset()
    with lowering.enabled():
        out, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    code = "\n".join(codes)
    assert "moe_ops.gate_up" in code and "moe_ops.down_reduce" in code, code
    assert "moe_ops.grouped_gemm" not in code
    assert out.requires_grad
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
def test_chain_runs_the_kernels_in_grad_mode():
    """On the GPU in grad mode the fused ops run the CuTe DSL kernels (require_kernels: no fallback),
    give the output of the same compiled layer under no_grad, and agree with the layer's float64
    re-computation to bf16 rounding."""
    layer = moe_ops.FusedMoE(E, K, H, I, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(37, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = layer_float64(layer, x)
    torch._dynamo.reset()
    with lowering.enabled(require_kernels=True):
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            want = compiled(x)
        out = compiled(x)
    assert out.requires_grad
    assert torch.equal(out, want)
    assert relative_error(out, ref) <= tolerance(torch.bfloat16)
