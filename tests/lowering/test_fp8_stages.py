"""The stage-wise fp8 checks of fp8_stages.py (used by test_fused_ops_gpu.py on the GPU) can fail: a code
one step off away from a boundary, a scale off by 1%, and rows in the wrong order are caught; a code at a
boundary passes either way; the stages put together are moe_float64's layer."""
from __future__ import annotations

import pytest
import torch

import moe_ops
from moe_ops.plan import routing_plan
from moe_ops.reference import fake_quantize, moe_float64, relative_error

from .fp8_stages import E4M3_MAX, check_fp8_rows, down_from_codes, e4m3_half_step, fp8_row_violations, pair_activations

E, K, H, I, M = 8, 2, 64, 48, 5
SILU = moe_ops.Activation("silu")


def _quantize(a64):
    """A right per-token fp8 quantization of a64: (codes, float32 scales [P, 1])."""
    s = (a64.abs().amax(dim=1, keepdim=True) / E4M3_MAX).float()
    return (a64.float() / s).to(torch.float8_e4m3fn), s  # as fake_quantize divides


def _layer():
    x = torch.randn(M, H, dtype=torch.bfloat16)
    w13, w2 = torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5
    b13, b2 = torch.randn(E, 2 * I) / 10, torch.randn(E, H) / 10
    tw, ids = moe_ops.route(torch.randn(M, E), K)
    return x, w13, w2, b13, b2, tw, ids


def _step_codes(codes, where, steps):
    """codes with the elements at `where` moved `steps` e4m3 codes up (by their bit patterns)."""
    bits = codes.view(torch.uint8).clone()
    bits[where] = (bits[where].int() + steps).to(torch.uint8)
    return bits.view(torch.float8_e4m3fn)


def test_right_codes_pass_and_a_code_off_a_boundary_fails():
    x, w13, w2, b13, b2, tw, ids = _layer()
    a64 = pair_activations(fake_quantize(x.double(), "fp8", (1, -1)), w13, b13, ids, SILU)
    codes, s = _quantize(a64)
    check_fp8_rows(codes, s, a64)
    # The largest element of each row sits at 448 exactly: far from any boundary, one code down is wrong.
    top = a64.abs().argmax(dim=1)
    wrong = _step_codes(codes, (torch.arange(a64.shape[0]), top), -1)
    with pytest.raises(AssertionError, match="fp8 code at row"):
        check_fp8_rows(wrong, s, a64)
    with pytest.raises(AssertionError, match="per-token scale off"):
        check_fp8_rows(codes, s * 1.01, a64)
    with pytest.raises(AssertionError):
        check_fp8_rows(codes.flip(0), s.flip(0), a64)  # rows of the wrong pairs


def test_a_code_at_a_boundary_passes_either_way():
    # 100 lies halfway between the e4m3 codes 96 and 104 (step 8 in [64, 128)); 448 sets the row's scale to 1.
    a64 = torch.tensor([[448.0, 100.0, -3.0]], dtype=torch.float64)
    s = torch.ones(1, 1)
    for near in (96.0, 104.0):
        check_fp8_rows(torch.tensor([[448.0, near, -3.0]]).to(torch.float8_e4m3fn), s, a64)
    with pytest.raises(AssertionError, match="fp8 code at row 0, column 1"):
        check_fp8_rows(torch.tensor([[448.0, 112.0, -3.0]]).to(torch.float8_e4m3fn), s, a64)
    assert e4m3_half_step(torch.tensor([1.0625, 300.0, 2.0**-8], dtype=torch.float64)).tolist() == [2.0**-4, 16.0, 2.0**-10]


def test_margins_are_what_the_excess_subtracts():
    a64 = torch.tensor([[448.0, 100.0]], dtype=torch.float64)
    codes = torch.tensor([[448.0, 104.0]]).to(torch.float8_e4m3fn)  # 100 rounds to 96 or 104 (step 8): a tie
    _, excess = fp8_row_violations(codes, torch.ones(1, 1), a64)
    assert excess[0, 1].item() == pytest.approx(4.0 - 4.0 - 100.0 * 2.0**-7 - 1e-3 * E4M3_MAX)


def test_the_stages_together_are_moe_float64():
    """Quantized exactly (float64 values through fake_quantize), gate_up's rows in the plan's order and
    down_from_codes give moe_float64's layer with the same activation quantization."""
    x, w13, w2, b13, b2, tw, ids = _layer()
    _, _, inverse = routing_plan(ids, E, None)
    rows = inverse.long()
    a64 = pair_activations(fake_quantize(x.double(), "fp8", (1, -1)), w13, b13, ids, SILU)
    codes, s = _quantize(a64)
    # grouped order: row rows[p] holds pair p
    grouped_codes = torch.empty_like(codes.view(torch.uint8))
    grouped_codes[rows] = codes.view(torch.uint8)
    grouped_s = torch.empty_like(s)
    grouped_s[rows] = s
    got = down_from_codes(grouped_codes.view(torch.float8_e4m3fn), grouped_s, w2, b2, tw, ids, rows)
    want = moe_float64(x, w13, w2, tw, ids, activation="silu", w13_bias=b13, w2_bias=b2,
                       act_quant=("fp8", (1, -1), None, None, None, None), fused_activation=True)  # fmt: skip
    assert relative_error(got, want) <= 1e-12
