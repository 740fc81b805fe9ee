"""Deployment without Python-side compilation at run time: torch.export of a model with a MoE layer,
compiled ahead of time by AOTInductor with the pass installed. The package's graph holds the fused
ops, and the loaded package matches moe_float64 at token counts other than the exported one.

CPU only: on the GPU host (torch 2.11) loading any AOTInductor package for CUDA segfaults, a plain
nn.Linear's too (bench/NOTES.md v37), so the CUDA case could not be checked."""
from __future__ import annotations

import torch

import lowering
import moe_ops
from moe_ops.reference import relative_error, tolerance

from .cases import layer_float64

H, I, E, TOP_K = 64, 32, 8, 2


@torch.no_grad()
def test_aot_inductor_package_runs_the_fused_ops(tmp_path):
    layer = moe_ops.FusedMoE(E, TOP_K, H, I, dtype=torch.float32).eval()
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    program = torch.export.export(layer, (torch.randn(9, H),), dynamic_shapes=({0: tokens},))
    with lowering.recording() as fused:
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "moe.pt2"))
    assert [row.fused for row in fused.layers] == ["gate_up + down_reduce"], fused.table()
    runner = torch._inductor.aoti_load_package(path)
    for m in (1, 300):
        x = torch.randn(m, H)
        err = relative_error(runner(x), layer_float64(layer, x))
        assert err <= tolerance(torch.float32), (m, err)
