"""A CUDA device's compute capability, cached per device: torch.cuda.get_device_capability reads the device's
properties on every call (a few µs), and the eager ops ask on every call (the plan's PDL, the reference
GEMM's torch._grouped_mm, the quantizer's row kernel)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; the current device where `device` names no index."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())
