"""mxfp4 weights with bf16 activations (mxfp4_w4a16, gpt-oss's checkpoints) on the w4a16 kernels: no bf16 weights.

    GEMM1: h = act(x[gather] @ W13[e].T + b13[e])        GEMM2: out = token_sum(h @ W2[e].T + b2[e])

The kernels (cute_kernels.interface.w4a16_grouped_gemm) decode each mxfp4 word into WGMMA fragment registers, so
a weight is read as its 4.25 bits and never written back in bf16, where decoding (dequant_kernels.py) read it,
wrote it in bf16 and read that again (36 bits moved per weight against 4.25). They read the weights in their own
layout (cute_kernels/w4a16_pack.py): weights tiled at load time (quant/tiled.py, tile_mxfp4_weights) are read as
they are; for codes and scales as stored, each call re-lays the experts in use (w4_pack_kernel.py, one Triton
launch per GEMM: the 4.25 bits read, 4.25 written), as the decoding path decodes them: ~12.75 bits moved per
weight. GEMM1 reads x through the plan's gather (in the kernel at decode sizes, else by a torch copy:
interface.w4a16_gathers_in_kernel) and GEMM2's rows are summed per token by the bf16 layer's token sum kernel;
the kernels launch as programmatic dependents of the one before (PDL). Same numerics as the decoding path: exact decoded
weights, float32 sums, h rounded to bf16.
"""
from __future__ import annotations

import torch

from cute_kernels import w4a16_pack as wp

from .activation import ACTIVATIONS as _ACTIVATION_TABLE
from .expert_slots import expert_slots
from .quant import tiled

REASON = "mxfp4 weights re-laid per call for the experts in use and decoded in registers by the w4a16 kernels; "
TILED_REASON = "mxfp4 weights tiled at load time, decoded in registers by the w4a16 kernels; "
TILED_ONLY = (
    "tiled mxfp4 weights run on the w4a16 kernels only: bf16 activations, and GEMM1 with a gated activation and an "
    "unquantized output (untiled mxfp4 weights serve the other layers)"
)
# The gated activations, which the w4a16 kernel's epilogue computes (cute_kernels.moe_gemm.GATED; relu2 has no gate).
ACTIVATIONS = tuple(kind for kind, (gated, _) in _ACTIVATION_TABLE.items() if gated)


def serves(a_dtype: str, w_dtype: str, w_group, dtype: torch.dtype, activation: str | None = None, out_quant_dtype: str = "none") -> bool:
    """Whether a GEMM of these formats, outputs in dtype, runs here: mxfp4 weights (1x32 e8m0 groups), unquantized
    bf16 activations; GEMM1 (activation given) with a gated activation and an unquantized output."""
    gemm1_ok = activation is None or (activation in ACTIVATIONS and out_quant_dtype == "none")
    mxfp4 = w_dtype == "mxfp4" or tiled.is_tiled(w_dtype)
    return a_dtype == "none" and mxfp4 and tuple(w_group) == (1, wp.GROUP) and dtype == torch.bfloat16 and gemm1_ok


def _slots(expert_offsets: torch.Tensor, num_experts: int, rows: int):
    return expert_slots(expert_offsets, num_experts, min(rows, num_experts))


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the kernels read it: bf16 and float32 as they are (no launch: at M = 1 a cast costs ~4 µs of a
    ~55 µs layer), fp16 in float32 (exact)."""
    return bias if bias is None or bias.dtype in (torch.bfloat16, torch.float32) else bias.float()


def gate_up(interface, *, x, w, w_scale, w_dtype, bias, expert_offsets, gather_idx, activation, alpha, limit, gate_layout):
    """moe_ops::gate_up for a scheme `serves` accepts: [P, I] bf16 = act(x[gather] @ W13[e].T + bias[e]); x [M, H]
    bf16, w uint8 [E, 2I, H/2] with w_scale uint8 [E, 2I, H/32], or tiled (w_dtype a tiled gate_up format whose
    gates match gate_layout, w_scale None). Rows of dropped pairs (past offsets[E]) unwritten."""
    if tiled.is_tiled(w_dtype):
        packed, offsets, b = wp.tiled_words(w), expert_offsets, _bias(bias)
    else:
        from .w4_pack_kernel import pack_slots  # Triton: imported where it runs

        idx, offsets = _slots(expert_offsets, w.shape[0], gather_idx.shape[0])
        packed = pack_slots(w, w_scale, idx, offsets, kind="gate_up", gate_layout=gate_layout)
        b = None if bias is None else _bias(bias.index_select(0, idx))
    return interface.w4a16_grouped_gemm(
        x.contiguous(), packed, offsets, n=w.shape[1], activation=activation, alpha=alpha, limit=limit, bias=b,
        gate_layout=gate_layout, gather=gather_idx,
    )  # fmt: skip


def down_reduce(interface, *, a, w, w_scale, w_dtype, bias, expert_offsets, topk_weights, inverse, norm_weight, norm_eps,
                weights_early=False):  # fmt: skip
    """moe_ops::down_reduce for a scheme `serves` accepts: [M, H] bf16, the router-weighted sum over each token's
    pairs of a[row] @ W2[e].T + bias[e] (each normalized first with norm_weight); a [P, I] bf16; w as in gate_up
    (tiled: mxfp4_tiled_rows). weights_early: w and expert_offsets were written before the kernel launched just
    before this one (gate_up's GEMM1), so tiled weights start loading before the wait for it; untiled ones are
    re-laid by a kernel right before GEMM2, which must then wait."""
    early = False
    if tiled.is_tiled(w_dtype):
        packed, offsets, b, early = wp.tiled_words(w), expert_offsets, _bias(bias), weights_early
    else:
        from .w4_pack_kernel import pack_slots  # Triton: imported where it runs

        idx, offsets = _slots(expert_offsets, w.shape[0], a.shape[0])
        packed = pack_slots(w, w_scale, idx, offsets, kind="rows")
        b = None if bias is None else _bias(bias.index_select(0, idx))
    return interface.w4a16_down_reduce(
        a.contiguous(), packed, b, offsets, topk_weights, inverse, n=w.shape[1], norm_weight=norm_weight, norm_eps=norm_eps,
        early_weights=early,
    )  # fmt: skip
