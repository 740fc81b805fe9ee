"""cute_kernels.interface's host side on a CPU machine: which devices, dtypes and sizes the support
checks serve, what a direct call rejects before it compiles or launches anything (an `out` the kernels
would write past, an address they cannot read, router weights of the wrong rank), and what the
launchers hand choose_tiles, the compiled kernel and its launch (compiling and launching stubbed: the
device check passes, nothing runs)."""
from __future__ import annotations

import os

import pytest
import torch

# Before the DSL's first import: it fixes its target then.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from cute_kernels import interface, tiles  # noqa: E402
from cute_kernels.moe_gemm import MAX_EXPERTS  # noqa: E402

from .test_compile import _direct_args  # noqa: E402

GATE_UP_KW = dict(activation="silu", alpha=1.0, limit=7.0, gate_layout="concat")
SUPPORT = dict(weight_dtype=None, has_bias=False, hidden=128, intermediate=128, num_experts=8)


def _support(op: str, **changes) -> tuple[bool, str]:
    """gate_up_support (silu, [gate; up] halves) or down_reduce_support for bf16 H = I = 128, E = 8, with changes."""
    kw = {**SUPPORT, "dtype": torch.bfloat16, **changes}
    kw["weight_dtype"] = kw["weight_dtype"] or kw["dtype"]
    if op == "gate_up":
        return interface.gate_up_support(activation=kw.pop("activation", "silu"), gate_layout=kw.pop("gate_layout", "concat"), **kw)
    return interface.down_reduce_support(**kw)


def _call(op: str, args: dict, **kw):
    """The op called directly with args (and gate_up's activation keywords, kw overriding)."""
    return getattr(interface, op)(*args.values(), **{**(GATE_UP_KW if op == "gate_up" else {}), **kw})


