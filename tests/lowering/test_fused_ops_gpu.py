"""The fused ops on CUDA, where their real impls are the CuTe DSL kernels (gate_up, down_reduce) and the
Triton routing plan: torch.library.opcheck there, and the layer they compute against the float64
re-computation from independently decoded weights. The CPU tests (test_pass.py) check the same ops'
reference impls. Run on the GPU host: python -m pytest -m gpu tests/lowering/test_fused_ops_gpu.py"""
from __future__ import annotations

import pytest
import torch

import lowering
from lowering.fused_ops import down_reduce, gate_up
from moe_ops.plan import routing_plan
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..decoders import decode_weight
from .test_pass import E, build_layer, opcheck

pytestmark = pytest.mark.gpu
KERNEL_RECIPES = ["bf16", "gpt_oss_bf16"]


def _cuda(args: list) -> list:
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need a Hopper (sm_90) GPU")


@pytest.mark.parametrize("m", (1, 13, 300))
@pytest.mark.parametrize("recipe", KERNEL_RECIPES)
def test_kernel_ops_opcheck_and_float64(recipe, m):
    """opcheck of gate_up (with and without the expert_ids hint), down_reduce and routing_plan on CUDA,
    with require_kernels set so a reference fallback would raise; then the layer the kernels compute
    (gate_up's intermediate fed to down_reduce) against moe_float64."""
    gu, dr, c = build_layer(recipe, m)
    gu, ids = _cuda(gu), c["topk_ids"].cuda()
    with lowering.enabled(require_kernels=True):
        opcheck(routing_plan, [ids, E, None])
        opcheck(gate_up, gu)
        opcheck(gate_up, [*gu, ids])
        inter, _ = gate_up(*gu)
        dr = _cuda([inter, *dr[1:]])
        opcheck(down_reduce, dr)
        out = down_reduce(*dr)
    w13 = decode_weight(c["q13"], None)
    w2 = decode_weight(c["q2"], None)
    config = c["config"]
    ref = moe_float64(c["x"], w13, w2, c["topk_weights"], c["topk_ids"], activation=c["act"],
                      w13_bias=config.w13_bias, w2_bias=config.w2_bias)  # fmt: skip
    err = relative_error(out.cpu(), ref)
    assert err <= tolerance(c["dtype"]), f"relative error {err} against moe_float64"
