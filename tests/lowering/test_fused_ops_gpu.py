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
from moe_ops.quant.quantize import quantize
from moe_ops.reference import moe_float64, relative_error, tolerance

from ..decoders import decode_weight
from .cases import on
from .fp8_stages import check_fp8_rows, down_from_codes, pair_activations, x_codes_float64
from .test_pass import E, build_layer, opcheck

pytestmark = pytest.mark.gpu
KERNEL_RECIPES = ["bf16", "gpt_oss_bf16", "fp16_bias", "fp8_per_token_bf16"]


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need a Hopper (sm_90) GPU")


@pytest.mark.parametrize("m", (1, 13, 300))
@pytest.mark.parametrize("recipe", KERNEL_RECIPES)
def test_kernel_ops_opcheck_and_float64(recipe, m):
    """opcheck of gate_up (with and without the expert_ids hint), down_reduce and routing_plan on CUDA,
    with require_kernels set so a reference fallback would raise; then the layer the kernels compute
    (gate_up's intermediate fed to down_reduce) against moe_float64, or with an fp8 intermediate each
    stage against float64 (fp8_stages.py)."""
    gu, dr, c = build_layer(recipe, m)
    gu, ids = on(gu, "cuda"), c["topk_ids"].cuda()
    with lowering.enabled(require_kernels=True):
        opcheck(routing_plan, [ids, E, None])
        opcheck(gate_up, gu)
        opcheck(gate_up, [*gu, ids])
        inter, inter_scale = gate_up(*gu)
        # down_reduce takes the intermediate's scale where it is quantized (build_layer's is the CPU chain's)
        dr = on([inter, None if dr[1] is None else inter_scale, *dr[2:]], "cuda")
        opcheck(down_reduce, dr)
        out = down_reduce(*dr)
    t13, t2, wq, aq = c["t13"], c["t2"], c["scheme"].weight, c["scheme"].activation
    w13 = decode_weight(c["q13"], wq, t13["w_scale"], t13["w_global_scale"], t13["w_zero"])
    w2 = decode_weight(c["q2"], wq, t2["w_scale"], t2["w_global_scale"], t2["w_zero"])
    config = c["config"]
    if aq is not None:
        # fp8 per token: each stage against float64 on its own (fp8_stages says why not the whole layer).
        assert (aq.dtype, aq.group.astuple()) == ("fp8", (1, -1)), f"no stage-wise check for {aq}"
        rows = dr[14].long().cpu()  # the grouped row of each pair
        xq = x_codes_float64(*quantize(gu[0], "fp8", [1, -1], None, None))  # GEMM1's input, as gate_up quantizes it
        a64 = pair_activations(xq, w13, config.w13_bias, c["topk_ids"], c["act"])
        check_fp8_rows(inter.cpu()[rows], dr[1].cpu()[rows], a64)
        ref = down_from_codes(inter, dr[1], w2, config.w2_bias, c["topk_weights"], c["topk_ids"], rows)
        err = relative_error(out.cpu(), ref)
        assert err <= tolerance(c["dtype"]), f"down_reduce given gate_up's codes: relative error {err} against float64"
        return
    ref = moe_float64(c["x"], w13, w2, c["topk_weights"], c["topk_ids"], activation=c["act"],
                      w13_bias=config.w13_bias, w2_bias=config.w2_bias)  # fmt: skip
    err = relative_error(out.cpu(), ref)
    assert err <= tolerance(c["dtype"]), f"relative error {err} against moe_float64"


def test_router_weights_off_a_16_byte_boundary_run_the_reference(monkeypatch):
    """A row slice of [M, 2] float32 router weights is contiguous but can start 8 bytes past a 16-byte
    boundary, and the kernels declare every pointer 16-byte aligned: down_reduce warns and runs the
    reference (the same values), require_kernels raises, the kernel interface raises ValueError before
    launching, and the CUDA context stays usable (a misaligned access would have ended it)."""
    from cute_kernels import interface
    from lowering import backend

    gu, dr, c = build_layer("bf16", 13)
    with lowering.enabled(require_kernels=True):
        inter, _ = gate_up(*on(gu, "cuda"))
        dr = on([inter, *dr[1:]], "cuda")
        aligned = down_reduce(*dr)
    weights = dr[13]
    shifted = torch.empty(weights.numel() + 1, device="cuda")[1:].view(weights.shape)
    shifted.copy_(weights)
    off = [*dr[:13], shifted, *dr[14:]]
    monkeypatch.setattr(backend, "_WARNED", set())
    with pytest.warns(UserWarning, match="topk_weights: its address is 4 bytes past a 16-byte boundary"):
        out = down_reduce(*off)
    err = relative_error(out.double().cpu(), aligned.double().cpu())
    assert err <= tolerance(c["dtype"]), f"reference against the kernels: relative error {err}"
    with lowering.enabled(require_kernels=True), pytest.raises(RuntimeError, match="topk_weights: its address"):
        down_reduce(*off)
    a, w, bias, offsets, inverse = dr[0], dr[5], dr[11], dr[12], dr[14]
    with pytest.raises(ValueError, match="topk_weights: its address is 4 bytes"):
        interface.down_reduce(a, w, bias, offsets, shifted, inverse)
    with lowering.enabled(require_kernels=True):
        again = down_reduce(*dr)
    torch.cuda.synchronize()
    assert torch.equal(again, aligned)
