"""interface.w4a16_grouped_gemm refuses what the kernel cannot read, naming the argument, before any compile or
launch (CPU tensors: every check but the device's runs before the device is looked at)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from cute_kernels import interface  # noqa: E402
from cute_kernels import w4a16_pack as wp  # noqa: E402

E, P, N, K = 4, 10, 256, 320


def _args(**change):
    args = dict(
        a=torch.zeros(P, K, dtype=torch.bfloat16),
        packed=torch.zeros(E, 2, 3, wp.WORDS, dtype=torch.int32),
        offsets=torch.tensor([0, 3, 3, 9, P], dtype=torch.int32),
        n=N,
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(a=torch.zeros(P, K)), TypeError, "a: dtype torch.float32; the kernels take torch.bfloat16"),
        (dict(a=torch.zeros(P, 100, dtype=torch.bfloat16)), ValueError, "a: K = 100; the mxfp4 weights want a positive multiple of 32"),
        (dict(a=torch.zeros(2 * K, P, dtype=torch.bfloat16).T[:, :K]), ValueError, "not contiguous"),
        (dict(packed=torch.zeros(E, 3, 3, wp.WORDS, dtype=torch.int32)), ValueError, r"packed: shape \[4, 3, 3, 2176\]; expected \[4, 2, 3, 2176\]"),
        (dict(packed=torch.zeros(E, 2, 3, wp.WORDS, dtype=torch.uint8)), TypeError, "packed: dtype torch.uint8"),
        (dict(offsets=torch.tensor([0, 3, 3, 9, P])), TypeError, "offsets: dtype torch.int64"),
        (dict(n=255, activation="silu"), ValueError, "n = 255; expected the weights' row count"),
        (dict(activation="relu2"), ValueError, "W4Epilogue.activation: got 'relu2'"),
        (dict(bias=torch.zeros(E, N, dtype=torch.float16)), TypeError, "bias: dtype torch.float16; the kernels take torch.float32, torch.bfloat16"),
        (dict(bias=torch.zeros(E, 2, N // 2)), ValueError, r"bias: shape \[4, 2, 128\]; expected \[4, 256\]"),
        (dict(out=torch.zeros(P, N, dtype=torch.bfloat16)), TypeError, "out: dtype torch.bfloat16; the kernels take torch.float32"),
        (dict(offsets=torch.zeros(1100, dtype=torch.int32)), ValueError, "offsets: 1099 experts"),
        (dict(tok=256), ValueError, "tok=256; allowed: None, 16, 32, 64, 128"),
        ({}, ValueError, "the kernels do not serve this call: cpu: the kernels run on CUDA GPUs"),
    ],
)
def test_bad_input_is_refused(change, error, match):
    with pytest.raises(error, match=match):
        interface.w4a16_grouped_gemm(**_args(**change))


def test_gate_up_shapes():
    """With an activation the packed tiles are 64 output columns each; the bias is the layer's [E, n], read in the
    gate layout the call names."""
    args = _args(packed=torch.zeros(E, 2, 3, wp.WORDS, dtype=torch.int32), activation="swigluoai",
                 bias=torch.zeros(E, N, dtype=torch.bfloat16), gate_layout="interleaved")  # fmt: skip
    with pytest.raises(ValueError, match="the kernels do not serve this call"):  # every shape accepted: only the device is left
        interface.w4a16_grouped_gemm(**args)
    with pytest.raises(ValueError, match=r"bias: shape \[4, 2, 128\]; expected \[4, 256\]"):
        interface.w4a16_grouped_gemm(**{**args, "bias": torch.zeros(E, 2, N // 2)})
    with pytest.raises(ValueError, match="gate_layout=None with a bias and an activation"):
        interface.w4a16_grouped_gemm(**{**args, "gate_layout": None})


def test_gather():
    """GEMM1 (an activation) may gather its rows: a is then the tokens [M, K] and gather the int32 [P] source row
    of each grouped row; the rows kind never gathers."""
    gated = _args(a=torch.zeros(3, K, dtype=torch.bfloat16), activation="silu", gather=torch.zeros(P, dtype=torch.int32))
    with pytest.raises(ValueError, match="the kernels do not serve this call"):  # every shape accepted
        interface.w4a16_grouped_gemm(**gated)
    with pytest.raises(ValueError, match="gather: given without an activation"):
        interface.w4a16_grouped_gemm(**{**gated, "activation": None})
    with pytest.raises(TypeError, match="gather: dtype torch.int64; the kernels take torch.int32"):
        interface.w4a16_grouped_gemm(**{**gated, "gather": torch.zeros(P, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"gather: shape \[10, 1\]; expected \[\*\]"):
        interface.w4a16_grouped_gemm(**{**gated, "gather": torch.zeros(P, 1, dtype=torch.int32)})
    with pytest.raises(TypeError, match=r"gather_in_kernel='yes'; allowed: None, or a bool with a gather"):
        interface.w4a16_grouped_gemm(**{**gated, "gather_in_kernel": "yes"})
    with pytest.raises(ValueError, match=r"gather_in_kernel=True; allowed: None, or a bool with a gather"):
        interface.w4a16_grouped_gemm(**{**gated, "gather": None, "a": torch.zeros(P, K, dtype=torch.bfloat16), "gather_in_kernel": True})
    with pytest.raises(ValueError, match=r"out: shape \[3, 128\]; expected \[10, 128\]"):  # P rows out, not M
        interface.w4a16_grouped_gemm(**{**gated, "out": torch.zeros(3, N // 2, dtype=torch.bfloat16)})


def test_early_weights():
    """early_weights (GEMM2 after GEMM1 over the same plan) is a bool, and never with a gather: GEMM1's kernel before
    it is the plan, which writes the offsets the early loads would read."""
    gated = _args(a=torch.zeros(3, K, dtype=torch.bfloat16), activation="silu", gather=torch.zeros(P, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"early_weights=True; allowed: a bool, and False with a gather"):
        interface.w4a16_grouped_gemm(**{**gated, "early_weights": True})
    with pytest.raises(TypeError, match=r"early_weights=1; allowed: a bool"):
        interface.w4a16_grouped_gemm(**{**_args(), "early_weights": 1})
    with pytest.raises(ValueError, match="the kernels do not serve this call"):  # accepted: only the device is left
        interface.w4a16_grouped_gemm(**{**_args(), "early_weights": True})
    with pytest.raises(ValueError, match="early_weights=True with gather=True"):
        interface.W4a16GroupedSm90(interface.W4Epilogue("silu"), 16, gather=True, early_weights=True)


def test_gather_rule():
    """GEMM1 gathers in the kernel up to one grouped row per expert on average (decode batches), above through a
    torch copy and TMA; only gated kernels gather."""
    assert interface.w4a16_gathers_in_kernel(4, 128) and interface.w4a16_gathers_in_kernel(128, 128)  # gpt-oss M = 1, 32
    assert not interface.w4a16_gathers_in_kernel(129, 128) and not interface.w4a16_gathers_in_kernel(512, 128)
    assert interface.w4a16_gathers_in_kernel(1, 0)
    with pytest.raises(ValueError, match="gather=True needs a gated activation"):
        interface.W4a16GroupedSm90(interface.W4Epilogue(None), 16, gather=True)


def test_variants_cover_every_epilogue():
    """Each gated activation, and the plain sums in float32 and bf16, each without a bias and with a float32 or a
    bf16 one."""
    biases = {(False, False), (True, False), (True, True)}
    want = {(act, b, b16, False) for act in interface.GATED for b, b16 in biases}
    want |= {(None, b, b16, bf16) for b, b16 in biases for bf16 in (False, True)}
    assert {(v.activation, v.has_bias, v.bias_bf16, v.rows_bf16) for v in interface.w4a16_variants()} == want


def test_bias_dtype_needs_a_bias():
    with pytest.raises(ValueError, match="bias_bf16"):
        interface.W4Epilogue(None, bias_bf16=True)


def test_m_tile_rule():
    """128-row m-tiles from 68 rows per expert on average (P / E), 64-row from 32, 32-row from 12, 16 below; E = 0
    counts as one expert."""
    assert interface.choose_w4a16_tok(68 * 128, 128) == 128  # gpt-oss M = 2176, top-4
    assert interface.choose_w4a16_tok(68 * 128 - 1, 128) == 64
    assert interface.choose_w4a16_tok(4096, 128) == 64  # gpt-oss M = 1024, top-4
    assert interface.choose_w4a16_tok(4095, 128) == 32
    assert interface.choose_w4a16_tok(1536, 128) == 32
    assert interface.choose_w4a16_tok(1535, 128) == 16
    assert interface.choose_w4a16_tok(512, 128) == 16
    assert interface.choose_w4a16_tok(12, 0) == 32
