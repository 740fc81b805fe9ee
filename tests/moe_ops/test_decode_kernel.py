"""moe_ops/decode_kernel.py: the Triton decoding of quantized expert weights equals the reference's torch
decoding (formats.dequantize, then the cast) bit for bit, NaN codes and scales included, for every
weight format and group kind, per-row (an index per output) and whole: on the CPU in Triton's
interpreter, on a GPU compiled."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import needs_interpreter, run_interpreted

# fmt, group, zero points
CASES = [
    ("fp8", (-1, -1), False), ("fp8", (1, -1), False), ("fp8", (32, 32), False), ("int8", (1, -1), False),
    ("int8", (1, 32), False), ("int4", (1, 32), False), ("int4", (1, 32), True), ("nvfp4", (1, 16), False),
    ("mxfp4", (1, 32), False),
    # groups that do not tile the kernel's 256-column block (a scale per element), and a block inside
    # one of two column groups
    ("int4", (1, 96), True), ("fp8", (256, 256), False),
]  # fmt: skip

_SCRIPT = r"""
import sys, torch
from moe_ops.decode_kernel import decode_experts
from moe_ops.quant import formats
from moe_ops.quant.config import quantize_weight
from moe_ops.quant.scheme import GroupShape, WeightQuant
seed, fmt, gr, gc, zp, device = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
g = torch.Generator().manual_seed(seed)
wq = WeightQuant(fmt, GroupShape(gr, gc), zero_point=zp) if fmt == "int4" else WeightQuant(fmt, GroupShape(gr, gc))
# rows and columns that end mid-tile, experts of very different magnitudes
w = torch.randn(5, 40, 288, generator=g) * torch.exp(2 * torch.randn(5, 40, 1, generator=g))
t = {k: (v.to(device) if v is not None else None) for k, v in quantize_weight(w, wq).items()}
if fmt == "fp8":
    t["q"].view(torch.uint8)[3, 3, :7] = 0x7F  # NaN codes (expert 3: read by both paths)
    t["q"].view(torch.uint8)[0, 5, :5] = torch.tensor([0x01, 0x81, 0x07, 0x7E, 0xFE], dtype=torch.uint8)  # subnormals, +-448
if fmt == "mxfp4":
    t["scale"][3, 2, 1] = 255  # the e8m0 NaN: a whole block of NaN
bad = 0
for dtype in (torch.bfloat16, torch.float16):
    for idx, count in ((torch.tensor([3, 0, 3, 4], device=device), 4), (None, 5)):
        got = decode_experts(t["q"], fmt, (gr, gc), t["scale"], t["global_scale"], t["zero"], idx, count, dtype)
        sel = idx if idx is not None else slice(None)
        pick = lambda x: None if x is None else (x[sel] if x.dim() and x.shape[0] == 5 else x)
        want = formats.dequantize(t["q"][sel], fmt, (gr, gc), pick(t["scale"]), pick(t["global_scale"]), pick(t["zero"])).to(dtype)
        same = torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        if not same or got.shape != want.shape or got.dtype != dtype:
            bad += 1
            print("differs:", dtype, idx is not None, (got.float() - want.float()).abs().nan_to_num().max().item())
        if fmt in ("fp8", "mxfp4") and not want.isnan().any():
            print("the NaN case did not happen")
            bad += 1
    # With offsets, entries without grouped rows are left as they were (a sentinel no code decodes to).
    for idx, count, offsets in ((None, 5, [0, 2, 2, 5, 5, 7]), (torch.tensor([3, 0, 3, 4], device=device), 4, [0, 1, 1, 2, 2])):
        out = torch.full((count, 40, 288), -12345.0, dtype=dtype, device=device)
        offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
        got = decode_experts(t["q"], fmt, (gr, gc), t["scale"], t["global_scale"], t["zero"], idx, count, dtype, offsets=offsets, out=out)
        full = decode_experts(t["q"], fmt, (gr, gc), t["scale"], t["global_scale"], t["zero"], idx, count, dtype)
        active = (offsets[1:] > offsets[:-1]).cpu()
        if got.data_ptr() != out.data_ptr() or not (got[~active] == -12345.0).all():
            bad += 1
            print("an entry without rows was written:", dtype, idx is not None)
        if not torch.equal(got[active].nan_to_num(), full[active].nan_to_num()) or not torch.equal(got[active].isnan(), full[active].isnan()):
            bad += 1
            print("an entry with rows differs:", dtype, idx is not None)
print("bad", bad)
"""


def test_decode_rejects_a_wrong_out_or_offsets():
    from moe_ops.decode_kernel import decode_experts

    q = torch.zeros(3, 8, 32, dtype=torch.float8_e4m3fn)
    scale = torch.ones(3, 1, 1)
    with pytest.raises(ValueError, match=r"offsets: expected \[4\]"):
        decode_experts(q, "fp8", (-1, -1), scale, None, None, None, 3, torch.bfloat16, offsets=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out: expected a contiguous torch.bfloat16 \[3, 8, 32\]"):
        decode_experts(q, "fp8", (-1, -1), scale, None, None, None, 3, torch.bfloat16, out=torch.empty(3, 8, 31, dtype=torch.bfloat16))


def _args(fmt, group, zp, device):
    return (torch.initial_seed() % 2**31, fmt, group[0], group[1], int(zp), device)


@needs_interpreter
@pytest.mark.parametrize("fmt, group, zp", CASES)
def test_decode_matches_the_reference_in_the_interpreter(fmt, group, zp):
    out = run_interpreted(_SCRIPT, *_args(fmt, group, zp, "cpu"))
    assert out.strip().endswith("bad 0"), out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, group, zp", CASES)
def test_decode_matches_the_reference_on_the_gpu(fmt, group, zp):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import os
    import subprocess
    import sys

    from tests.triton_interpreter import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *map(str, _args(fmt, group, zp, "cuda"))], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("bad 0"), proc.stdout + proc.stderr
