"""The activation quantization op and the matching dequantizer used by the reference GEMM.

moe_ops::quantize(x [M, K], dtype, group, scale, global_scale) -> (q, scale):
- fp8 (e4m3): per-tensor static (scale [1] given) or dynamic, per-token (group [1, -1]), per-token-group
  (group [1, g], DeepSeek's 1x128): q float8_e4m3fn [M, K], scale float32 [1, 1] / [M, 1] / [M, K/g];
- int8: per-token dynamic or per-tensor static: q int8 [M, K], scale float32 [M, 1] / [1, 1];
- nvfp4: groups [1, 16] with the static float32 global scale [1] given: q uint8 [M, K/2] (packed
  e2m1), scale float8_e4m3fn [M, K/16].
On CUDA, fp8 (sm_89 on) and int8 run in Triton (quantize_kernel.py: one launch, three for a per-tensor
dynamic scale), bit for bit the torch quantizers' values.
"""
from __future__ import annotations

import torch

from .. import _checks, devices, forward_only
from . import formats
from .scheme import ActivationQuant, GroupShape

ACTIVATION_STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "nvfp4": torch.uint8}
_SCALE_DTYPE = {"fp8": torch.float32, "int8": torch.float32, "nvfp4": torch.float8_e4m3fn}
# Formats quantize_kernel.py serves on CUDA (every group they allow), and the least compute capability
# it needs: Triton converts to e4m3 from sm_89 on (elsewhere torch quantizes).
ROW_KERNEL_CAPABILITY = {"fp8": (8, 9), "int8": (0, 0)}


def _quantize_nvfp4(x, group, scale, global_scale):
    return formats.quantize_nvfp4(x, global_scale)


_QUANTIZERS = {
    "fp8": lambda x, group, scale, global_scale: formats.quantize_fp8(x, group, scale),
    "int8": lambda x, group, scale, global_scale: formats.quantize_int8(x, group, scale),
    "nvfp4": _quantize_nvfp4,
}


_QUANTIZE_NAMES = ("dtype", "group", "scale", "global_scale")


def check_quantize_recipe(dtype, group, scale, global_scale, cols, names=_QUANTIZE_NAMES, what="x") -> None:
    """The recipe of quantizing [M, cols] values: a static scale is one per-tensor scale; nvfp4 needs its
    global scale, takes no static scale and an even cols; the other formats take no global scale. names:
    the caller's argument names for (dtype, group, scale, global_scale); what: the values' name."""
    n_dtype, n_group, n_scale, n_global = names
    _checks.expect_choice(n_dtype, dtype, ACTIVATION_STORAGE)
    if len(group) != 2:
        raise ValueError(f"{n_group}: got {list(group)!r}; allowed: [rows, cols]")
    ActivationQuant(dtype, GroupShape(group[0], group[1]), static=scale is not None)  # raises on a bad group
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"{n_scale}: a static scale is one per-tensor value, got shape {tuple(scale.shape)}")
    if dtype == "nvfp4":
        if cols % 2:
            raise ValueError(f"{what}: nvfp4 packs two values per byte; K must be even, got K={cols}")
        if global_scale is None:
            raise ValueError(f"{n_global}: nvfp4 needs its float32 global scale [1], got None")
        if global_scale.numel() != 1:
            raise ValueError(f"{n_global}: expected one value [1], got shape {tuple(global_scale.shape)}")
    elif global_scale is not None:
        raise ValueError(f"{n_global}: only nvfp4 uses a global scale, got one for {dtype}")


def check_quantize_args(x, dtype, group, scale, global_scale) -> None:
    """The op's arguments (shapes, dtypes and devices only, no values: safe under compile). Checked in the
    real and the fake impl alike, so neither accepts what the other rejects (a static scale with a
    per-token group came back [1, 1] from the real impl and [M, 1] from the fake; a scale on meta beside
    x on the CPU dispatched the call to the fake impl, which returned uninitialised CPU tensors)."""
    _checks.expect_choice("dtype", dtype, ACTIVATION_STORAGE)
    _checks.expect_ndim("x", x, 2, "[M, K]")
    _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
    check_quantize_recipe(dtype, group, scale, global_scale, x.shape[1])
    _checks.expect_same_device({"x": x, "scale": scale, "global_scale": global_scale})


def _quantize(
    x: torch.Tensor,
    dtype: str,
    group: list[int],
    scale: torch.Tensor | None,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation quantization (the body of moe_ops::quantize); see the module docstring."""
    check_quantize_args(x, dtype, group, scale, global_scale)
    group_t = (group[0], group[1])
    if (
        x.device.type == "cuda" and dtype in ROW_KERNEL_CAPABILITY
        and devices.capability(x.device) >= ROW_KERNEL_CAPABILITY[dtype]
    ):  # fmt: skip
        from .quantize_kernel import quantize_rows  # Triton: imported where it runs

        return quantize_rows(x, dtype, group_t, scale)  # one to three launches, the same values
    static = scale.reshape(1, 1) if scale is not None else None
    q, s = _QUANTIZERS[dtype](x, group_t, static, global_scale)
    # A static scale comes back as a fresh tensor: custom ops may not return (aliases of) their inputs.
    return q.contiguous(), s.to(_SCALE_DTYPE[dtype]).clone().contiguous()


# The body stays callable as _quantize: on meta tensors the op itself runs its fake impl, so a test of
# the real impl's host syncs calls the body.
quantize = torch.library.custom_op("moe_ops::quantize", _quantize, mutates_args=())


@quantize.register_fake
def _quantize_fake(x, dtype, group, scale, global_scale):
    check_quantize_args(x, dtype, group, scale, global_scale)
    m, k = x.shape
    packing = 2 if dtype == "nvfp4" else 1
    sr, sc = formats.scale_shape((group[0], group[1]), m, k)
    return (
        x.new_empty((m, k // packing), dtype=ACTIVATION_STORAGE[dtype]),
        x.new_empty((sr, sc), dtype=_SCALE_DTYPE[dtype]),
    )


def dequantize_activation(
    a: torch.Tensor, dtype: str, group: list[int], scale: torch.Tensor | None, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """Activations as stored ([M, K] or packed [M, K/2]) -> float32 [M, K]; dtype "none" means the
    activations are not quantized."""
    if dtype == "none":
        return a.float()
    return formats.dequantize(a, dtype, (group[0], group[1]), scale, global_scale)


forward_only.register(quantize)