@pytest.mark.parametrize("cap, ok", [((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False), ((12, 0), False)])
def test_device_support_is_sm_90_only(monkeypatch, cap, ok):
    """The kernels are compiled for sm_90a (wgmma, TMA): a newer GPU (Blackwell, sm_100 or sm_120) cannot
    run that code, so it is declined like an older one, with its compute capability in the reason. Every
    launch asks, so the capability is read once per device."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or cap)
    interface._capability.cache_clear()
    try:
        got = [interface.device_support(torch.device("cuda", 0)) for _ in range(3)]
    finally:
        interface._capability.cache_clear()
    assert asked == [0]
    assert got == [(True, "sm_90") if ok else (False, f"the kernels need Hopper (sm_90: wgmma, TMA); this device is sm_{cap[0]}{cap[1]}")] * 3


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_support_serves_bf16_and_fp16_only(op):
    """The kernels are built for bf16 and fp16 activations (fp16 models included); other dtypes are
    declined with theirs named."""
    for dtype in (torch.bfloat16, torch.float16):
        assert _support(op, dtype=dtype)[0], dtype
    for dtype in (torch.float32, torch.float64):
        ok, why = _support(op, dtype=dtype)
        assert not ok and why == f"activations in {dtype}; the kernels take bf16 or fp16"


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
@pytest.mark.parametrize("hidden, intermediate", [(96, 128), (128, 96), (160, 64)])
def test_support_declines_sizes_off_the_k_tile(op, hidden, intermediate):
    """H and I must both be multiples of ALIGN (64, the K tile: GEMM1's K is H, GEMM2's is I)."""
    assert _support(op)[0]  # H = I = 128
    ok, why = _support(op, hidden=hidden, intermediate=intermediate)
    assert not ok and why == f"hidden={hidden} and intermediate={intermediate} must be multiples of 64"


def test_down_reduce_support_of_a_post_expert_norm():
    """A norm's weight in the activations' dtype or float32, over rows of up to NORM_MAX_H (the kernel
    holds a token's output row in its threads' registers); another dtype or a wider row is declined,
    named."""
    from cute_kernels.norm_token_sum import MAX_H

    for norm_dtype in (torch.bfloat16, torch.float32):
        ok, why = _support("down_reduce", norm_dtype=norm_dtype, hidden=MAX_H)
        assert ok and why.endswith(" of normalized rows"), why
    ok, why = _support("down_reduce", norm_dtype=torch.float16)
    assert not ok and why == "a post-expert norm's weight in torch.float16; the kernel takes torch.bfloat16 or torch.float32"
    ok, why = _support("down_reduce", norm_dtype=torch.bfloat16, hidden=MAX_H + 64)
    assert not ok and why == f"a post-expert norm over hidden={MAX_H + 64}; the kernel holds rows of at most {MAX_H} in registers"
    assert _support("down_reduce", hidden=MAX_H + 64)[0]  # without a norm, any width


@pytest.mark.parametrize("layout", ["none", "concat"])
def test_gate_up_support_declines_an_unknown_activation(layout):
    """An activation the epilogue does not implement is declined by name, whatever the gate layout."""
    ok, why = _support("gate_up", activation="tanh", gate_layout=layout)
    assert not ok and why == f"activation 'tanh' is not one of {interface.ACTIVATIONS}"


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_direct_call_with_max_experts_passes_the_expert_check(op):
    """Exactly MAX_EXPERTS experts are served (the support checks say so, and the launchers agree): the
    call gets past the expert count to the last check, the device's (these tensors are on the CPU)."""
    args = _direct_args(op)
    w = args["w"]
    args.update(w=torch.empty(MAX_EXPERTS, *w.shape[1:], dtype=w.dtype), offsets=torch.zeros(MAX_EXPERTS + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"the kernels do not serve this call: cpu: the kernels run on CUDA GPUs"):
        _call(op, args)
    args.update(w=torch.empty(MAX_EXPERTS + 1, *w.shape[1:], dtype=w.dtype), offsets=torch.zeros(MAX_EXPERTS + 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"w: {MAX_EXPERTS + 1} experts; the kernels serve at most {MAX_EXPERTS}"):
        _call(op, args)


# op -> (a good `out`, one with a row too many), for _direct_args (M = 4, k = 2: P = 8 pairs, H = I = 128)
OUTS = {"gate_up": ((8, 128), (9, 128)), "down_reduce": ((4, 128), (5, 128))}


@pytest.mark.parametrize("op", list(OUTS))
def test_direct_call_rejects_an_out_of_another_shape(op):
    """The kernels write out as gate_up's [P, I] or down_reduce's [M, H] by raw pointer: an out with
    other rows (fewer: a write past its end; more: rows nobody writes) is rejected naming it."""
    good, bad = OUTS[op]
    with pytest.raises(ValueError, match=rf"out: shape \[{bad[0]}, {bad[1]}\]; expected \[{good[0]}, {good[1]}\]"):
        _call(op, _direct_args(op), out=torch.empty(bad, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"the kernels do not serve this call: cpu"):
        _call(op, _direct_args(op), out=torch.empty(good, dtype=torch.bfloat16))


@pytest.mark.parametrize("op", list(OUTS))
def test_direct_call_rejects_an_out_off_a_16_byte_boundary(op):
    """The kernels store out 16 bytes at a time through a pointer declared 16-byte aligned: an out that
    starts 2 bytes in (a contiguous view into a larger buffer) is rejected naming it, not launched."""
    good, _ = OUTS[op]
    out = torch.empty(good[0] * good[1] + 1, dtype=torch.bfloat16)[1:].view(good)
    with pytest.raises(ValueError, match=r"out: its address is 2 bytes past a 16-byte boundary"):
        _call(op, _direct_args(op), out=out)


def test_down_reduce_rejects_router_weights_that_are_not_m_by_k():
    """topk_weights [M, k] gives down_reduce its M and k: 1-D router weights are rejected naming them,
    not unpacked into a bare ValueError."""
    args = _direct_args("down_reduce")
    args["topk_weights"] = args["topk_weights"].flatten()
    with pytest.raises(ValueError, match=r"topk_weights: shape \[8\]; expected \[\*, \*\]"):
        _call("down_reduce", args)


def test_direct_call_rejects_a_non_tensor_naming_it():
    """Every tensor argument is checked to be one before its dtype is read: a list where bias goes gets
    a TypeError naming bias, not an AttributeError from inside the checks."""
    args = _direct_args("gate_up")
    args["bias"] = [0.0] * 256
    with pytest.raises(TypeError, match=r"bias: expected a tensor, got list"):
        _call("gate_up", args)


def test_relu2_with_an_odd_width_is_declined_for_its_width():
    """relu2 reads N = I rows per expert with no gate halves: an odd N is declined as a width off the K
    tile, not as a gated N that must be even."""
    args = _direct_args("gate_up")
    args["w"] = torch.randn(4, 63, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"the kernels do not serve this call: hidden=128 and intermediate=63 must be multiples of 64"):
        _call("gate_up", args, activation="relu2", gate_layout="none")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_no_hint_from_strided_expert_ids(dtype):
    """The kernel reads the hint's ids as one contiguous run: a strided [1, k] view (every other id of a
    wider buffer) gives no hint (count 0) rather than the buffer's ids in between."""
    x = torch.randn(1, 64)
    ids = torch.arange(8, dtype=dtype).view(1, 8)[:, ::2]
    assert not ids.is_contiguous() and ids.data_ptr() % 16 == 0
    assert interface._hint(x, torch.zeros(4, dtype=torch.int32), ids)[1] == 0
    assert interface._hint(x, torch.zeros(4, dtype=torch.int32), ids.contiguous())[1] == 4


@pytest.fixture
def launches(monkeypatch) -> dict:
    """Stubs the GPU side of the launchers (device check, SM count, compile, launch); records what
    choose_tiles, _gemm and _launch_gemm get, and whether the token sum runs."""
    got = {"tiles": [], "gemm": [], "launch": [], "token_sum": 0}
    real = interface.choose_tiles

    def choose_tiles(*args, **kwargs):
        got["tiles"].append((args, kwargs))
        return real(*args, **kwargs)

    def token_sum(dtype):
        def run(*args):
            got["token_sum"] += 1

        return run

    monkeypatch.setattr(interface, "choose_tiles", choose_tiles)
    monkeypatch.setattr(interface, "device_support", lambda device: (True, "stubbed"))
    monkeypatch.setattr(interface, "num_sms", lambda index: 132)
    monkeypatch.setattr(interface, "_gemm", lambda *args, **kwargs: got["gemm"].append((args, kwargs)))
    monkeypatch.setattr(interface, "_launch_gemm", lambda *args, **kwargs: got["launch"].append(args))
    monkeypatch.setattr(interface, "_token_sum", token_sum)
    monkeypatch.setattr(interface, "_ptr", lambda t: None)
    monkeypatch.setattr(interface, "_launch", lambda fn, device, *args: fn(*args, None))
    return got


@pytest.mark.parametrize("m, k", [(1, 8), (4, 2), (33, 3)])
def test_launchers_choose_tiles_for_their_tokens_and_top_k(launches, m, k):
    """Both GEMMs' tiles follow the layer's M tokens and k experts each (rows per expert decide
    swapped, streaming or full tiles): GEMM1 gets k as its gathered pairs per token, GEMM2 its router
    weights' [M, k]. A k of all P pairs, or M and k swapped, picks another tile (no wrong number, a
    slower kernel)."""
    e, hidden, inter = 8, 256, 128
    bf16 = torch.bfloat16
    offsets = torch.tensor([0, m * k] + [m * k] * (e - 1), dtype=torch.int32)
    gather = torch.arange(m * k, dtype=torch.int32) // k
    interface.gate_up(torch.randn(m, hidden, dtype=bf16), torch.randn(e, 2 * inter, hidden, dtype=bf16), None, offsets, gather, **GATE_UP_KW)
    interface.down_reduce(torch.randn(m * k, inter, dtype=bf16), torch.randn(e, hidden, inter, dtype=bf16), None, offsets,
                          torch.rand(m, k), torch.arange(m * k, dtype=torch.int32))  # fmt: skip
    assert launches["tiles"] == [(("concat", inter, m, k, e, 132), {"k_dim": hidden}), (("none", hidden, m, k, e, 132), {"k_dim": inter})]


@pytest.mark.parametrize("layout, act", [("concat", "silu"), ("interleaved", "swigluoai"), ("none", "relu2")])
def test_gate_up_launch_reads_its_layouts_rows(launches, layout, act):
    """GEMM1's output and launch by gate layout, for w [E, N, H]: with [gate; up] halves the kernel reads
    two parts of N / 2 rows, the up rows N / 2 rows into each expert's; interleaved pairs one part of N
    rows; relu2 (no gate) one part of N rows, its output all N wide. The weight stride between experts
    is N x H either way."""
    args = _direct_args("gate_up")
    e, _, hidden = args["w"].shape
    n = 128 if act == "relu2" else 256
    args["w"] = w = torch.randn(e, n, hidden, dtype=torch.bfloat16)
    out = _call("gate_up", args, activation=act, gate_layout=layout)
    inter = n if act == "relu2" else n // 2
    assert out.shape == (8, inter)
    ((fn, a, parts, launched_out, offsets, gather, bias, n_part, b_stride, hint, scales),) = launches["launch"]
    assert scales is None  # 16-bit operands
    assert a is args["x"] and launched_out is out and offsets is args["offsets"] and gather is args["gather"]
    if layout == "concat":
        assert parts[0] is w and parts[1].data_ptr() == w[:, inter:].data_ptr() and n_part == inter
    else:
        assert len(parts) == 2 and all(p is w for p in parts) and n_part == n
    assert b_stride == n * hidden


@pytest.mark.parametrize("early", [False, True])
def test_down_reduce_launch(launches, early):
    """GEMM2 reads [E, H, I] weights as one part of H rows, experts N x K = H x I elements apart, into a
    [P, H] scratch; then the token sum runs once. weights_early reaches the compiled kernel's variant
    (its loads before the previous kernel ends: only where the caller says so)."""
    args = _direct_args("down_reduce")
    out = _call("down_reduce", args, weights_early=early)
    assert out.shape == (4, 128)
    ((gemm_args, gemm_kw),) = launches["gemm"]
    assert gemm_kw == {"early": early}
    ((fn, a, parts, y, offsets, gather, bias, n_part, b_stride),) = launches["launch"]
    assert a is args["a"] and len(parts) == 2 and all(p is args["w"] for p in parts)
    assert y.shape == (8, 128) and n_part == 128 and b_stride == 128 * 128
    assert launches["token_sum"] == 1


@pytest.mark.parametrize("op", ["gate_up", "down_reduce"])
def test_no_launch_for_zero_tokens(launches, op):
    """M = 0 (no routed pairs): an empty output of the right width, and nothing compiled or launched."""
    args = _direct_args(op)
    if op == "gate_up":
        args.update(x=args["x"][:0], gather=args["gather"][:0])
    else:
        args.update(a=args["a"][:0], topk_weights=args["topk_weights"][:0], inverse=args["inverse"][:0])
    assert _call(op, args).shape == (0, 128)  # [P, I] and [M, H], H = I = 128
    assert launches["gemm"] == launches["launch"] == [] and launches["token_sum"] == 0


def test_choose_tiles_with_no_tile_of_two_waves_takes_the_most_tiles():
    """Full 128-row tiles (64 rows per expert) where no tile_n gives every SM two tiles: the smallest
    tile_n, for the most tiles over the SMs (8 experts x 1024 columns: 128 tiles of 64 columns on 132
    SMs, 32 of 256)."""
    assert interface.choose_tiles("none", 1024, 512, 1, 8, 132, k_dim=2048) == (128, 64)
    # With a tile_n of two waves (8 x 33 = 264 tiles of 128 columns at 4224), the largest such one.
    assert interface.choose_tiles("none", 4224, 512, 1, 8, 132, k_dim=2048) == (128, 128)


@pytest.mark.parametrize("layout", ["concat", "interleaved", "none"])
def test_fp8_tiles_are_ones_the_fp8_kernels_take(layout):
    """choose_fp8_tiles picks among fp8_tile_shapes (the fp8 variants CI compiles: no 128 x 256) at every
    benchmark shape and a sweep of token counts, and differs from choose_tiles only where FP8_TILES or
    FP8_WIDE_GEMM2 say (128 x 256 replaced; GEMM2's 64 x 64 widened past SWAP_ROWS rows per expert)."""
    from moe_ops.bench import SHAPES

    allowed = interface.fp8_tile_shapes(layout)
    assert (128, 256) not in allowed and set(allowed) < set(interface.tile_shapes(layout))
    for e, k, h, i in SHAPES.values():
        n_out, k_dim = (h, i) if layout == "none" else (i, h)
        for m in (0, 1, 3, 16, 100, 128, 1024, 4000, 8192):
            bf16 = interface.choose_tiles(layout, n_out, m, k, e, 132, k_dim=k_dim)
            fp8 = interface.choose_fp8_tiles(layout, n_out, m, k, e, 132, k_dim=k_dim)
            assert fp8 in allowed, (layout, e, m, fp8)
            if fp8 != bf16:
                wide = tiles._rows_per_expert(m * k, e)[1] > tiles.SWAP_ROWS and layout == "none"
                assert fp8 == tiles.FP8_TILES.get((layout != "none", bf16)) or (wide and fp8 == tiles.FP8_WIDE_GEMM2[bf16])


def test_fp8_tile_rule_cases():
    """The measured cases behind the fp8 table (bench/NOTES.md v49): mixtral M = 1024's gated GEMM1 takes
    64 x 256 where bf16 takes 128 x 256, its GEMM2 128 x 128; gpt-oss M = 1024's GEMM2 64 x 128 where bf16
    pads least with 64 x 64; mixtral M = 1's GEMM2 keeps 64 x 64."""
    assert interface.choose_tiles("concat", 14336, 1024, 2, 8, 132, k_dim=4096) == (128, 256)
    assert interface.choose_fp8_tiles("concat", 14336, 1024, 2, 8, 132, k_dim=4096) == (64, 256)
    assert interface.choose_fp8_tiles("none", 4096, 1024, 2, 8, 132, k_dim=14336) == (128, 128)
    assert interface.choose_tiles("none", 2880, 1024, 4, 128, 132, k_dim=2880) == (64, 64)
    assert interface.choose_fp8_tiles("none", 2880, 1024, 4, 128, 132, k_dim=2880) == (64, 128)
    assert interface.choose_fp8_tiles("none", 4096, 1, 2, 8, 132, k_dim=14336) == (64, 64)


def test_choose_tiles_at_zero_tokens():
    """choose_tiles is defined at M = 0 (one active expert assumed), whatever the layout and K."""
    for layout in ("concat", "interleaved", "none"):
        for k_dim in (2048, 4096):
            assert interface.choose_tiles(layout, 1024, 0, 8, 64, 132, k_dim=k_dim) in interface.tile_shapes(layout)


def test_sizes_past_int32_are_refused_before_launching(monkeypatch):
    """TVM-FFI passes the kernels' Int32 sizes truncated to their low 32 bits, which would launch over
    the wrong extents: a size at or past 2**31 elements is refused before the launch. (Meta tensors:
    only their shapes are read.)"""
    launched = []
    monkeypatch.setattr(interface, "_launch", lambda fn, device, *args: launched.append(args))
    meta = dict(device="meta", dtype=torch.bfloat16)
    w = torch.empty(4, 64, 64, **meta)
    offsets, gather = torch.empty(5, dtype=torch.int32, device="meta"), torch.empty(8, dtype=torch.int32, device="meta")
    hint = (gather, 0, 1)
    interface._launch_gemm(None, torch.empty(8, 64, **meta), (w, w), torch.empty(8, 64, **meta), offsets, gather, None, 64, 64 * 64, hint)
    # The pointers (a, both weight parts, out, offsets, gather, hint, bias, two scales), then the sizes.
    assert len(launched) == 1 and launched[0][10:] == (8, 64, 64, 4, 4096, 8, 64, 0, 0, 1, 0, 1, 1)
    for rows, stride in ((2**31, 64 * 64), (8, 2**31)):
        with pytest.raises(ValueError, match=r"sizes \[.*\]: the kernels take sizes and strides \(in elements\) below 2\*\*31"):
            interface._launch_gemm(None, torch.empty(rows, 64, **meta), (w, w), torch.empty(8, 64, **meta), offsets, gather, None, 64, stride, hint)
    assert len(launched) == 1


def _fp8_args(op: str) -> dict:
    """_direct_args with fp8 codes for a and w, and float32 scales (per row, per weight row)."""
    args = _direct_args(op)
    a = "x" if op == "gate_up" else "a"
    for name in (a, "w"):
        args[name] = args[name].to(torch.float8_e4m3fn)
    return args, dict(a_scale=torch.rand(args[a].shape[0], 1) + 0.1, w_scale=torch.rand(*args["w"].shape[:2], 1) + 0.1,
                      out_dtype=torch.bfloat16)  # fmt: skip


# name -> (op, scale keywords to replace or, with "w"/"x"/"a", an operand; the error)
BAD_FP8_CALLS = {
    "no_a_scale": ("gate_up", dict(a_scale=None), (ValueError, r"a_scale: required with torch.float8_e4m3fn operands")),
    "no_w_scale": ("down_reduce", dict(w_scale=None), (ValueError, r"w_scale: required")),
    "a_scale_rows": ("gate_up", dict(a_scale=torch.ones(3, 1)), (ValueError, r"a_scale: 3 values for 4 rows of a; expected 1 \(per-tensor\) or one per row")),
    "w_scale_shape": ("gate_up", dict(w_scale=torch.ones(4, 2)), (ValueError, r"w_scale: shape \[4, 2\]; expected one scale per expert")),
    "w_scale_bf16": ("down_reduce", dict(w_scale=torch.ones(4, dtype=torch.bfloat16)), (TypeError, r"w_scale: dtype torch.bfloat16")),
    "out_float32": ("gate_up", dict(out_dtype=torch.float32), (ValueError, r"out_dtype: got torch.float32; with torch.float8_e4m3fn operands")),
    "out_float16": ("down_reduce", dict(out_dtype=torch.float16), (ValueError, r"out_dtype: got torch.float16; .* write torch.bfloat16")),
    "w_bf16": ("gate_up", dict(w=True), (TypeError, r"w: dtype torch.bfloat16; with a in torch.float8_e4m3fn the kernels take w in")),
    "block_w_scale_shape": ("gate_up", dict(block_scales=True), (ValueError, r"w_scale: shape \[4, 256, 1\]; block scales of K = 128 take \[4, 2, 1\]")),
    "fp8_weights_early": ("down_reduce", dict(weights_early=True), (ValueError, r"weights_early: fp8 operands take weights_early=False")),
    "scales_on_bf16": ("down_reduce", dict(a=True), (ValueError, r"a_scale, w_scale: scales are for float8_e4m3fn operands; a is torch.bfloat16")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FP8_CALLS))
def test_fp8_calls_reject_bad_scales(case):
    """fp8 operands take float32 scales (per row or per tensor for a, per weight row or per expert for w)
    and write bf16/fp16: a missing or misshapen scale, another output dtype, or fp8 a beside 16-bit w is
    refused by name before anything compiles; the good call passes every check (and needs a GPU)."""
    op, change, (error, message) = BAD_FP8_CALLS[case]
    args, scales = _fp8_args(op)
    for name in ("w", "x", "a"):
        if change.pop(name, False):  # that operand back in bf16
            args[name] = args[name].to(torch.bfloat16)
    with pytest.raises(error, match=message):
        _call(op, args, **{**scales, **change})
    args, scales = _fp8_args(op)
    with pytest.raises(ValueError, match=r"the kernels do not serve this call: cpu"):
        _call(op, args, **scales)


def test_fp8_launch_passes_the_scales(launches):
    """An fp8 gate_up compiles the scaled variant with bf16 outputs and launches with the scales."""
    args, scales = _fp8_args("gate_up")
    out = _call("gate_up", args, **scales)
    assert out.dtype == torch.bfloat16
    ((epi, gather, dtype, *_), _), = launches["gemm"]
    assert epi.scales == "fp8" and gather and dtype == torch.bfloat16
    launched_scales = launches["launch"][0][10]
    assert launched_scales[0] is scales["a_scale"] and launched_scales[1] is scales["w_scale"]


@pytest.mark.parametrize("a_rows, w_cols", [(8, 64), (1, 1), (8, 1), (1, 64), ("block", "block")])
def test_fp8_scale_strides(monkeypatch, a_rows, w_cols):
    """The kernel reads the activation scales with a row stride of 1 (one per row) or 0 (one per tensor)
    and the weight scales as [E, 1] (one per expert) or [E, N] (one per row), one K block; block scales
    as [rows, kb] and [E, cdiv(N, 128), kb]: the last three sizes (row stride, weight rows, kb)."""
    launched = []
    monkeypatch.setattr(interface, "_launch", lambda fn, device, *args: launched.append(args))
    meta = dict(device="meta", dtype=torch.float8_e4m3fn)
    w = torch.empty(4, 64, 64, **meta)
    offsets, gather = torch.empty(5, dtype=torch.int32, device="meta"), torch.empty(8, dtype=torch.int32, device="meta")
    out = torch.empty(8, 64, device="meta", dtype=torch.bfloat16)
    if a_rows == "block":  # K = 320: 3 K blocks; N = 64: one row block
        a = torch.empty(8, 320, **meta)
        w = torch.empty(4, 64, 320, **meta)
        scales = (torch.empty(8, 3, device="meta"), torch.empty(4, 1, 3, device="meta"), True)
        want = (3, 1, 3)
    else:
        a = torch.empty(8, 64, **meta)
        scales = (torch.empty(a_rows, 1, device="meta"), torch.empty(4, w_cols, 1, device="meta"), False)
        want = (int(a_rows > 1), w_cols, 1)
    interface._launch_gemm(None, a, (w, w), out, offsets, gather, None, 64, w[0].numel(), (gather, 0, 1), scales)
    assert launched[0][-3:] == want
