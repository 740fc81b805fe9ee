"""The interface of cute_kernels: support checks (with the reason when a request cannot be served)
and launchers that take torch tensors, pick their tiles (tiles.py), compile on first use and launch on
the tensors' GPU, on torch's current stream there.

gate_up(x [M, H], w [E, N, H], bias [E, N] | None, offsets [E+1], gather [P], expert_ids [M, k] | None) -> [P, I]
    GEMM1 over the grouped rows, tokens gathered in the kernel, activation (and bias) in the epilogue.
    N = 2I for gated activations ([gate; up] "concat" or "interleaved"), I for relu2. expert_ids (the
    routing plan's input, when the ids are local): a hint the kernel reads at M = 1 to start its
    weights early (moe_gemm.py); the output does not depend on it.
down_reduce(a [P, I], w [E, H, I], bias [E, H] | None, offsets, topk_weights [M, k], inverse [P],
            norm_weight [H] | None, norm_eps) -> [M, H]
    GEMM2 over the grouped rows into a [P, H] scratch in grouped-row order; then the deterministic
    per-token sum of the router-weighted rows (token_sum.py), or with norm_weight, of the rows each
    normalized first (norm_token_sum.py).
Both take fp8 operands too: a (x) and w in float8_e4m3fn with float32 a_scale (per row or per tensor)
and w_scale (per weight row or per expert), applied to the accumulators; out_dtype bf16 (_fp8_scales).
Each 128-element k-tile's fp8 products are added to fp32 accumulators (MoeGemmSm90's promotion), so
the error does not grow with K as the tensor cores' own fp8 accumulation's does.

w4a16_grouped_gemm(a [P, K] bf16, packed, offsets, n, activation, bias, gather) -> [P, n] float32 or [P, n / 2] bf16
    The grouped GEMM with mxfp4 experts packed by w4a16_pack.pack_mxfp4_experts (w4a16_grouped.py): a's
    rows grouped by expert, or with an activation (gate_up tiles, in the epilogue) a [M, K] tokens read
    through gather [P] (in the kernel at decode sizes, else copied by index_select: w4a16_gathers_in_kernel).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import compile as cc  # noqa: F401  (sets the target architecture first)
import cutlass  # noqa: E402
from cutlass import Int32  # noqa: E402

from .moe_gemm import GATED, HINT_MAX_PAIRS, MAX_EXPERTS, SCALE_BLOCK, Epilogue, MoeGemmSm90  # noqa: E402
from .norm_token_sum import MAX_H as NORM_MAX_H, NormTokenSumSm90  # noqa: E402
from .token_sum import TokenSumSm90  # noqa: E402
from . import w4a16_pack as w4_pack  # noqa: E402
from .tiles import (  # noqa: E402
    cdiv, choose_fp8_tiles, choose_tiles, choose_w4a16_tok, fp8_tile_shapes, tile_shapes, w4a16_gathers_in_kernel,
)
from .w4a16_grouped import TOKS as W4A16_TOKS, W4a16GroupedSm90, W4Epilogue  # noqa: E402

ACTIVATIONS = (*GATED, "relu2")
FP8 = torch.float8_e4m3fn
_CUTLASS_DTYPE = {
    FP8: cutlass.Float8E4M3FN,
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
}
ALIGN = 64  # H and I must be multiples of this (the K tile; keeps every chunk and TMA box aligned)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index`: the persistent kernels' grid size."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_support(device: torch.device) -> tuple[bool, str]:
    """(whether the kernels run on `device`, why not or its architecture): they need sm_90."""
    if device.type != "cuda":
        return False, f"{device.type}: the kernels run on CUDA GPUs"
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        return False, f"the kernels need Hopper (sm_90: wgmma, TMA); this device is sm_{cap[0]}{cap[1]}"
    return True, "sm_90"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    # get_device_capability reads the device's properties on every call: a few µs per launch.
    return torch.cuda.get_device_capability(index)


COLUMN_MAJOR = "column-major (transposed) expert weights; the kernels read row-major [E, N, K] weights"


def _common(dtype, weight_dtype, hidden, intermediate, num_experts, weight_row_major, quantized) -> str | None:
    """The reason shared by both GEMMs why the kernels cannot serve, or None."""
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} local experts; the kernels keep the expert offsets in shared memory, for at most {MAX_EXPERTS}"
    if quantized:
        return "quantized schemes are not implemented in the CuTe DSL kernels yet (bf16/fp16 only)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"activations in {dtype}; the kernels take bf16 or fp16"
    if weight_dtype not in (dtype, FP8):
        return f"weights in {weight_dtype} with activations in {dtype}; the kernels take weights in the activations' dtype or {FP8} (scaled)"
    if not weight_row_major:
        return COLUMN_MAJOR
    if hidden % ALIGN or intermediate % ALIGN:
        return f"hidden={hidden} and intermediate={intermediate} must be multiples of {ALIGN}"
    return None


@functools.lru_cache(maxsize=None)
def gate_up_support(*, dtype, weight_dtype, activation, gate_layout, has_bias, hidden, intermediate, num_experts,
                    weight_row_major=True, quantized=False) -> tuple[bool, str]:  # fmt: skip
    """(whether gate_up's kernel serves a layer of this recipe, why not or what runs it); no tensor values."""
    why = _common(dtype, weight_dtype, hidden, intermediate, num_experts, weight_row_major, quantized)
    if why is None and activation not in ACTIVATIONS:
        why = f"activation {activation!r} is not one of {ACTIVATIONS}"
    if why is None and (activation in GATED) != (gate_layout in ("concat", "interleaved")):
        why = f"activation {activation!r} with gate layout {gate_layout!r}"
    return (why is None), (why or "CuTe DSL grouped GEMM: gathered rows, TMA weights, WGMMA, fused activation")


@functools.lru_cache(maxsize=None)
def down_reduce_support(*, dtype, weight_dtype, has_bias, hidden, intermediate, num_experts,
                        weight_row_major=True, quantized=False, norm_dtype=None) -> tuple[bool, str]:  # fmt: skip
    """(whether down_reduce's kernels serve a layer of this recipe, why not or what runs them); no tensor values.
    norm_dtype: the dtype of a post-expert norm's weight (None: no norm)."""
    why = _common(dtype, weight_dtype, hidden, intermediate, num_experts, weight_row_major, quantized)
    if why is None and norm_dtype is not None and norm_dtype not in (dtype, torch.float32):
        why = f"a post-expert norm's weight in {norm_dtype}; the kernel takes {dtype} or torch.float32"
    if why is None and norm_dtype is not None and hidden > NORM_MAX_H:
        why = f"a post-expert norm over hidden={hidden}; the kernel holds rows of at most {NORM_MAX_H} in registers"
    if why is not None:
        return False, why
    return True, "CuTe DSL grouped GEMM + deterministic weighted reduction" + (" of normalized rows" if norm_dtype else "")


ALIGN_BYTES = 16  # _ptr declares every pointer this aligned: the kernels' TMA boxes and vector accesses need it


def misaligned(**tensors) -> str | None:
    """Why the kernels cannot take these tensors (the first whose address is off a 16-byte boundary,
    named by its keyword), or None. Contiguous views can start anywhere: a row slice of [M, 2] router
    weights, a flat buffer's tail."""
    for name, t in tensors.items():
        if t is not None and t.data_ptr() % ALIGN_BYTES:
            # No address in the text: the lowering warns once per reason, and addresses change per call.
            return f"{name}: its address is {t.data_ptr() % ALIGN_BYTES} bytes past a {ALIGN_BYTES}-byte boundary; the kernels need {ALIGN_BYTES}-byte aligned tensors"
    return None


def _check_aligned(**tensors) -> None:
    # Before any launch: a misaligned TMA or vector access faults, and the fault ends the CUDA context.
    why = misaligned(**tensors)
    if why is not None:
        raise ValueError(why)


_INDEX = (torch.int32,)
_BIAS = (torch.bfloat16, torch.float16, torch.float32)


def _check_tensors(**specs) -> None:
    """specs: name=(tensor or None, expected shape with None for any size, allowed dtypes). TypeError or
    ValueError naming the first tensor the kernels cannot read as given (dtype, shape, contiguity,
    device), before any compile or launch: the kernels take raw pointers and would misread it."""
    device = None
    for name, (t, shape, dtypes) in specs.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: dtype {t.dtype}; the kernels take {', '.join(map(str, dtypes))}")
        if not _shape_matches(t.shape, shape):
            want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
            raise ValueError(f"{name}: shape {list(t.shape)}; expected {want}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: strides {t.stride()} are not contiguous; the kernels take contiguous tensors")
        if device is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, the other tensors on {device}")
        device = t.device


def _shape_matches(got: torch.Size, want: tuple) -> bool:
    # A plain loop: any() over a generator costs about 1 µs per tensor, paid on every launch.
    if len(got) != len(want):
        return False
    for w, g in zip(want, got):
        if w is not None and w != g:
            return False
    return True


def _check_support(ok_why: tuple[bool, str]) -> None:
    ok, why = ok_why
    if not ok:
        raise ValueError(f"the kernels do not serve this call: {why}")


def _ptr(t: torch.Tensor) -> int:
    # The kernels are compiled with TVM-FFI calling (compile.py): a pointer argument is its address as
    # an int. Its element type and alignment (ALIGN_BYTES) were fixed at compile time.
    return t.data_ptr()


def _stream(device: torch.device) -> int:
    # torch's current stream: CUDA-graph capture and torch.compile's cudagraphs record it; a kernel
    # launched on another stream silently escapes the graph. The raw handle, as Inductor's generated
    # code reads it: torch.cuda.current_stream builds a Stream object (3 µs on the GPU host).
    return torch._C._cuda_getCurrentRawStream(device.index)


def _launch(fn, device: torch.device, *args) -> None:
    """fn(*args, stream) on `device`'s current stream, with `device` current: a launch into a stream
    of another GPU than the current one fails (a model spread over GPUs in one process calls each
    layer with whichever GPU current). A switch costs 2-4 µs of host time, so only when needed."""
    if device.index == torch.cuda.current_device():
        fn(*args, _stream(device))
        return
    with torch.cuda.device(device):
        fn(*args, _stream(device))


def gemm_compile_args(dtype, bias_dtype, fp8: bool = False) -> tuple:
    """Placeholder arguments with MoeGemmSm90.__call__'s types, to compile it without tensors: outputs in
    dtype, operands in dtype too or, with fp8, in float8_e4m3fn."""
    od, bd, i32, f32 = _CUTLASS_DTYPE[dtype], _CUTLASS_DTYPE[bias_dtype], cutlass.Int32, cutlass.Float32
    ad = _CUTLASS_DTYPE[FP8] if fp8 else od
    ptrs = (*[cc.fake_ptr(ad)] * 3, cc.fake_ptr(od), *[cc.fake_ptr(i32)] * 3, cc.fake_ptr(bd), *[cc.fake_ptr(f32)] * 2)
    return (*ptrs, *[Int32(64)] * 13, cc.fake_stream())


def token_sum_compile_args(dtype) -> tuple:
    """Placeholder arguments with TokenSumSm90.__call__'s types."""
    d, i32 = _CUTLASS_DTYPE[dtype], cutlass.Int32
    ptrs = (cc.fake_ptr(d), cc.fake_ptr(i32), cc.fake_ptr(cutlass.Float32), cc.fake_ptr(i32), cc.fake_ptr(d))
    return (*ptrs, *[Int32(8)] * 4, cc.fake_stream())


def _gemm(epilogue: Epilogue, gather: bool, dtype, bias_dtype, sms: int, tile_m: int = 128, tile_n: int = 256, early: bool = False):
    """The compiled GEMM with outputs in dtype (and operands too, or in fp8 with epilogue.scales "fp8" or
    "fp8_block")."""
    key = _gemm_key(epilogue, gather, dtype, bias_dtype, sms, tile_m, tile_n, early)

    def build():
        kernel = MoeGemmSm90(epilogue, tile_n=tile_n, tile_m=tile_m, gather=gather, num_sms=sms, early_weights=early)
        return kernel, gemm_compile_args(dtype, bias_dtype, fp8=epilogue.scales != "none")

    return cc.get(key, build)


@functools.lru_cache(maxsize=None)
def _gemm_key(epilogue: Epilogue, gather: bool, a_dtype, bias_dtype, sms: int, tile_m: int, tile_n: int, early: bool) -> str:
    # Formatting the epilogue's repr costs more than the launch itself; the variants are few.
    return f"moe_gemm:{epilogue}:gather={gather}:{a_dtype}:{bias_dtype}:tile={tile_m}x{tile_n}:sms={sms}" + (":early" if early else "")


def _token_sum(dtype):
    return cc.get(f"token_sum:{dtype}", lambda: (TokenSumSm90(), token_sum_compile_args(dtype)))


def norm_token_sum_compile_args(dtype, norm_dtype) -> tuple:
    """Placeholder arguments with NormTokenSumSm90.__call__'s types."""
    d, i32 = _CUTLASS_DTYPE[dtype], cutlass.Int32
    ptrs = (cc.fake_ptr(d), cc.fake_ptr(i32), cc.fake_ptr(cutlass.Float32), cc.fake_ptr(i32), cc.fake_ptr(_CUTLASS_DTYPE[norm_dtype]), cc.fake_ptr(d))
    return (*ptrs, *[Int32(8)] * 4, cutlass.Float32(1e-6), cc.fake_stream())


def _norm_token_sum(dtype, norm_dtype):
    return cc.get(
        f"norm_token_sum:{dtype}:{norm_dtype}",
        lambda: (NormTokenSumSm90(weight_float32=norm_dtype == torch.float32), norm_token_sum_compile_args(dtype, norm_dtype)),
    )


def _check_experts(w: torch.Tensor) -> None:
    if w.shape[0] > MAX_EXPERTS:
        raise ValueError(f"w: {w.shape[0]} experts; the kernels serve at most {MAX_EXPERTS} (gate_up_support and down_reduce_support decline more)")


def _hint(x: torch.Tensor, gather: torch.Tensor, expert_ids: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """(ids as int32, count, stride) for GEMM1's weight hint (moe_gemm.py): the token's expert ids at
    M = 1, else none (count 0, gather as a placeholder pointer). int64 ids are read as their low words."""
    if expert_ids is None:
        return gather, 0, 1
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_ids: dtype {expert_ids.dtype}; expected torch.int32 or torch.int64 (the routing plan's topk_ids)")
    if expert_ids.numel() != gather.shape[0]:
        raise ValueError(f"expert_ids: {expert_ids.numel()} ids for {gather.shape[0]} routed pairs; expected the plan's topk_ids [M, k]")
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids: on {expert_ids.device}, the other tensors on {x.device}")
    if x.shape[0] != 1 or expert_ids.numel() > HINT_MAX_PAIRS or not expert_ids.is_contiguous() or expert_ids.data_ptr() % ALIGN_BYTES:
        return gather, 0, 1
    return expert_ids.view(torch.int32), expert_ids.numel(), expert_ids.element_size() // 4


def _launch_gemm(fn, a, w_parts, out, offsets, gather, bias, n_part, b_stride, hint=None, scales=None):
    """scales: Fp8Scales (or a tuple of its fields) of fp8 operands, or None. The kernel reads a_scale
    as [rows, kb] with a row stride of kb (block scales, kb = cdiv(K, 128)), 1 (per row) or 0 (per
    tensor), w_scale as [E, 1, 1] (per expert), [E, N, 1] (per row) or [E, cdiv(N, 128), kb]."""
    num_experts = offsets.shape[0] - 1
    hint_ids, hint_pairs, hint_stride = hint if hint is not None else _hint(a, gather, None)
    # Without scales the kernel reads none: any aligned pointer stands in.
    a_scale, w_scale, block = scales if scales is not None else (w_parts[0], w_parts[0], False)
    if scales is None:
        a_stride, w_cols, kb = 0, 1, 1
    elif block:
        kb = a_scale.shape[1]
        a_stride, w_cols = kb, w_scale.shape[1]
    else:
        a_stride, w_cols, kb = int(a_scale.numel() > 1), w_scale.numel() // num_experts, 1
    sizes = _int32(
        a.shape[0], a.shape[1], n_part, num_experts, b_stride, out.shape[0], out.shape[1],
        bias.shape[1] if bias is not None else 0, hint_pairs, hint_stride, a_stride, w_cols, kb,
    )  # fmt: skip
    _launch(
        fn, a.device,
        _ptr(a), _ptr(w_parts[0]), _ptr(w_parts[1]), _ptr(out), _ptr(offsets), _ptr(gather), _ptr(hint_ids),
        _ptr(bias if bias is not None else w_parts[0]), _ptr(a_scale), _ptr(w_scale), *sizes,
    )  # fmt: skip


def _int32(*sizes: int) -> tuple[int, ...]:
    """The kernels' Int32 size arguments, checked: TVM-FFI truncates a larger int to its low 32 bits,
    which would launch over the wrong extents. (Addresses are computed in 64 bits in the kernels.)"""
    if max(sizes) >= 2**31:
        raise ValueError(f"sizes {list(sizes)}: the kernels take sizes and strides (in elements) below 2**31")
    return sizes


class Fp8Scales(NamedTuple):
    """The float32 scales of a call's fp8 operands, as _fp8_scales checked them."""

    a_scale: torch.Tensor
    w_scale: torch.Tensor
    block: bool  # 1x128 / 128x128 block scales, applied per k-tile

    @property
    def kind(self) -> str:
        """Epilogue.scales of the kernel that takes them."""
        return "fp8_block" if self.block else "fp8"

    def tensors(self) -> dict:
        return dict(a_scale=self.a_scale, w_scale=self.w_scale)


def _fp8_scales(a, w, a_scale, w_scale, out_dtype, block_scales=False) -> tuple[torch.dtype, Fp8Scales | None]:
    """(the output dtype, Fp8Scales or None) of a call: with e4m3 operands (a and
    w both float8_e4m3fn) the kernels scale the products by a_scale (float32, one per row of a or one
    per-tensor value) and w_scale (float32, one per expert: [E], [E, 1] or [E, 1, 1]; or one per weight
    row: [E, N] or [E, N, 1]) and write out_dtype (bf16). block_scales: a_scale [rows, kb] per 1x128 group
    of a row, w_scale [E, cdiv(N, 128), kb] per 128x128 block, kb = cdiv(K, 128), applied per k-tile.
    With 16-bit operands out_dtype is a's dtype and there are no scales."""
    fp8 = a.dtype == FP8
    if not fp8:
        if a_scale is not None or w_scale is not None:
            raise ValueError(f"a_scale, w_scale: scales are for float8_e4m3fn operands; a is {a.dtype}")
        if out_dtype not in (None, a.dtype):
            raise ValueError(f"out_dtype: {out_dtype} with operands in {a.dtype}; 16-bit operands give outputs in their own dtype")
        return a.dtype, None
    if w.dtype != FP8:
        raise TypeError(f"w: dtype {w.dtype}; with a in {FP8} the kernels take w in {FP8}")
    if out_dtype != torch.bfloat16:
        # The fp8 variants that variants(..., scales="fp8") lists, which CI compiles and checks.
        raise ValueError(f"out_dtype: got {out_dtype}; with {FP8} operands the kernels write torch.bfloat16")
    for name, t in (("a_scale", a_scale), ("w_scale", w_scale)):
        if t is None:
            raise ValueError(f"{name}: required with {FP8} operands (float32 scales)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    e, n = w.shape[0], w.shape[1]
    if block_scales:
        kb, nb = cdiv(a.shape[1], SCALE_BLOCK), cdiv(n, SCALE_BLOCK)
        for name, t, want in (("a_scale", a_scale, (a.shape[0], kb)), ("w_scale", w_scale, (e, nb, kb))):
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: shape {list(t.shape)}; block scales of K = {a.shape[1]} take {list(want)} (1x128 and 128x128 groups)")
        return out_dtype, Fp8Scales(a_scale, w_scale, True)
    if a_scale.numel() not in (1, a.shape[0]):
        raise ValueError(f"a_scale: {a_scale.numel()} values for {a.shape[0]} rows of a; expected 1 (per-tensor) or one per row")
    if tuple(w_scale.shape) not in ((e,), (e, 1), (e, 1, 1), (e, n), (e, n, 1)):
        raise ValueError(
            f"w_scale: shape {list(w_scale.shape)}; expected one scale per expert ([{e}], [{e}, 1] or [{e}, 1, 1]) "
            f"or one per weight row ([{e}, {n}] or [{e}, {n}, 1])"
        )
    return out_dtype, Fp8Scales(a_scale, w_scale, False)


def gate_up(
    x, w, bias, offsets, gather, *, activation: str, alpha: float, limit: float, gate_layout: str, out=None, tiles=None,
    expert_ids=None, a_scale=None, w_scale=None, out_dtype=None, block_scales=False,
):  # fmt: skip
    """[P, I] = act(x[gather] @ w[e].T + bias[e]) per expert; see the module docstring. Rows of
    dropped pairs (at or past offsets[E]) are left unwritten. out: an optional [P, I] destination.
    tiles: (tile_m, tile_n) instead of choose_tiles' (for tile sweeps). expert_ids: the routing plan's
    topk_ids [M, k] when they are local expert ids (no expert_map), read at M = 1 as a hint only.
    fp8: x and w in float8_e4m3fn, x @ w[e].T scaled by a_scale (per token or per tensor) and w_scale[e]
    before the bias and the activation, or with block_scales per 1x128 and 128x128 block, the result in
    out_dtype (_fp8_scales)."""
    _check_experts(w)
    num_experts, n, hidden = w.shape
    if activation in GATED and n % 2:
        raise ValueError(f"w: {activation!r} reads each expert's N rows as gate and up halves; N must be even, got shape {list(w.shape)}")
    inter = n // 2 if activation in GATED else n
    dtype, scales = _fp8_scales(x, w, a_scale, w_scale, out_dtype, block_scales)
    _check_support(gate_up_support(
        dtype=dtype, weight_dtype=w.dtype, activation=activation, gate_layout=gate_layout, has_bias=bias is not None,
        hidden=hidden, intermediate=inter, num_experts=num_experts, weight_row_major=w.stride(2) == 1,
    ))  # fmt: skip
    _check_tensors(
        x=(x, (None, hidden), (x.dtype,)), w=(w, (num_experts, n, hidden), (x.dtype,)), bias=(bias, (num_experts, n), _BIAS),
        offsets=(offsets, (num_experts + 1,), _INDEX), gather=(gather, (None,), _INDEX),
        out=(out, (gather.shape[0], inter), (dtype,)), **_scale_specs(scales),
    )  # fmt: skip
    _check_aligned(x=x, w=w, bias=bias, offsets=offsets, gather=gather, out=out, **(scales.tensors() if scales else {}))
    hint = _hint(x, gather, expert_ids)
    _check_support(device_support(x.device))  # last: the checks above hold on any device
    if out is None:
        out = torch.empty(gather.shape[0], inter, dtype=dtype, device=x.device)
    if out.shape[0] == 0:
        return out
    kind = scales.kind if scales else "none"
    epi = Epilogue(activation, gate_layout, float(alpha), float(limit), has_bias=bias is not None, scales=kind)
    sms = num_sms(x.device.index)
    rule = choose_fp8_tiles if scales else choose_tiles
    tiles = tiles or rule(gate_layout, inter, x.shape[0], gather.shape[0] // max(x.shape[0], 1), num_experts, sms, k_dim=hidden)
    fn = _gemm(epi, True, dtype, bias.dtype if bias is not None else dtype, sms, *tiles)
    if gate_layout == "concat":
        # The up rows of each expert start I rows after its gate rows; the kernel reads both as parts.
        parts, n_part = (w, w[:, inter:]), inter
    else:
        parts, n_part = (w, w), n
    _launch_gemm(fn, x, parts, out, offsets, gather, bias, n_part, n * hidden, hint, scales)
    return out


def _scale_specs(scales: Fp8Scales | None) -> dict:
    # Checked flat: their shapes were checked by _fp8_scales; here dtype, contiguity and device.
    return {name: (t, t.shape, (torch.float32,)) for name, t in (scales.tensors() if scales else {}).items()}


def down_reduce(a, w, bias, offsets, topk_weights, inverse, out=None, tiles=None, weights_early=False, norm_weight=None,
                norm_eps=1e-6, a_scale=None, w_scale=None, out_dtype=None, block_scales=False):  # fmt: skip
    """[M, H] = sum_j topk_weights[m, j] * (a[inverse[m*k+j]] @ w[e].T + bias[e]); see the module
    docstring. Every element of the output is written. out: an optional [M, H] destination.
    norm_weight [H] (y's dtype or float32): each row is normalized first (norm_token_sum.py), with norm_eps.
    tiles: (tile_m, tile_n) instead of choose_tiles' (for tile sweeps).
    weights_early: the GEMM reads `offsets` and starts loading `w` before waiting for the kernel
    launched just before it on the stream (MoeGemmSm90.early_weights). Only when that kernel writes
    neither and started after both were written, as gate_up over the same plan does.
    fp8: a and w in float8_e4m3fn, each row's product scaled by a_scale (per row of a or per tensor) and
    w_scale[e] before the bias, or with block_scales per 1x128 and 128x128 block; the output (and y, the
    GEMM's rows) in out_dtype (_fp8_scales)."""
    _check_experts(w)
    num_experts, hidden, inter = w.shape
    _check_tensors(topk_weights=(topk_weights, (None, None), (torch.float32,)))
    m, k = topk_weights.shape
    dtype, scales = _fp8_scales(a, w, a_scale, w_scale, out_dtype, block_scales)
    if scales is not None and weights_early:
        # Not among variants(..., scales="fp8"): the fp8 path's GEMM2 follows the intermediate's quantizer.
        raise ValueError("weights_early: fp8 operands take weights_early=False")
    _check_support(down_reduce_support(
        dtype=dtype, weight_dtype=w.dtype, has_bias=bias is not None, hidden=hidden, intermediate=inter,
        num_experts=num_experts, weight_row_major=w.stride(2) == 1,
        norm_dtype=getattr(norm_weight, "dtype", None),  # not a tensor: _check_tensors says so
    ))  # fmt: skip
    _check_tensors(
        a=(a, (m * k, inter), (a.dtype,)), w=(w, (num_experts, hidden, inter), (a.dtype,)),
        bias=(bias, (num_experts, hidden), _BIAS), offsets=(offsets, (num_experts + 1,), _INDEX),
        topk_weights=(topk_weights, (m, k), (torch.float32,)),
        inverse=(inverse, (m * k,), _INDEX), out=(out, (m, hidden), (dtype,)),
        norm_weight=(norm_weight, (hidden,), (dtype, torch.float32)), **_scale_specs(scales),
    )  # fmt: skip
    if norm_weight is not None and not norm_eps > 0:
        raise ValueError(f"norm_eps: got {norm_eps}; allowed: > 0")
    _check_aligned(
        a=a, w=w, bias=bias, offsets=offsets, topk_weights=topk_weights, inverse=inverse, out=out, norm_weight=norm_weight,
        **(scales.tensors() if scales else {}),
    )  # fmt: skip
    _check_support(device_support(a.device))  # last: the checks above hold on any device
    if out is None:
        out = torch.empty(m, hidden, dtype=dtype, device=a.device)
    if m == 0:
        return out
    y = torch.empty(a.shape[0], hidden, dtype=dtype, device=a.device)
    kind = scales.kind if scales else "none"
    epi = Epilogue("none", "none", has_bias=bias is not None, scales=kind)
    sms = num_sms(a.device.index)
    rule = choose_fp8_tiles if scales else choose_tiles
    tiles = tiles or rule("none", hidden, m, k, num_experts, sms, k_dim=inter)
    fn = _gemm(epi, False, dtype, bias.dtype if bias is not None else dtype, sms, *tiles, early=bool(weights_early))
    # GEMM2 gathers nothing: inverse stands in for the gather pointer, which this variant never reads.
    _launch_gemm(fn, a, (w, w), y, offsets, inverse, bias, hidden, hidden * inter, scales=scales)
    return _launch_token_sum(y, inverse, topk_weights, offsets, out, norm_weight, norm_eps)


def _launch_token_sum(y, inverse, topk_weights, offsets, out, norm_weight, norm_eps):
    """out [M, H] = the router-weighted sum of each token's k rows of y [P, H] (each row normalized first
    with norm_weight); the arguments checked by the caller."""
    (m, k), hidden, num_experts = topk_weights.shape, y.shape[1], offsets.shape[0] - 1
    if norm_weight is not None:
        _launch(
            _norm_token_sum(y.dtype, norm_weight.dtype), y.device,
            _ptr(y), _ptr(inverse), _ptr(topk_weights), _ptr(offsets), _ptr(norm_weight), _ptr(out),
            *_int32(m, k, hidden, num_experts), float(norm_eps),
        )  # fmt: skip
        return out
    _launch(
        _token_sum(y.dtype), y.device,
        _ptr(y), _ptr(inverse), _ptr(topk_weights), _ptr(offsets), _ptr(out), *_int32(m, k, hidden, num_experts),
    )  # fmt: skip
    return out


def variants(dtype=torch.bfloat16, bias_dtypes=(None,), scales: str = "none"):
    """Every (epilogue, gather, bias dtype, tile_m, tile_n, early weights) the fused ops can request
    (see choose_tiles) for outputs in `dtype`, with operands in dtype (scales "none") or in fp8 (scales
    "fp8" or "fp8_block": the quantized path's GEMMs, whose GEMM2 never loads weights early, in the
    tiles of fp8_tile_shapes)."""
    out = []
    earlies = (True, False) if scales == "none" else (False,)
    shapes = tile_shapes if scales == "none" else fp8_tile_shapes
    for bias in bias_dtypes:
        gemm2 = Epilogue("none", "none", has_bias=bias is not None, scales=scales)
        for act in ACTIVATIONS:
            for layout in (("concat", "interleaved") if act in GATED else ("none",)):
                epi = Epilogue(act, layout, has_bias=bias is not None, scales=scales)
                out += [(epi, True, bias or dtype, *tiles, False) for tiles in shapes(layout)]
        out += [(gemm2, False, bias or dtype, *tiles, early) for tiles in shapes("none") for early in earlies]
    return out


def precompile(dtype=torch.bfloat16, sms: int | None = None, bias_dtypes=(None,)) -> dict[str, tuple[str, float]]:
    """Compile (or load from the disk cache) every kernel variant for activations in `dtype`, for a
    GPU with `sms` multiprocessors (default: the current device's). Works without a GPU when sms is
    given. Returns {key: (compile or disk, seconds)}."""
    sms = sms if sms is not None else num_sms(torch.cuda.current_device())
    for epi, gather, bias_dtype, tile_m, tile_n, early in variants(dtype, bias_dtypes):
        _gemm(epi, gather, dtype, bias_dtype, sms, tile_m, tile_n, early)
    _token_sum(dtype)
    for norm_dtype in (dtype, torch.float32):
        _norm_token_sum(dtype, norm_dtype)
    return dict(cc.timings)


# w4a16 (w4a16_grouped.py): mxfp4 weights packed by w4a16_pack.py, bf16 activations.


def w4a16_variants() -> list[W4Epilogue]:
    """Every W4Epilogue a caller can request: float32 or bf16 sums (GEMM2, or GEMM1 without an activation) and
    each gated activation at its default parameters, each without a bias and with a float32 or a bf16 one."""
    biases = ((False, False), (True, False), (True, True))  # (has_bias, bias_bf16)
    rows = [W4Epilogue(None, has_bias=b, bias_bf16=b16, rows_bf16=bf16) for b, b16 in biases for bf16 in (False, True)]
    return rows + [W4Epilogue(act, has_bias=b, bias_bf16=b16) for act in GATED for b, b16 in biases]


def w4a16_compile_args(epilogue: W4Epilogue) -> tuple:
    """Placeholder arguments with W4a16GroupedSm90.__call__'s types."""
    out = cutlass.BFloat16 if epilogue.activation is not None or epilogue.rows_bf16 else cutlass.Float32
    bias = cutlass.BFloat16 if epilogue.bias_bf16 else cutlass.Float32
    # the packed words as bytes: the kernel's TMA box is counted in bytes (w4a16_grouped.ROW_W)
    ptrs = (cc.fake_ptr(cutlass.Uint8), cc.fake_ptr(cutlass.BFloat16), cc.fake_ptr(cutlass.Int32), cc.fake_ptr(out), cc.fake_ptr(bias),
            cc.fake_ptr(cutlass.Int32))  # fmt: skip
    return (*ptrs, *[Int32(128)] * 9, cc.fake_stream())


def _w4a16(epilogue: W4Epilogue, tok: int, gather: bool = False, early: bool = False):
    return cc.get(
        f"w4a16_grouped:{epilogue}:tok{tok}" + (":gather" if gather else "") + (":early" if early else ""),
        lambda: (W4a16GroupedSm90(epilogue, tok, gather, early), w4a16_compile_args(epilogue)),
    )


# A gated bias [E, 2 n_out] as the kernel reads it: (gate-to-up stride, column stride) by the gate layout.
_W4_GATE_STRIDES = {"concat": lambda n_out: (n_out, 1), "interleaved": lambda n_out: (1, 2)}


def w4a16_grouped_gemm(a, packed, offsets, *, n: int, activation: str | None = None, alpha: float = 1.702,
                       limit: float = 7.0, bias=None, gate_layout: str | None = None, out=None,
                       out_dtype=torch.float32, tok: int | None = None, gather=None,
                       gather_in_kernel: bool | None = None, early_weights: bool = False) -> torch.Tensor:  # fmt: skip
    """The grouped GEMM of bf16 rows with mxfp4 experts (w4a16_grouped.py).

    a [P, K] bf16: each expert's rows contiguous, expert e's at offsets[e]:offsets[e + 1] (int32 [E + 1]);
    or, with gather (int32 [P], an activation only: GEMM1), the tokens a [M, K], grouped row r being
    a[gather[r]] (gather_in_kernel: read so by the kernel, or else copied by torch first; None:
    w4a16_gathers_in_kernel's rule);
    packed: pack_mxfp4_experts(codes [E, n, K/2], scales, kind="rows" when activation is None, else "gate_up"),
    int32 [E, tiles, k_tiles, WORDS], or weights tiled at load time as int32 [E, S, WORDS] (S >= tiles * k_tiles
    chunks per expert, the first tiles * k_tiles of them read: w4a16_pack.tiled_chunks).
    activation None: returns [P, n] = a @ W[e].T (+ bias [E, n]) in out_dtype (float32 or bf16);
    a GATED activation: returns bf16 [P, n / 2] = act(gate, up) of the sums (+ bias [E, n], its gate and up
    halves as gate_layout says: "concat" or "interleaved"). Biases float32 or bf16, read as they are and added in
    float32. Rows past offsets[E] are not written. out: the result's tensor, or None for a new one. tok: the
    m-tile's rows (16, 32, 64 or 128; None: choose_w4a16_tok). early_weights: the kernel reads `offsets` and starts
    loading `packed` before waiting for the kernel launched just before it on the stream; only when that kernel
    writes neither and started after both were written (GEMM2 right after GEMM1 over the same plan, weights tiled
    at load time). Not with gather."""
    if activation is None and out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: got {out_dtype}; allowed without an activation: torch.float32, torch.bfloat16")
    if tok is not None and tok not in W4A16_TOKS:
        raise ValueError(f"tok={tok!r}; allowed: None, {', '.join(map(str, W4A16_TOKS))}")
    kind = "rows" if activation is None else "gate_up"
    if kind == "gate_up" and bias is not None and gate_layout not in _W4_GATE_STRIDES:
        raise ValueError(f"gate_layout={gate_layout!r} with a bias and an activation; allowed: {', '.join(map(repr, _W4_GATE_STRIDES))}")
    rows_bf16 = activation is None and out_dtype == torch.bfloat16
    bias_bf16 = isinstance(bias, torch.Tensor) and bias.dtype == torch.bfloat16
    epi = W4Epilogue(activation, alpha, limit, bias is not None, rows_bf16, bias_bf16)  # ValueError for an unknown activation
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a: expected a tensor, got {type(a).__name__}")
    if a.dim() != 2:
        raise ValueError(f"a: shape {list(a.shape)}; expected [P, K]" + (" or, with gather, [M, K]" if kind == "gate_up" else ""))
    if gather is not None and kind != "gate_up":
        raise ValueError("gather: given without an activation; only GEMM1 (a gated activation) gathers its rows")
    if not isinstance(early_weights, bool) or (early_weights and gather is not None):
        raise (TypeError if not isinstance(early_weights, bool) else ValueError)(
            f"early_weights={early_weights!r}; allowed: a bool, and False with a gather (GEMM1 reads the plan's offsets first)"
        )
    if gather_in_kernel is not None and (not isinstance(gather_in_kernel, bool) or gather is None):
        raise (TypeError if gather is not None else ValueError)(
            f"gather_in_kernel={gather_in_kernel!r}; allowed: None, or a bool with a gather"
        )
    _check_tensors(gather=(gather, (None,), _INDEX))
    p, k = a.shape if gather is None else (gather.shape[0], a.shape[1])
    if k < w4_pack.GROUP or k % w4_pack.GROUP:
        raise ValueError(f"a: K = {k}; the mxfp4 weights want a positive multiple of {w4_pack.GROUP}")
    if not isinstance(n, int) or n <= 0 or (kind == "gate_up" and n % 2):
        raise ValueError(f"n = {n!r}; expected the weights' row count, a positive int (even with an activation)")
    num_experts = offsets.shape[0] - 1 if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 else None
    if num_experts is not None and num_experts > MAX_EXPERTS:
        raise ValueError(f"offsets: {num_experts} experts; the kernel keeps the offsets in shared memory, for at most {MAX_EXPERTS}")
    n_out = w4_pack.output_columns(kind, n)
    tiles = cdiv(n, w4_pack.TILE_ROWS) if kind == "rows" else cdiv(n_out, w4_pack.TILE_ROWS // 2)
    bias_shape = (num_experts, n)
    out_dtype = out_dtype if kind == "rows" else torch.bfloat16
    k_tiles = cdiv(k, w4_pack.KT)
    if isinstance(packed, torch.Tensor) and packed.dim() == 3:  # tiled at load time: whole experts of S chunks
        s_chunks = packed.shape[1]
        if s_chunks < tiles * k_tiles:
            raise ValueError(f"packed: {s_chunks} chunks per expert; n = {n}, K = {k} need {tiles * k_tiles}")
        packed_shape = (num_experts, s_chunks, w4_pack.WORDS)
    else:
        packed_shape = (num_experts, tiles, k_tiles, w4_pack.WORDS)
    _check_tensors(
        a=(a, (p if gather is None else None, k), (torch.bfloat16,)),
        packed=(packed, packed_shape, (torch.int32,)),
        offsets=(offsets, (None,), _INDEX),
        bias=(bias, bias_shape, (torch.float32, torch.bfloat16)),
        out=(out, (p, n_out), (out_dtype,)),
        gather=(gather, (p,), _INDEX),
    )  # fmt: skip
    _check_support(device_support(a.device))
    _check_aligned(a=a, packed=packed, offsets=offsets, bias=bias, out=out, gather=gather)
    _int32(p * k, a.numel(), p * n_out, packed.numel())
    out = torch.empty((p, n_out), dtype=out_dtype, device=a.device) if out is None else out
    if p == 0:
        return out
    tok = choose_w4a16_tok(p, num_experts) if tok is None else tok
    if gather is not None:
        if gather_in_kernel is None:
            gather_in_kernel = w4a16_gathers_in_kernel(p, num_experts)
        if not gather_in_kernel:
            a, gather = a.index_select(0, gather), None
    fn = _w4a16(epi, tok, gather is not None, early_weights)
    _launch(
        fn, a.device, _ptr(packed), _ptr(a), _ptr(offsets), _ptr(out), _ptr(bias if bias is not None else offsets),
        _ptr(gather if gather is not None else offsets),
        *_int32(num_experts, n_out, k, p, a.shape[0], num_sms(a.device.index), math.prod(packed.shape[1:-1])),
        *_int32(*(_W4_GATE_STRIDES[gate_layout](n_out) if kind == "gate_up" and bias is not None else (0, 0))),
    )  # fmt: skip
    return out


def w4a16_down_reduce(a, packed, bias, offsets, topk_weights, inverse, *, n: int, out=None, norm_weight=None,
                      norm_eps: float = 1e-6, early_weights: bool = False) -> torch.Tensor:  # fmt: skip
    """GEMM2 with mxfp4 experts, then the token sum: [M, n] bf16 = sum_j topk_weights[m, j] *
    (a[inverse[m*k+j]] @ W[e].T + bias[e]), each row normalized first with norm_weight [n] (bf16 or float32).
    a [P, I] bf16 grouped by offsets; packed: kind "rows"; bias [E, n] float32 or bf16. y, the GEMM's rows, in bf16 as the
    bf16 layer's (down_reduce). Every element of the output is written. early_weights: as w4a16_grouped_gemm's."""
    _check_tensors(topk_weights=(topk_weights, (None, None), (torch.float32,)))
    m, k = topk_weights.shape
    _check_tensors(
        a=(a, (m * k, None), (torch.bfloat16,)), inverse=(inverse, (m * k,), _INDEX),
        out=(out, (m, n), (torch.bfloat16,)), norm_weight=(norm_weight, (n,), (torch.bfloat16, torch.float32)),
    )  # fmt: skip
    if norm_weight is not None and not norm_eps > 0:
        raise ValueError(f"norm_eps: got {norm_eps}; allowed: > 0")
    _check_aligned(topk_weights=topk_weights, inverse=inverse, out=out, norm_weight=norm_weight)
    y = w4a16_grouped_gemm(a, packed, offsets, n=n, bias=bias, out_dtype=torch.bfloat16, early_weights=early_weights)  # checks the rest
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device) if out is None else out
    if m == 0:
        return out
    return _launch_token_sum(y, inverse, topk_weights, offsets, out, norm_weight, norm_eps)
