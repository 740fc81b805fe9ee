"""no_host_reads: a context in which every way an op could read a tensor value on the host, or copy a
host constant to the device, raises instead."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")
_TORCH_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select")


def _forbid(name):
    def raise_(*args, **kwargs):
        raise AssertionError(f"host sync: {name}")

    return raise_


def _no_device_constants(original, name):
    # torch.tensor(data, device=d) copies host data to d: on CUDA a synchronising copy that a CUDA
    # graph cannot capture. On the CPU it is harmless, so the test forbids the pattern by its device
    # argument, whatever the device.
    def guarded(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise AssertionError(f"host-to-device copy: {name}(..., device={kwargs['device']})")
        return original(*args, **kwargs)

    return guarded


@contextlib.contextmanager
def no_host_reads():
    """Every way a tensor value reaches the host (or a data-dependent shape is made), and every constant
    built from host data on a device, raises."""
    with contextlib.ExitStack() as stack:
        for name in _TENSOR_METHODS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, _forbid(name)))
        for name in _TORCH_FUNCTIONS:
            stack.enter_context(mock.patch.object(torch, name, _forbid(name)))
        for name in ("tensor", "as_tensor"):
            stack.enter_context(mock.patch.object(torch, name, _no_device_constants(getattr(torch, name), name)))
        yield
