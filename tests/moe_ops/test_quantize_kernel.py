"""moe_ops/quant/quantize_kernel.py: moe_ops::quantize on CUDA (one Triton launch for fp8 / int8 groups
within a row and static scales, three for per-tensor dynamic scales) gives the torch quantizers' codes
and scales bit for bit, NaN, inf, saturation, zero rows and ragged groups included. GPU only: the kernel
casts to e4m3 in hardware."""
from __future__ import annotations

import pytest
import torch

from moe_ops.quant import formats
from moe_ops.quant.quantize import _QUANTIZERS, _SCALE_DTYPE, quantize

# dtype, group, static, K (200: a ragged last group of 128)
CASES = [
    ("fp8", [1, 128], False, 512), ("fp8", [1, 128], False, 200), ("fp8", [1, -1], False, 2880), ("fp8", [-1, -1], True, 768),
    ("int8", [1, -1], False, 512), ("int8", [-1, -1], True, 300), ("int8", [1, -1], False, 7168),
    # per-tensor dynamic: the amax over every row skips the NaN and inf rows
    ("fp8", [-1, -1], False, 2880), ("fp8", [-1, -1], False, 200), ("int8", [-1, -1], False, 768),
]  # fmt: skip


def _x(m, k, dtype):
    """Random rows of very different magnitudes with the cases that matter: a NaN, an inf, a -inf, values
    beyond a static scale's range, a zero row."""
    x = torch.randn(m, k, device="cuda") * torch.exp(3 * torch.randn(m, 1, device="cuda"))
    x[1, 5] = float("nan")
    x[2, k - 1] = float("inf")
    x[3, 0] = float("-inf")
    x[4] = 0.0
    x[5, :7] = torch.tensor([1e4, -1e4, 3e38, -3e38, 1e-30, -0.0, 448.0])
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() > 1:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt, group, static, k", CASES)
def test_the_kernel_gives_the_torch_quantizers_values(fmt, group, static, k, x_dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = _x(37, k, x_dtype)
    scale = torch.tensor([0.05], device="cuda") if static else None
    q, s = quantize(x, fmt, group, scale, None)
    want_q, want_s = _QUANTIZERS[fmt](x, tuple(group), None if scale is None else scale.reshape(1, 1), None)
    assert _same(q, want_q.contiguous()), (fmt, group, static, k)
    assert _same(s, want_s.to(_SCALE_DTYPE[fmt]))
    # and a column slice of a wider tensor (a row stride other than K)
    wide = torch.cat([x, x], dim=1)[:, 3 : 3 + k]
    q2, s2 = quantize(wide, fmt, group, scale, None)
    want_q2, want_s2 = _QUANTIZERS[fmt](wide, tuple(group), None if scale is None else scale.reshape(1, 1), None)
    assert _same(q2, want_q2.contiguous()) and _same(s2, want_s2.to(_SCALE_DTYPE[fmt]))


@pytest.mark.gpu
def test_the_cuda_op_passes_opcheck_and_takes_one_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moe_ops.bench import kernel_launches

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(quantize, (x, "fp8", [1, 128], None, None))
    torch.library.opcheck(quantize, (x, "int8", [-1, -1], torch.tensor([0.02], device="cuda"), None))
    names = kernel_launches(lambda: quantize(x, "fp8", [1, 128], None, None))
    assert sum("quantize_kernel" in n for n in names) == 1 and len(names) == 1, names
    assert quantize(x[:0], "fp8", [1, 128], None, None)[1].shape == (0, 2)
    # Per-tensor dynamic: the amax's zeroed float32, the amax, the quantizing.
    torch.library.opcheck(quantize, (x, "fp8", [-1, -1], None, None))
    names = kernel_launches(lambda: quantize(x, "fp8", [-1, -1], None, None))
    assert [("amax_kernel" in n, "quantize_kernel" in n) for n in names[1:]] == [(True, False), (False, True)], names
    assert len(names) == 3, names
    empty = quantize(x[:0], "fp8", [-1, -1], None, None)[1]
    assert torch.equal(empty.cpu(), formats.quantize_fp8(x[:0].cpu(), (-1, -1))[1])  # [1, 1]: the float32 TINY


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("bad", ["none", "nan", "inf"])
def test_one_row_per_tensor_scale_is_the_rows_own_in_one_launch(fmt, bad):
    """A per-tensor dynamic scale of one row (x of a decode step): the group lies within the row, so the
    torch quantizer lets a NaN or inf make the scale NaN or inf (formats.group_amax) where the amax over
    several rows skips it. The kernel gives the same codes and [1, 1] scale bit for bit, in one launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moe_ops.bench import kernel_launches

    x = torch.randn(1, 2048, device="cuda") * 30
    if bad != "none":
        x[0, 77] = float(bad)
    x = x.to(torch.bfloat16)
    q, s = quantize(x, fmt, [-1, -1], None, None)
    want_q, want_s = _QUANTIZERS[fmt](x, (-1, -1), None, None)
    assert s.shape == (1, 1) and _same(q, want_q.contiguous()) and _same(s, want_s.to(_SCALE_DTYPE[fmt])), (q, want_q, s, want_s)
    assert s.isfinite().item() == (bad == "none")
    assert len(kernel_launches(lambda: quantize(x, fmt, [-1, -1], None, None))) == 1


def test_zero_rows_on_the_cpu_match_the_shapes_the_kernel_gives():
    """The kernel's empty result (no launch) has the reference's shapes: [0, groups] scales."""
    q, s = formats.quantize_fp8(torch.zeros(0, 256), (1, 128))
    assert q.shape == (0, 256) and s.shape == (0, 2)
