"""QuantConfig: a QuantScheme plus the tensors it needs for both GEMMs, the factories that build each
supported scheme, and the reference quantizer that turns float expert weights into any scheme."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .. import _checks
from . import formats, tiled
from .scheme import (
    PER_CHANNEL,
    PER_TENSOR,
    PER_TOKEN,
    UNQUANTIZED,
    ActivationQuant,
    GroupShape,
    QuantScheme,
    WeightQuant,
)

_TENSOR_FIELDS = (
    "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "w13_zero", "w2_zero",
    "a13_scale", "a2_scale", "a13_global_scale", "a2_global_scale", "w13_bias", "w2_bias",
)  # fmt: skip


def _required_fields(scheme: QuantScheme) -> set[str]:
    """The tensor fields a scheme needs; every other tensor field (biases aside) must be None."""
    need: set[str] = set()
    w, a = scheme.weight, scheme.activation
    if w is not None and w.tiled is None:  # tiled weights hold their scales
        need |= {"w13_scale", "w2_scale"}
        if w.dtype == "nvfp4":
            need |= {"w13_global_scale", "w2_global_scale"}
        if w.zero_point:
            need |= {"w13_zero", "w2_zero"}
    if a is not None:
        if a.static:
            need |= {"a13_scale", "a2_scale"}
        if a.dtype == "nvfp4":
            need |= {"a13_global_scale", "a2_global_scale"}
    return need


# Not frozen: torch 2.11's Dynamo cannot build a frozen dataclass that holds existing objects inside a
# compiled region ("sourceless builder"), and models build their config in forward().
@dataclass(eq=False)
class QuantConfig:
    """Quantization of one MoE layer: the scheme, and per GEMM (13: gate/up, 2: down):
    - w*_scale [E, cdiv(N, gr), cdiv(K, gc)]: weight dequantization scales (see formats.py for dtypes);
    - w*_global_scale float32 [E]: nvfp4 weights' global scales;
    - w*_zero uint8 [E, N, K / g]: int4 zero points (codes 0..15);
    - a*_scale float32 [1]: static per-tensor activation scales (dynamic when the scheme is not static);
    - a*_global_scale float32 [1]: nvfp4 activations' global scales;
    - w*_bias [E, N]: biases, added after dequantization (also allowed for unquantized layers).
    """

    scheme: QuantScheme = UNQUANTIZED
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None
    w13_zero: torch.Tensor | None = None
    w2_zero: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    a13_global_scale: torch.Tensor | None = None
    a2_global_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.scheme, QuantScheme):
            raise TypeError(f"QuantConfig.scheme: expected a QuantScheme, got {type(self.scheme).__name__}")
        need = _required_fields(self.scheme)
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                _checks.expect_tensor(f"QuantConfig.{name}", value)
            if name in need and value is None:
                raise ValueError(f"QuantConfig.{name}: required by scheme {self.scheme.describe()}, got None")
            if name not in need and not name.endswith("_bias") and value is not None:
                raise ValueError(
                    f"QuantConfig.{name}: given, but scheme {self.scheme.describe()} does not use it; "
                    f"it uses: {', '.join(sorted(need)) or 'no scale tensors'}"
                )
        if not torch.compiler.is_compiling():
            # Scales, zero points and biases are shaped by the weights: constants of the model. Marked
            # static, a compiled model reading them through this config neither treats their sizes as
            # symbols nor duck-sizes a scale dimension of 1 with a token count of 1.
            for name in _TENSOR_FIELDS:
                if getattr(self, name) is not None:
                    torch._dynamo.mark_static(getattr(self, name))

    @property
    def name(self) -> str:
        return self.scheme.name

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every tensor field by name (None where absent)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scheme"}

    def gemm(self, which: str) -> dict[str, torch.Tensor | None]:
        """The tensors of GEMM "13" or "2", keyed without the prefix (w_scale, a_scale, ...)."""
        return {
            "a_scale": getattr(self, f"a{which}_scale"),
            "a_global_scale": getattr(self, f"a{which}_global_scale"),
            "w_scale": getattr(self, f"w{which}_scale"),
            "w_global_scale": getattr(self, f"w{which}_global_scale"),
            "w_zero": getattr(self, f"w{which}_zero"),
            "bias": getattr(self, f"w{which}_bias"),
        }

    def check_weight_dtypes(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The weights are stored as this config's format stores them (float for unquantized weights), checked
        before any size is derived from them (tiled weights: check_tiled)."""
        wq = self.scheme.weight
        if wq is not None and wq.tiled is not None:
            return
        allowed = (wq.storage,) if wq is not None else _checks.FLOAT_DTYPES
        hint = ", quantized codes need the quant_config that describes them" if wq is None else ""
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype not in allowed:
                raise TypeError(f"{name}: dtype {w.dtype} is not allowed; allowed: {_checks._names(allowed)} (quant_config {self.name}{hint})")

    def check_weights(self, w13: torch.Tensor, w2: torch.Tensor, hidden: int, intermediate: int, n13: int) -> None:
        """Shapes and dtypes of the weights and every tensor of this config against the layer's
        E, hidden size H and intermediate size I (w13 holds n13 = 2I or I output rows)."""
        self.check_weight_dtypes(w13, w2)
        num_experts = w13.shape[0]
        for which, w, n, k in (("13", w13, n13, hidden), ("2", w2, hidden, intermediate)):
            t = self.gemm(which)
            _check_weight(f"w{which}", self.scheme.weight, w, t, num_experts, n, k)
            _check_activation(f"a{which}", self.scheme.activation, t, k)
            if t["bias"] is not None:
                _checks.expect_shape(f"w{which}_bias", t["bias"], (num_experts, n), "[E, N]")
                _checks.expect_dtype(f"w{which}_bias", t["bias"], _checks.FLOAT_DTYPES)


