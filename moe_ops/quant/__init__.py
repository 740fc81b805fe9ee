"""The quantization vocabulary: formats, schemes, configs and their factories."""
from .config import (
    QuantConfig,
    dequantize_weight,
    fp8_w8a8_block,
    fp8_w8a8_per_tensor,
    fp8_w8a8_per_token,
    fp8_w8a16,
    int4_w4a16,
    int8_w8a8,
    int8_w8a16,
    mxfp4_w4a8,
    mxfp4_w4a16,
    mxfp4_w4a16_tiled,
    needs_calibration,
    nvfp4_w4a4,
    nvfp4_w4a16,
    quantize_weight,
    quantize_weights,
    static_activation_scales,
    tile_mxfp4_weights,
    unquantized,
)
from .scheme import (
    PER_CHANNEL,
    PER_TENSOR,
    PER_TOKEN,
    SCHEMES,
    UNQUANTIZED,
    ActivationQuant,
    GroupShape,
    QuantScheme,
    WeightQuant,
)

FACTORIES = {
    "unquantized": unquantized,
    "fp8_w8a8_per_tensor": fp8_w8a8_per_tensor,
    "fp8_w8a8_per_token": fp8_w8a8_per_token,
    "fp8_w8a8_block": fp8_w8a8_block,
    "int8_w8a8": int8_w8a8,
    "fp8_w8a16": fp8_w8a16,
    "int8_w8a16": int8_w8a16,
    "int4_w4a16": int4_w4a16,
    "nvfp4_w4a16": nvfp4_w4a16,
    "nvfp4_w4a4": nvfp4_w4a4,
    "mxfp4_w4a16": mxfp4_w4a16,
    "mxfp4_w4a8": mxfp4_w4a8,
}

__all__ = [
    "FACTORIES", "PER_CHANNEL", "PER_TENSOR", "PER_TOKEN", "SCHEMES", "UNQUANTIZED", "ActivationQuant", "GroupShape",
    "QuantConfig", "QuantScheme", "WeightQuant", "dequantize_weight", "needs_calibration", "quantize_weight",
    "quantize_weights", "static_activation_scales", "tile_mxfp4_weights", *FACTORIES, "mxfp4_w4a16_tiled",
]  # fmt: skip
