"""The pass in grad mode: a layer compiled without no_grad (its router weight requires grad) still gets
its chain fused, and computes what the unfused layer computes under no_grad."""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

import lowering
import moe_ops

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