def _check_weight(name, wq: WeightQuant | None, w, t, num_experts, n, k):
    """Shapes and scales of one GEMM's weights (their dtype: QuantConfig.check_weight_dtypes)."""
    if wq is None:
        return
    if wq.tiled is not None:
        # The tiled size does not depend on the tile kind (both hold N rows in whole 128-row tiles).
        tiled.check_tiled(name, w, "mxfp4_tiled_rows", k)
        _checks.expect_shape(name, w, (num_experts, n, w.shape[2]), f"[E, N, B] tiled {wq.dtype}")
        return
    packed_k = formats.cdiv(k, wq.packing)
    _checks.expect_shape(name, w, (num_experts, n, packed_k), f"[E, N, K/{wq.packing}] {wq.dtype}")
    group = wq.group.astuple()
    if wq.packing > 1 and k % 2:
        raise ValueError(f"{name}: {wq.dtype} packs two values per byte; K={k} must be even")
    if wq.group.kind == "1xG" and k % wq.group.cols:
        raise ValueError(f"{name}: K={k} must be a multiple of the {wq.dtype} group size {wq.group.cols}")
    sshape = (num_experts, *formats.scale_shape(group, n, k))
    _checks.expect_shape(f"{name}_scale", t["w_scale"], sshape, f"[E, N/{group[0]}, K/{group[1]}]")
    _checks.expect_dtype(f"{name}_scale", t["w_scale"], wq.scale_dtypes)
    if wq.dtype == "nvfp4":
        _checks.expect_shape(f"{name}_global_scale", t["w_global_scale"], (num_experts,), "[E]")
        _checks.expect_dtype(f"{name}_global_scale", t["w_global_scale"], (torch.float32,))
    if wq.zero_point:
        _checks.expect_shape(f"{name}_zero", t["w_zero"], sshape, "like the scales")
        _checks.expect_dtype(f"{name}_zero", t["w_zero"], (torch.uint8,))


def _check_activation(name, aq: ActivationQuant | None, t, k):
    if aq is None:
        return
    if aq.packing > 1 and k % 16:
        raise ValueError(f"{name}: nvfp4 activations need K={k} to be a multiple of 16")
    for key in ("a_scale", "a_global_scale"):
        if t[key] is not None:
            label = f"{name}{key[1:]}"
            _checks.expect_shape(label, t[key], (1,), "[1]")
            _checks.expect_dtype(label, t[key], (torch.float32,))


# ---- factories ----------------------------------------------------------------------------------

# A static activation scale of 0 made every code inf and the layer's output NaN, silently.
_STATIC_SCALE = "; quantizing with 0, inf or NaN gives NaN codes, with a negative scale wrong ones"


def _check_static_scales(**scales) -> None:
    for name, t in scales.items():
        if t is not None:
            _checks.expect_positive(name, t, _STATIC_SCALE)


