"""Which backend runs which quantization scheme on which device, and why not when it cannot.

Backends:
- reference: plain PyTorch (moe_ops' own ops), every scheme, on any device with the dtypes it needs.
  It dequantizes weights on each call: right everywhere, fast nowhere.
- cute: the CuTe DSL grouped-GEMM kernels (cute_kernels) on Hopper (sm_90) GPUs: behind the fused ops
  of the lowering when compiled, called by fused_experts itself when eager (eager_kernels.py); for
  the fp8_w8a8 schemes in bf16 on the fp8 codes (fp8_kernels.py), for mxfp4_w4a16 in bf16 (gated
  activations) on the mxfp4 codes decoded in registers (w4_kernels.py), for the other quantized schemes on
  weights decoded per call (dequant_kernels.py).
`support_table()` prints the answer to "why is this slow / unsupported?".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant.scheme import SCHEMES

# Device types the reference runs on, with the storage dtypes they lack.
_REFERENCE_DEVICES = {
    "cpu": (),
    "cuda": (),
    "meta": (),
    "mps": (torch.float8_e4m3fn,),
}
_FP8_SCHEMES = {n for n in SCHEMES if n.startswith("fp8") or n in ("mxfp4_w4a8", "nvfp4_w4a16", "nvfp4_w4a4")}

# The activation dtypes the CuTe DSL kernels take (cute_kernels.interface has the per-call checks: H and
# I multiples of 64, row-major weights, contiguous inputs). The fp8_w8a8 schemes run them on their fp8
# codes (fp8_kernels.py); the other quantized schemes on weights decoded to that dtype on each call
# (dequant_kernels.py).
CUTE_DTYPES = (torch.bfloat16, torch.float16)
CUTE_DECODED = (
    "weights (and quantized activations) decoded to the activations' dtype on each call, then the bf16/fp16 "
    "kernels (decoded weights up to 8 GiB per GEMM)"
)
CUTE_FP8 = "the fp8 codes multiplied by fp8 WGMMA, scaled in the epilogue (per-tensor, per-row) or per k-tile (blocks)"
# The schemes the fp8 kernels serve (fp8_kernels.serves), in bf16.
CUTE_FP8_SCHEMES = ("fp8_w8a8_per_tensor", "fp8_w8a8_per_token", "fp8_w8a8_block")
CUTE_W4 = (
    "the mxfp4 codes decoded in registers by the w4a16 kernels, read as tiled at load time (tile_weights) or "
    "re-laid per call for the experts in use (gated activations; relu2 layers decoded per call)"
)
# The schemes the w4a16 kernels serve (w4_kernels.serves), in bf16.
CUTE_W4_SCHEMES = ("mxfp4_w4a16",)


@dataclass(frozen=True)
class Support:
    """One cell of the support table: whether `backend` runs `scheme` on `device`, and the reason."""

    backend: str
    scheme: str
    device: str
    supported: bool
    reason: str


def reference_support(scheme: str, device: torch.device | str) -> Support:
    """Whether the reference runs `scheme` on `device`: any device type it knows whose tensors have the
    storage dtypes the scheme needs (no float8 on MPS)."""
    dev = torch.device(device).type
    if dev not in _REFERENCE_DEVICES:
        return Support("reference", scheme, dev, False, f"device type {dev!r} is not one of {', '.join(_REFERENCE_DEVICES)}")
    if scheme in _FP8_SCHEMES and torch.float8_e4m3fn in _REFERENCE_DEVICES[dev]:
        return Support("reference", scheme, dev, False, f"{dev} has no float8_e4m3fn tensors")
    return Support("reference", scheme, dev, True, "plain PyTorch; dequantizes the weights it reads on every call")


def cute_support(scheme: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, capability=None) -> Support:
    """Whether the CuTe DSL kernels serve `scheme` with activations of `dtype` on `device`;
    capability (major, minor) defaults to the device's own."""
    dev = torch.device(device)
    label = f"{dev.type}" + (f" sm_{capability[0]}{capability[1]}" if capability else "")
    if dev.type != "cuda":
        return Support("cute", scheme, label, False, "the CuTe DSL kernels run on CUDA GPUs only")
    if capability is None:
        capability = torch.cuda.get_device_capability(dev) if torch.cuda.is_available() else None
        label = f"cuda sm_{capability[0]}{capability[1]}" if capability else "cuda"
    if capability != (9, 0):
        return Support("cute", scheme, label, False, f"the kernels use Hopper's wgmma and TMA (sm_90), device is {capability}")
    if dtype not in CUTE_DTYPES:
        return Support("cute", scheme, label, False, f"activations in {dtype}; the kernels take {CUTE_DTYPES}")
    if scheme in CUTE_FP8_SCHEMES and dtype == torch.bfloat16:  # fp8_kernels.DTYPES
        return Support("cute", scheme, label, True, CUTE_FP8)
    if scheme in CUTE_W4_SCHEMES and dtype == torch.bfloat16:
        return Support("cute", scheme, label, True, CUTE_W4)
    if scheme != "unquantized":
        return Support("cute", scheme, label, True, CUTE_DECODED)
    return Support("cute", scheme, label, True, "CuTe DSL grouped GEMMs with fused epilogues (H, I multiples of 64, row-major weights)")


def check_device_supports(scheme: str, device: torch.device) -> None:
    """Raise ValueError when no backend can run `scheme` on `device`."""
    s = reference_support(scheme, device)
    if not s.supported:
        raise ValueError(f"quant_config: scheme {scheme} cannot run on {device}: {s.reason}")


def _cell(s: Support) -> str:
    if not s.supported:
        return "no: " + s.reason
    return {CUTE_DECODED: "yes, decoded per call", CUTE_FP8: "yes, fp8 codes", CUTE_W4: "yes, mxfp4 codes"}.get(s.reason, "yes")


def support_table() -> str:
    """A markdown table: for each scheme, the reference on CPU and CUDA and the CuTe DSL kernels on
    sm_90 in bf16, with the reason where one cannot serve."""
    lines = ["| scheme | reference (cpu) | reference (cuda) | cute (cuda sm_90, bf16) |", "|---|---|---|---|"]
    for scheme in SCHEMES:
        cells = [
            reference_support(scheme, "cpu"),
            reference_support(scheme, "cuda"),
            cute_support(scheme, "cuda", torch.bfloat16, capability=(9, 0)),
        ]
        lines.append(f"| {scheme} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
