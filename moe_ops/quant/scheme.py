"""The tensor-free description of a quantization scheme: which dtype and group shape the activations
and the weights of both GEMMs use. QuantConfig (config.py) adds the tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import PACKING


@dataclass(frozen=True)
class GroupShape:
    """Rows x cols of the block that shares one scale; -1 spans the whole dimension.
    For activations [M, K]: (-1, -1) per-tensor, (1, -1) per-token, (1, 128) per-token-group.
    For one expert's weight [N, K]: (-1, -1) per-tensor, (1, -1) per-channel, (128, 128) blocks,
    (1, g) groups of g along K."""

    rows: int
    cols: int

    def __post_init__(self):
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not (v == -1 or v >= 1):
                raise ValueError(f"GroupShape.{name}: got {v!r}; allowed: -1 (whole dimension) or an int >= 1")

    @property
    def kind(self) -> str:
        """per-tensor, per-row, 1xG (groups along the row) or GxG (square blocks)."""
        if (self.rows, self.cols) == (-1, -1):
            return "per-tensor"
        if (self.rows, self.cols) == (1, -1):
            return "per-row"
        if self.rows == 1 and self.cols > 1:
            return "1xG"
        if self.rows == self.cols and self.rows > 1:
            return "GxG"
        return "other"

    def astuple(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def __str__(self) -> str:
        return {"per-tensor": "per-tensor", "per-row": "per-row"}.get(self.kind, f"{self.rows}x{self.cols}")


PER_TENSOR = GroupShape(-1, -1)
PER_TOKEN = GroupShape(1, -1)
PER_CHANNEL = GroupShape(1, -1)

# Activation formats: storage dtype of the quantized activations, group kinds allowed, fixed group.
ACTIVATION_FORMATS = {
    "fp8": dict(storage=torch.float8_e4m3fn, kinds=("per-tensor", "per-row", "1xG")),
    "int8": dict(storage=torch.int8, kinds=("per-tensor", "per-row")),
    "nvfp4": dict(storage=torch.uint8, kinds=("1xG",), group=GroupShape(1, 16)),
}
# Weight formats: storage dtype, group kinds allowed, fixed group, scale dtypes.
WEIGHT_FORMATS = {
    "fp8": dict(storage=torch.float8_e4m3fn, kinds=("per-tensor", "per-row", "GxG"), scales=(torch.float32,)),
    "int8": dict(storage=torch.int8, kinds=("per-row", "1xG"), scales=(torch.float32,)),
    "int4": dict(
        storage=torch.uint8, kinds=("1xG",), scales=(torch.float32, torch.bfloat16, torch.float16)
    ),
    "nvfp4": dict(storage=torch.uint8, kinds=("1xG",), group=GroupShape(1, 16), scales=(torch.float8_e4m3fn,)),
    "mxfp4": dict(storage=torch.uint8, kinds=("1xG",), group=GroupShape(1, 32), scales=(torch.uint8,)),
}


# WeightQuant.tiled: untiled, or tiled with GEMM1's gate and up rows as a gated activation reads them.
TILED_GATES = (None, "concat", "interleaved")


def _check_flag(what: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected a bool, got {value!r} ({type(value).__name__})")


def _check_format(what: str, table: dict, dtype: str, group: GroupShape) -> None:
    if not isinstance(dtype, str):
        raise TypeError(f"{what}.dtype: expected a str, got {dtype!r} ({type(dtype).__name__}); allowed: {', '.join(map(repr, table))}")
    if dtype not in table:
        raise ValueError(f"{what}.dtype: got {dtype!r}; allowed: {', '.join(map(repr, table))}")
    if not isinstance(group, GroupShape):
        raise TypeError(f"{what}.group: expected a GroupShape, got {type(group).__name__}")
    spec = table[dtype]
    fixed = spec.get("group")
    if fixed is not None and group != fixed:
        raise ValueError(f"{what}.group: {dtype} uses groups of {fixed}, got {group}")
    if group.kind not in spec["kinds"]:
        raise ValueError(f"{what}.group: {group} is not a {dtype} group shape; allowed kinds: {', '.join(spec['kinds'])}")


@dataclass(frozen=True)
class ActivationQuant:
    """How the inputs of both GEMMs are quantized. static: a calibrated per-tensor scale is given
    (QuantConfig.a13_scale / a2_scale); otherwise scales are computed from each batch."""

    dtype: str
    group: GroupShape
    static: bool = False

    def __post_init__(self):
        _check_format("ActivationQuant", ACTIVATION_FORMATS, self.dtype, self.group)
        _check_flag("ActivationQuant.static", self.static)
        if self.static and self.group.kind != "per-tensor":
            raise ValueError(f"ActivationQuant.static: only per-tensor scales can be static, got group {self.group}")

    @property
    def storage(self) -> torch.dtype:
        return ACTIVATION_FORMATS[self.dtype]["storage"]

    @property
    def packing(self) -> int:
        return 2 if self.dtype == "nvfp4" else 1


@dataclass(frozen=True)
class WeightQuant:
    """How w13 and w2 are stored. zero_point: int4 with per-group zero points (asymmetric). tiled: None for
    codes and scales as stored; "concat" or "interleaved" for mxfp4 weights in the w4a16 kernels' layout, scales
    inside, uint8 [E, N, B] (tiled.py, tile_mxfp4_weights), GEMM1's tiles pairing the gate and up rows of a
    gated activation that reads them as [gate; up] halves or interleaved pairs."""

    dtype: str
    group: GroupShape
    zero_point: bool = False
    tiled: str | None = None

    def __post_init__(self):
        _check_format("WeightQuant", WEIGHT_FORMATS, self.dtype, self.group)
        _check_flag("WeightQuant.zero_point", self.zero_point)
        if self.tiled not in TILED_GATES:
            raise ValueError(f"WeightQuant.tiled: got {self.tiled!r}; allowed: {', '.join(map(repr, TILED_GATES))}")
        if self.zero_point and self.dtype != "int4":
            raise ValueError(f"WeightQuant.zero_point: only int4 has zero points, got dtype {self.dtype!r}")
        if self.tiled is not None and self.dtype != "mxfp4":
            raise ValueError(f"WeightQuant.tiled: only mxfp4 weights are tiled (for the w4a16 kernels), got dtype {self.dtype!r}")

    @property
    def storage(self) -> torch.dtype:
        return WEIGHT_FORMATS[self.dtype]["storage"]

    @property
    def packing(self) -> int:
        return PACKING[self.dtype]

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        return WEIGHT_FORMATS[self.dtype]["scales"]


def op_args(q: ActivationQuant | WeightQuant | None) -> tuple[str, list[int]]:
    """(dtype, group) as the ops take them: "none" and [-1, -1] when not quantized."""
    return ("none", [-1, -1]) if q is None else (q.dtype, list(q.group.astuple()))


def _act_key(a: ActivationQuant | None) -> tuple | None:
    return None if a is None else (a.dtype, a.group.kind)


# name -> (allowed activation keys, allowed weight keys); a key is (dtype, group kind) or None.
SCHEMES = {
    "unquantized": ({None}, {None}),
    "fp8_w8a8_per_tensor": ({("fp8", "per-tensor")}, {("fp8", "per-tensor")}),
    "fp8_w8a8_per_token": ({("fp8", "per-row")}, {("fp8", "per-row")}),
    "fp8_w8a8_block": ({("fp8", "1xG")}, {("fp8", "GxG")}),
    "int8_w8a8": ({("int8", "per-row"), ("int8", "per-tensor")}, {("int8", "per-row")}),
    "fp8_w8a16": ({None}, {("fp8", "per-tensor"), ("fp8", "per-row"), ("fp8", "GxG")}),
    "int8_w8a16": ({None}, {("int8", "per-row"), ("int8", "1xG")}),
    "int4_w4a16": ({None}, {("int4", "1xG")}),
    "nvfp4_w4a16": ({None}, {("nvfp4", "1xG")}),
    "nvfp4_w4a4": ({("nvfp4", "1xG")}, {("nvfp4", "1xG")}),
    "mxfp4_w4a16": ({None}, {("mxfp4", "1xG")}),
    "mxfp4_w4a8": ({("fp8", "per-tensor"), ("fp8", "per-row")}, {("mxfp4", "1xG")}),
}


def _describe(key) -> str:
    return "none" if key is None else f"{key[0]} {key[1]}"


@dataclass(frozen=True)
class QuantScheme:
    """Activation and weight quantization shared by both GEMMs of the layer; `name` is the entry of
    SCHEMES it matches. An unsupported combination raises ValueError listing the allowed ones."""

    activation: ActivationQuant | None = None
    weight: WeightQuant | None = None

    def __post_init__(self):
        if self.activation is not None and not isinstance(self.activation, ActivationQuant):
            raise TypeError(f"QuantScheme.activation: expected ActivationQuant or None, got {type(self.activation).__name__}")
        if self.weight is not None and not isinstance(self.weight, WeightQuant):
            raise TypeError(f"QuantScheme.weight: expected WeightQuant or None, got {type(self.weight).__name__}")
        self.name  # validates the combination
        a, w = self.activation, self.weight
        if w is not None and w.tiled is not None and a is not None:
            raise ValueError(f"QuantScheme: tiled mxfp4 weights are for 16-bit activations (mxfp4_w4a16), got activations {a.dtype} {a.group}")
        if self.name == "fp8_w8a8_block" and (a.group.cols != w.group.cols):
            raise ValueError(
                f"QuantScheme: block scaling needs activation groups 1x{w.group.cols} for weight blocks "
                f"{w.group}, got {a.group}"
            )

    @property
    def name(self) -> str:
        a, w = _act_key(self.activation), None if self.weight is None else (self.weight.dtype, self.weight.group.kind)
        for name, (acts, weights) in SCHEMES.items():
            if a in acts and w in weights:
                return name
        allowed = "; ".join(
            f"{n}: activations {' or '.join(sorted(map(_describe, acts), key=str))}, "
            f"weights {' or '.join(sorted(map(_describe, ws), key=str))}"
            for n, (acts, ws) in SCHEMES.items()
        )
        raise ValueError(f"QuantScheme: activations {_describe(a)} with weights {_describe(w)} is not supported; allowed: {allowed}")

    @property
    def tiled(self) -> str | None:
        """The weights' WeightQuant.tiled: None for weights as stored (or none quantized)."""
        return None if self.weight is None else self.weight.tiled

    def describe(self) -> str:
        """The scheme in words (activations, then weights), for error messages."""
        a = "bf16/fp16/fp32" if self.activation is None else f"{self.activation.dtype} {self.activation.group}" + (
            " static" if self.activation.static else ""
        )
        w = "unquantized" if self.weight is None else f"{self.weight.dtype} {self.weight.group}" + (
            " zero-point" if self.weight.zero_point else ""
        ) + (f" tiled ({self.weight.tiled} gates)" if self.weight.tiled else "")
        return f"{self.name} (activations {a}; weights {w})"


UNQUANTIZED = QuantScheme()