def unquantized(w13_bias=None, w2_bias=None) -> QuantConfig:
    """bf16/fp16/fp32 activations and weights, with optional biases [E, N]."""
    return QuantConfig(UNQUANTIZED, w13_bias=w13_bias, w2_bias=w2_bias)


def fp8_w8a8_per_tensor(w13_scale, w2_scale, a13_scale=None, a2_scale=None, w13_bias=None, w2_bias=None):
    """fp8 weights with one scale per expert ([E, 1, 1]); fp8 activations with one scale per tensor,
    static (a13_scale and a2_scale [1] given) or dynamic (computed per batch)."""
    if (a13_scale is None) != (a2_scale is None):
        raise ValueError("a13_scale and a2_scale: give both (static activation scales) or neither (dynamic)")
    _check_static_scales(a13_scale=a13_scale, a2_scale=a2_scale)
    scheme = QuantScheme(ActivationQuant("fp8", PER_TENSOR, static=a13_scale is not None), WeightQuant("fp8", PER_TENSOR))
    return QuantConfig(scheme, w13_scale, w2_scale, a13_scale=a13_scale, a2_scale=a2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def fp8_w8a8_per_token(w13_scale, w2_scale, w13_bias=None, w2_bias=None):
    """fp8 weights with per-channel scales [E, N, 1]; fp8 activations with dynamic per-token scales."""
    scheme = QuantScheme(ActivationQuant("fp8", PER_TOKEN), WeightQuant("fp8", PER_CHANNEL))
    return QuantConfig(scheme, w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def fp8_w8a8_block(w13_scale, w2_scale, block_size=128, w13_bias=None, w2_bias=None):
    """DeepSeek-style: fp8 weights in block_size x block_size blocks, scales [E, N/b, K/b]; fp8
    activations in dynamic 1 x block_size groups per token."""
    scheme = QuantScheme(
        ActivationQuant("fp8", GroupShape(1, block_size)), WeightQuant("fp8", GroupShape(block_size, block_size))
    )
    return QuantConfig(scheme, w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def int8_w8a8(w13_scale, w2_scale, a13_scale=None, a2_scale=None, w13_bias=None, w2_bias=None):
    """int8 weights with per-channel scales [E, N, 1]; int8 activations with dynamic per-token scales,
    or static per-tensor scales when a13_scale and a2_scale [1] are given."""
    if (a13_scale is None) != (a2_scale is None):
        raise ValueError("a13_scale and a2_scale: give both (static activation scales) or neither (dynamic)")
    static = a13_scale is not None
    _check_static_scales(a13_scale=a13_scale, a2_scale=a2_scale)
    act = ActivationQuant("int8", PER_TENSOR, static=True) if static else ActivationQuant("int8", PER_TOKEN)
    scheme = QuantScheme(act, WeightQuant("int8", PER_CHANNEL))
    return QuantConfig(scheme, w13_scale, w2_scale, a13_scale=a13_scale, a2_scale=a2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def fp8_w8a16(w13_scale, w2_scale, group: GroupShape = PER_CHANNEL, w13_bias=None, w2_bias=None):
    """fp8 weights (per-tensor, per-channel or square-block scales, by `group`); activations stay in
    the model's dtype."""
    return QuantConfig(QuantScheme(None, WeightQuant("fp8", group)), w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def int8_w8a16(w13_scale, w2_scale, group_size: int | None = None, w13_bias=None, w2_bias=None):
    """int8 weights, per-channel scales [E, N, 1] or groups of group_size along K; 16-bit activations."""
    group = PER_CHANNEL if group_size is None else GroupShape(1, group_size)
    return QuantConfig(QuantScheme(None, WeightQuant("int8", group)), w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def int4_w4a16(w13_scale, w2_scale, group_size=128, w13_zero=None, w2_zero=None, w13_bias=None, w2_bias=None):
    """int4 weights (GPTQ/AWQ-like) packed two per byte, groups of group_size along K, symmetric or
    with uint8 zero points [E, N, K/g]; 16-bit activations."""
    if (w13_zero is None) != (w2_zero is None):
        raise ValueError("w13_zero and w2_zero: give both (asymmetric int4) or neither (symmetric)")
    scheme = QuantScheme(None, WeightQuant("int4", GroupShape(1, group_size), zero_point=w13_zero is not None))
    return QuantConfig(scheme, w13_scale, w2_scale, w13_zero=w13_zero, w2_zero=w2_zero, w13_bias=w13_bias, w2_bias=w2_bias)


def nvfp4_w4a16(w13_scale, w2_scale, w13_global_scale, w2_global_scale, w13_bias=None, w2_bias=None):
    """nvfp4 weights: e2m1 packed two per byte, e4m3 scales per 16 [E, N, K/16], float32 global
    scales [E]; 16-bit activations."""
    scheme = QuantScheme(None, WeightQuant("nvfp4", GroupShape(1, 16)))
    return QuantConfig(
        scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale, w13_bias=w13_bias, w2_bias=w2_bias
    )


def nvfp4_w4a4(
    w13_scale, w2_scale, w13_global_scale, w2_global_scale, a13_global_scale, a2_global_scale,
    w13_bias=None, w2_bias=None,
):  # fmt: skip
    """nvfp4 weights as in nvfp4_w4a16, and activations quantized to nvfp4 per 16 with calibrated
    float32 global scales [1]."""
    _check_static_scales(a13_global_scale=a13_global_scale, a2_global_scale=a2_global_scale)
    group = GroupShape(1, 16)
    scheme = QuantScheme(ActivationQuant("nvfp4", group), WeightQuant("nvfp4", group))
    return QuantConfig(
        scheme, w13_scale, w2_scale, w13_global_scale, w2_global_scale,
        a13_global_scale=a13_global_scale, a2_global_scale=a2_global_scale, w13_bias=w13_bias, w2_bias=w2_bias,
    )  # fmt: skip


def mxfp4_w4a16(w13_scale, w2_scale, w13_bias=None, w2_bias=None):
    """mxfp4 weights (gpt-oss): e2m1 packed two per byte, e8m0 scales per 32 [E, N, K/32] as uint8;
    16-bit activations."""
    return QuantConfig(
        QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32))), w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias
    )


def mxfp4_w4a16_tiled(gates: str = "concat", w13_bias=None, w2_bias=None):
    """mxfp4 weights tiled for the w4a16 kernels (tiled.py): uint8 [E, N, B] holding codes and scales, GEMM1's
    gate and up rows paired as `gates` ("concat" or "interleaved") says; 16-bit activations. Build the weights
    and this config from an mxfp4_w4a16 layer's with tile_mxfp4_weights."""
    if gates not in ("concat", "interleaved"):
        raise ValueError(f"gates: got {gates!r}; allowed: 'concat', 'interleaved'")
    scheme = QuantScheme(None, WeightQuant("mxfp4", GroupShape(1, 32), tiled=gates))
    return QuantConfig(scheme, w13_bias=w13_bias, w2_bias=w2_bias)


def tile_mxfp4_weights(w13: torch.Tensor, w2: torch.Tensor, config: QuantConfig, *, interleaved: bool = False):
    """An mxfp4_w4a16 layer's weights (codes w13 [E, 2I, H/2], w2 [E, H, I/2], scales in config) -> (w13, w2,
    config) tiled for the w4a16 kernels: uint8 [E, 2I, B13] and [E, H, B2] (tiled.py), the biases kept.
    interleaved: whether the layer's gated activation reads GEMM1's rows as (gate, up) pairs (gpt-oss) rather than
    [gate; up] halves; the tiles pair gate and up rows by it, so the layer must keep that activation. Done once, at
    load time: afterwards calls read the weights as they are, where untiled ones are re-laid on every call (on
    the kernels) or decoded (the reference, from the tiles: the same values)."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config: expected a moe_ops.QuantConfig, got {type(config).__name__}")
    if config.name != "mxfp4_w4a16" or config.scheme.tiled is not None:
        raise ValueError(f"config: tiling takes an untiled mxfp4_w4a16 layer, got {config.scheme.describe()}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {interleaved!r}")
    for name, w in (("w13", w13), ("w2", w2)):
        _checks.expect_tensor(name, w)
        _checks.expect_ndim(name, w, 3, "[E, N, K/2] mxfp4 codes")
    hidden, intermediate = w2.shape[1], 2 * w2.shape[2]
    if w13.shape[1] != 2 * intermediate:
        raise ValueError(
            f"w13: tiling pairs gate and up rows of a gated activation: want [E, 2I={2 * intermediate}, H/2] for w2 "
            f"{tuple(w2.shape)}, got {tuple(w13.shape)}"
        )
    config.check_weights(w13, w2, hidden, intermediate, 2 * intermediate)
    f13, f2 = tiled.gemm_formats("interleaved" if interleaved else "concat")
    t13 = tiled.tile(w13, config.w13_scale, f13)
    t2 = tiled.tile(w2, config.w2_scale, f2)
    return t13, t2, mxfp4_w4a16_tiled("interleaved" if interleaved else "concat", config.w13_bias, config.w2_bias)


def mxfp4_w4a8(w13_scale, w2_scale, a13_scale=None, a2_scale=None, per_token=False, w13_bias=None, w2_bias=None):
    """mxfp4 weights with fp8 activations: per-tensor (static when a13_scale and a2_scale are given,
    else dynamic) or dynamic per-token."""
    if (a13_scale is None) != (a2_scale is None):
        raise ValueError("a13_scale and a2_scale: give both (static activation scales) or neither (dynamic)")
    static = a13_scale is not None
    _checks.expect_bool("per_token", per_token)
    _check_static_scales(a13_scale=a13_scale, a2_scale=a2_scale)
    if static and per_token:
        raise ValueError("per_token: static scales are per-tensor; pass per_token=False with a13_scale/a2_scale")
    act = ActivationQuant("fp8", PER_TOKEN if per_token else PER_TENSOR, static=static)
    scheme = QuantScheme(act, WeightQuant("mxfp4", GroupShape(1, 32)))
    return QuantConfig(scheme, w13_scale, w2_scale, a13_scale=a13_scale, a2_scale=a2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


# ---- reference weight quantizer -----------------------------------------------------------------


def _quantize_nvfp4_weight(w: torch.Tensor, wq: WeightQuant) -> dict:
    global_scale = formats.nvfp4_global_scale(w, dims=(1, 2))
    q, scale = formats.quantize_nvfp4(w, global_scale)
    return {"q": q, "scale": scale, "global_scale": global_scale}


# format -> float [E, N, K] -> {"q", "scale"[, "global_scale", "zero"]}
_WEIGHT_QUANTIZERS = {
    "fp8": lambda w, wq: dict(zip(("q", "scale"), formats.quantize_fp8(w, wq.group.astuple()))),
    "int8": lambda w, wq: dict(zip(("q", "scale"), formats.quantize_int8(w, wq.group.astuple()))),
    "int4": lambda w, wq: dict(zip(("q", "scale", "zero"), formats.quantize_int4(w, wq.group.cols, wq.zero_point))),
    "nvfp4": _quantize_nvfp4_weight,
    "mxfp4": lambda w, wq: dict(zip(("q", "scale"), formats.quantize_mxfp4(w))),
}


def _check_float_weight(name: str, w) -> None:
    _checks.expect_tensor(name, w)
    _checks.expect_ndim(name, w, 3, "[E, N, K] float expert weights")
    _checks.expect_dtype(name, w, _checks.SOURCE_FLOAT_DTYPES)
    # An inf or NaN weight quantizes to a NaN scale: every token routed to its expert would come out NaN.
    _checks.expect_finite(name, w)


def _check_weight_groups(name: str, w: torch.Tensor, wq: WeightQuant) -> None:
    """What check_weights (and so fused_experts) asks of K, asked before quantizing rather than after."""
    k = w.shape[-1]
    if wq.packing > 1 and k % 2:
        raise ValueError(f"{name}: {wq.dtype} packs two values per byte; K={k} must be even, got shape {tuple(w.shape)}")
    if wq.group.kind == "1xG" and k % wq.group.cols:
        raise ValueError(
            f"{name}: K={k} must be a multiple of the {wq.dtype} group size {wq.group.cols}, got shape {tuple(w.shape)}"
        )


def quantize_weight(w: torch.Tensor, wq: WeightQuant, name: str = "w") -> dict[str, torch.Tensor | None]:
    """float [E, N, K] -> {"q": storage, "scale": ..., "global_scale": ..., "zero": ...} for wq. Every
    tensor comes back contiguous (whatever w's layout: a transposed checkpoint view included) and
    without autograd history (w may be an nn.Parameter)."""
    if not isinstance(wq, WeightQuant):
        raise TypeError(f"wq: expected a WeightQuant, got {type(wq).__name__}")
    _check_float_weight(name, w)
    _check_weight_groups(name, w, wq)
    return _quantize_checked(w, wq)


@torch.no_grad()
def _quantize_checked(w: torch.Tensor, wq: WeightQuant) -> dict[str, torch.Tensor | None]:
    """quantize_weight after its checks (quantize_weights checks both weights before quantizing either)."""
    out = {"global_scale": None, "zero": None, **_WEIGHT_QUANTIZERS[wq.dtype](w, wq)}
    return {key: (t if t is None else t.contiguous()) for key, t in out.items()}


# activation dtype -> the magnitude a static per-tensor scale maps the calibration's amax to (nvfp4's
# global scale: the largest e4m3 block scale times the largest e2m1 value).
_STATIC_RANGE = {"fp8": formats.FP8_MAX, "int8": formats.INT8_MAX, "nvfp4": formats.FP8_MAX * formats.E2M1_MAX}


def _check_samples(name: str, samples, width: int, what: str) -> None:
    _checks.expect_tensor(name, samples)
    _checks.expect_dtype(name, samples, _checks.SOURCE_FLOAT_DTYPES)
    if samples.dim() < 1 or samples.shape[-1] != width or samples.numel() == 0:
        raise ValueError(f"{name}: expected {what} with T >= 1, got shape {tuple(samples.shape)}")
    _checks.expect_finite(name, samples, _checks.NAN_SCALES)


def needs_calibration(scheme: QuantScheme) -> bool:
    """Whether the scheme's activation scales are fixed ahead of time (static scales, nvfp4's global
    scales), so that quantizing its weights needs sample activations of both GEMMs."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme: expected a QuantScheme, got {type(scheme).__name__}")
    a = scheme.activation
    return a is not None and (a.static or a.dtype == "nvfp4")


@torch.no_grad()
def static_activation_scales(scheme: QuantScheme, calibration: torch.Tensor, intermediate_calibration: torch.Tensor) -> dict:
    """The static per-tensor activation scales (nvfp4: global scales) of a scheme that needs_calibration,
    as QuantConfig fields: amax over each GEMM's sample inputs over the format's range, float32 [1].
    calibration: GEMM1's inputs [..., H]; intermediate_calibration: GEMM2's inputs [..., I] (the routed
    pairs' activation outputs, e.g. from moe_ops.expert_intermediates)."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme: expected a QuantScheme, got {type(scheme).__name__}")
    if not needs_calibration(scheme):
        raise ValueError(f"scheme: {scheme.describe()} has no static activation scales")
    a = scheme.activation
    key = "global_scale" if a.dtype == "nvfp4" else "scale"
    out = {}
    for name, samples in (("calibration", calibration), ("intermediate_calibration", intermediate_calibration)):
        _checks.expect_tensor(name, samples)
        _checks.expect_dtype(name, samples, _checks.SOURCE_FLOAT_DTYPES)
        if samples.numel() == 0:
            raise ValueError(f"{name}: no samples, got shape {tuple(samples.shape)}")
        _checks.expect_finite(name, samples, _checks.NAN_SCALES)
    for which, samples in (("13", calibration), ("2", intermediate_calibration)):
        amax = samples.float().abs().amax().clamp(min=1e-6)
        out[f"a{which}_{key}"] = (amax / _STATIC_RANGE[a.dtype]).reshape(1)
    return out


def quantize_weights(
    scheme: QuantScheme,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    calibration: torch.Tensor | None = None,
    intermediate_calibration: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, QuantConfig]:
    """Quantize float expert weights w13 [E, N13, H], w2 [E, H, I] to `scheme` with the reference
    quantizers. Returns (w13_q, w2_q, config). A scheme with static activation scales or nvfp4
    activations (needs_calibration) takes its scales from sample inputs of each GEMM: `calibration`
    [T, H] (hidden states) and `intermediate_calibration` [T', I] (GEMM2's inputs: the activation
    outputs of routed pairs, which moe_ops.expert_intermediates computes; FusedMoE does this itself).
    Both are required there: GEMM2's input range depends on the weights and the routing, and a guess
    saturates the fp8/int8 codes or the nvfp4 block scales. Other schemes do not read them (so one call
    can serve every scheme)."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme: expected a QuantScheme, got {type(scheme).__name__}")
    _check_float_weight("w13", w13)
    _check_float_weight("w2", w2)
    num_experts, n13, hidden = w13.shape
    if tuple(w2.shape[:2]) != (num_experts, hidden) or n13 not in (w2.shape[2], 2 * w2.shape[2]):
        raise ValueError(
            f"w2: expected [E, H, I] = [{num_experts}, {hidden}, I] with w13 [E, 2I or I, H] = {list(w13.shape)}, "
            f"got shape {tuple(w2.shape)}"
        )
    for bname, bias, n in (("w13_bias", w13_bias, n13), ("w2_bias", w2_bias, hidden)):
        if bias is not None:
            _checks.expect_tensor(bname, bias)
            _checks.expect_shape(bname, bias, (num_experts, n), "[E, N]")
            _checks.expect_dtype(bname, bias, _checks.FLOAT_DTYPES)
    _checks.expect_same_device({"w13": w13, "w2": w2, "w13_bias": w13_bias, "w2_bias": w2_bias})
    if scheme.weight is None:
        return w13, w2, QuantConfig(scheme, w13_bias=w13_bias, w2_bias=w2_bias)
    calibrated = needs_calibration(scheme)
    if calibrated:
        intermediate = w2.shape[2]
        samples = (
            ("calibration", calibration, hidden, f"sample hidden states [T, H] with H={hidden} (w13's last dim)"),
            ("intermediate_calibration", intermediate_calibration, intermediate,
             f"GEMM2's sample inputs [T, I] with I={intermediate} (w2's last dim): the routed pairs' activation "
             "outputs, from moe_ops.expert_intermediates"),
        )  # fmt: skip
        for name, t, width, what in samples:
            if t is None:
                raise ValueError(f"{name}: scheme {scheme.describe()} has static activation scales; it needs {what}")
            _check_samples(name, t, width, what)
    _check_weight_groups("w13", w13, scheme.weight)
    _check_weight_groups("w2", w2, scheme.weight)
    q13, q2 = _quantize_checked(w13, scheme.weight), _quantize_checked(w2, scheme.weight)
    extra = {}
    if calibrated:
        scales = static_activation_scales(scheme, calibration, intermediate_calibration)
        extra = {name: t.to(w13.device) for name, t in scales.items()}
    config = QuantConfig(
        scheme,
        w13_scale=q13["scale"], w2_scale=q2["scale"],
        w13_global_scale=q13["global_scale"], w2_global_scale=q2["global_scale"],
        w13_zero=q13["zero"], w2_zero=q2["zero"],
        w13_bias=w13_bias, w2_bias=w2_bias, **extra,
    )  # fmt: skip
    return q13["q"], q2["q"], config


def dequantize_weight(w: torch.Tensor, wq: WeightQuant | None, scale=None, global_scale=None, zero=None) -> torch.Tensor:
    """Stored weight [E, N, K/packing] -> float32 [E, N, K] with its scale [E, *scale_shape(group, N, K)],
    global_scale [E] (nvfp4) and zero (int4 with zero points, the scale's shape)."""
    _checks.expect_tensor("w", w)
    if wq is None:
        return w.float()
    if not isinstance(wq, WeightQuant):
        raise TypeError(f"wq: expected a WeightQuant or None, got {type(wq).__name__}")
    _checks.expect_ndim("w", w, 3, f"[E, N, K/{wq.packing}] {wq.dtype} storage")
    _checks.expect_dtype("w", w, (wq.storage,))
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * wq.packing
    _checks.expect_tensor("scale", scale)
    _checks.expect_shape("scale", scale, (e, *formats.scale_shape(wq.group.astuple(), n, k)), f"[E, ...] for {wq.dtype} {wq.group}")
    # The dtype says how the scale reads: float32 powers of two taken as mxfp4's e8m0 exponents decode ~0.
    _checks.expect_dtype("scale", scale, wq.scale_dtypes)
    if wq.dtype == "nvfp4":
        _checks.expect_tensor("global_scale", global_scale)  # without it the values are off by the global scale
        _checks.expect_shape("global_scale", global_scale, (e,), "[E]")
        _checks.expect_dtype("global_scale", global_scale, (torch.float32,))
    elif global_scale is not None:
        raise ValueError(f"global_scale: only nvfp4 weights have one, got one for {wq.dtype}")
    if wq.zero_point:
        _checks.expect_tensor("zero", zero)
        _checks.expect_shape("zero", zero, tuple(scale.shape), "the scale's shape")
        _checks.expect_dtype("zero", zero, (torch.uint8,))
    elif zero is not None:
        raise ValueError(f"zero: {wq.dtype} {wq.group} without zero points takes none")
    return formats.dequantize(w, wq.dtype, wq.group.astuple(), scale, global_scale, zero)
