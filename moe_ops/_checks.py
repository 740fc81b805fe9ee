"""Argument checks shared by the public API: each raises ValueError/TypeError naming the argument,
what was given and what is allowed, before any kernel runs."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Float inputs that are only read, never computed in (checkpoints, calibration samples): float64 too.
SOURCE_FLOAT_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _names(values: Iterable) -> str:
    return ", ".join(str(v) for v in values)


def expect_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def expect_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} is not allowed; allowed: {_names(allowed)}")


def expect_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D {layout}, got shape {tuple(t.shape)}")


def expect_shape(name: str, t: torch.Tensor, shape: Sequence, layout: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({layout}), got {tuple(t.shape)}")


def expect_same_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(
                f"{name}: on {t.device}, but {first_name} is on {first.device}; all tensors must share one device"
            )
    return first.device


def expect_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # stride first: with an unbacked token count, numel() > 0 would be a data-dependent guard
    if t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(
            f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}; call .contiguous()"
        )


def expect_matrix_layout(name: str, t: torch.Tensor) -> None:
    """Each expert's [N, K] matrix must be row-major (K contiguous) or column-major (N contiguous)."""
    if t.numel() == 0:
        return
    if t.stride(2) != 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name}: each expert's matrix must be row-major (stride(2) == 1) or column-major (stride(1) == 1), "
            f"got strides {t.stride()}; call .contiguous()"
        )


def expect_bool(name: str, value, *, optional: bool = False) -> None:
    """value is a bool (or None where optional): a truthy string or number would quietly switch the option."""
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "a bool or None" if optional else "a bool"
    raise TypeError(f"{name}: expected {allowed}, got {type(value).__name__} {value!r}")


def expect_choice(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: got {value!r}; allowed: {_names(repr(a) for a in allowed)}")


# Off inside moe_ops.value_checks(False); a ContextVar, so a block in one thread leaves others alone.
_VALUE_CHECKS = contextvars.ContextVar("moe_ops_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Context manager: inside the block, the eager checks that read tensor values (expert ids within
    [0, E), expert_map entries, finite calibration samples and weights) run (True, the default) or not
    (False). Off, an eager call on a GPU makes no host synchronisation (on, each layer call waits to
    read back the expert ids' smallest and largest values), and bad values are handled as under
    torch.compile: a pair whose expert id is out of range contributes nothing. Shape, dtype and device
    checks always run."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Checks that read tensor values (a device-to-host sync) run only in eager mode: never while
    torch.compile traces nor while a CUDA graph is being captured, nor inside value_checks(False)."""
    if torch.compiler.is_compiling():
        return False  # first: Dynamo then never traces the ContextVar below
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return _VALUE_CHECKS.get()


def has_values(t: torch.Tensor) -> bool:
    """Whether t holds values to read: meta tensors and FakeTensorMode's fake tensors have none."""
    return not (t.is_meta or is_fake(t))


# expect_finite's reason for calibration samples
NAN_SCALES = "; static activation scales calibrated on it would be NaN/inf"


def expect_finite(name: str, t: torch.Tensor, why: str = "") -> None:
    """Eager-only: t holds no NaN or inf (why: appended to the message). Skipped for tensors without values."""
    if not value_checks_enabled() or not has_values(t) or t.numel() == 0:  # numel last: a guard under compile
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: holds NaN or inf{why}")


def expect_values_in_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Eager-only: every value of t lies in [low, high). Skipped for tensors without values (meta, fake)."""
    if not value_checks_enabled() or not has_values(t) or t.numel() == 0:  # numel last: a guard under compile
        return
    # One reduction and two scalar reads: on the H200 host 32 µs against 45 for compare, compare, or, any
    # and a read, paid by every eager layer call (bench/NOTES.md v65). The slow path finds the value to name.
    lo, hi = torch.aminmax(t.reshape(-1))
    if lo.item() < low or hi.item() >= high:
        first = t[(t < low) | (t >= high)][0].item()
        raise ValueError(f"{name}: value {first} is outside [{low}, {high}) ({what})")


def expect_positive(name: str, t: torch.Tensor, why: str = "") -> None:
    """Eager-only: every value of t is finite and > 0 (why: appended to the message). Skipped for tensors
    without values."""
    if not value_checks_enabled() or not isinstance(t, torch.Tensor) or not has_values(t) or t.numel() == 0:
        return
    ok = torch.isfinite(t) & (t > 0)
    if not bool(ok.all()):
        raise ValueError(f"{name}: holds {t[~ok][0].item()}; allowed: finite values > 0{why}")


def argparse_int(low: int):
    """An argparse type: an int >= low (argparse turns the ArgumentTypeError into a usage error)."""
    import argparse

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"got {value}; allowed: an int >= {low}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value: 'x'"
    return parse
