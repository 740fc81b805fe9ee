"""moe_ops/dequant_kernels.py on the CPU: the decoded weights and slot offsets it hands the kernels, and
its two compositions with the kernels stood in for by moe_ops' reference ops (with the kernels' contract:
GEMM1 leaves the rows of dropped pairs unwritten), against the op chain that fused_experts runs.
The GPU tests (test_eager_kernels.py, tests/lowering/test_fused_ops_gpu.py) run the real kernels."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import moe_ops
from moe_ops import dequant_kernels, fp8_kernels, w4_kernels
from moe_ops.activation import Activation
from moe_ops.activation import activation as activation_op
from moe_ops.eager_kernels import _run_quantized
from moe_ops.expert_norm import post_expert_norm
from moe_ops.fused_experts import fused_experts
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant import formats
from moe_ops.quant.scheme import op_args
from moe_ops.reduce import weighted_reduce
from moe_ops.reference import moe_float64, relative_error, tolerance

from .test_numerics import _act_quant, _calibrated, _quant_layer


STALE = 6e4


class ReferenceKernels:
    """cute_kernels.interface's gate_up and down_reduce computed by moe_ops' reference ops, checking what
    the kernels require of their inputs; GEMM1's rows at or past offsets[E'] stay as they were, as the
    kernel leaves them: a fresh output's rows hold STALE, as torch.empty's stale memory may (a finite
    value, which a per-tensor amax would take, unlike a NaN it skips)."""

    calls: list

    def __init__(self):
        self.calls = []
        self.w4 = False  # whether the w4a16 kernels (w4_kernels.py) were called
        self.early = []  # each w4a16 GEMM's early_weights

    @staticmethod
    def _check(x, w, bias, offsets):
        assert w.dtype == x.dtype and w.is_contiguous() and x.is_contiguous(), (w.dtype, x.dtype)
        assert offsets.dtype == torch.int32 and offsets.shape == (w.shape[0] + 1,)
        assert bias is None or (bias.shape == w.shape[:2] and bias.is_contiguous())

    @staticmethod
    def _operands(a, a_scale, w, w_scale, out_dtype, block_scales):
        """grouped_gemm's (a, a_scale, a_dtype, a_group, w, w_scale, w_dtype, w_group, out_dtype) for the
        interface's operands: 16-bit, or fp8 codes with per-row/per-tensor and per-expert/per-row scales,
        or 1x128 and 128x128 block scales."""
        if a.dtype != torch.float8_e4m3fn:
            assert a_scale is None and w_scale is None and out_dtype in (None, a.dtype) and not block_scales
            return a, None, "none", [-1, -1], w, None, "none", [-1, -1], a.dtype
        if block_scales:
            assert a_scale.shape == (a.shape[0], -(-a.shape[1] // 128)) and w_scale.shape == (w.shape[0], -(-w.shape[1] // 128), a_scale.shape[1])
            return a, a_scale, "fp8", [1, 128], w, w_scale, "fp8", [128, 128], out_dtype
        assert a_scale.dtype == w_scale.dtype == torch.float32 and w_scale.numel() in (w.shape[0], w.shape[0] * w.shape[1])
        a_group = [1, -1] if a_scale.numel() > 1 else [-1, -1]
        w_group = [1, -1] if w_scale.numel() > w.shape[0] else [-1, -1]
        ws = w_scale.reshape(w.shape[0], -1, 1)
        return a, a_scale.reshape(-1, 1), "fp8", a_group, w, ws, "fp8", w_group, out_dtype

    def gate_up(self, x, w, bias, offsets, gather, *, activation, alpha, limit, gate_layout, out=None, expert_ids=None,
                a_scale=None, w_scale=None, out_dtype=None, block_scales=False):  # fmt: skip
        self._check(x, w, bias, offsets)
        self.calls.append(("gate_up", w.shape[0]))
        x, xs, x_dtype, x_group, w, ws, w_dtype, w_group, dtype = self._operands(x, a_scale, w, w_scale, out_dtype, block_scales)
        h = grouped_gemm(x, xs, None, x_dtype, x_group, w, ws, None, None, w_dtype, w_group, bias, offsets, gather, dtype)
        h = activation_op(h, activation, alpha, limit, gate_layout == "interleaved")
        out = torch.full_like(h, STALE) if out is None else out
        written = torch.arange(h.shape[0]) < offsets[-1]
        out[written] = h[written]
        return out

    def down_reduce(self, a, w, bias, offsets, topk_weights, inverse, weights_early=False, norm_weight=None, norm_eps=1e-6,
                    a_scale=None, w_scale=None, out_dtype=None, block_scales=False):  # fmt: skip
        self._check(a, w, bias, offsets)
        assert not weights_early  # the decoding right before GEMM2 writes its weights
        self.calls.append(("down_reduce", w.shape[0]))
        a, as_, a_dtype, a_group, w, ws, w_dtype, w_group, dtype = self._operands(a, a_scale, w, w_scale, out_dtype, block_scales)
        y = grouped_gemm(a, as_, None, a_dtype, a_group, w, ws, None, None, w_dtype, w_group, bias, offsets, None, dtype)
        if norm_weight is not None:
            y = post_expert_norm(y, norm_weight, norm_eps)
        return weighted_reduce(y, topk_weights, inverse, offsets)


    @staticmethod
    def _w4_weights(packed, n, k, kind):
        """The float32 weights [S, n, K] the w4a16 kernel multiplies, read back from its packed tiles: for
        "gate_up" as [gate; up] rows in the tiles' column order (the kernel pairs tile rows c and 64 + c)."""
        from cute_kernels import w4a16_pack as wp

        if packed.dim() == 3:  # tiled at load time: [E, S, WORDS], the expert's own chunks first
            chunks = wp.tiles_of(kind, n) * -(-k // wp.KT)
            packed = packed[:, :chunks].reshape(packed.shape[0], wp.tiles_of(kind, n), -1, wp.WORDS)
        codes, scales = wp.unpack_mxfp4_experts(packed, kind=kind, gate_layout=None if kind == "rows" else "concat", n=n, k=k)
        return formats.dequantize(codes, "mxfp4", (1, 32), scales)

    def w4a16_grouped_gemm(self, a, packed, offsets, *, n, activation=None, alpha=1.702, limit=7.0, bias=None,
                           gate_layout=None, out=None, out_dtype=torch.float32, gather=None, early_weights=False):  # fmt: skip
        assert a.dtype == torch.bfloat16 and a.is_contiguous() and offsets.shape == (packed.shape[0] + 1,)
        assert (gather is not None) == (activation is not None), "GEMM1 gathers its rows in the kernel; GEMM2 does not"
        assert isinstance(early_weights, bool) and not (early_weights and gather is not None)
        self.early.append(early_weights)
        if gather is not None:
            assert gather.dtype == torch.int32 and gather.dim() == 1
            a = a[gather.long()]
        self.calls.append(("gate_up" if activation else "down_reduce", packed.shape[0]))
        self.w4 = True
        kind = "rows" if activation is None else "gate_up"
        w = self._w4_weights(packed, n, a.shape[1], kind)
        b = bias
        if bias is not None and activation is not None and gate_layout == "interleaved":  # to the weights' [gate | up]
            b = bias.reshape(bias.shape[0], -1, 2).transpose(1, 2).reshape(bias.shape[0], -1)
        h = grouped_gemm(a.float(), None, None, "none", [-1, -1], w, None, None, None, "none", [-1, -1], b, offsets, None, torch.float32)
        if activation is not None:
            h = activation_op(h, activation, alpha, limit, False)
        h = h.to(torch.bfloat16 if activation is not None else out_dtype)
        out = torch.full_like(h, STALE) if out is None else out
        written = torch.arange(h.shape[0]) < offsets[-1]
        out[written] = h[written]
        return out

    def w4a16_down_reduce(self, a, packed, bias, offsets, topk_weights, inverse, *, n, out=None, norm_weight=None, norm_eps=1e-6,
                          early_weights=False):  # fmt: skip
        y = self.w4a16_grouped_gemm(a, packed, offsets, n=n, bias=bias, out_dtype=torch.bfloat16, early_weights=early_weights)
        if norm_weight is not None:
            y = post_expert_norm(y, norm_weight, norm_eps)
        return weighted_reduce(y, topk_weights, inverse, offsets)


def _int8_weights(num_experts=6, n=24, k=32):
    # From the test's fresh seed (tests/conftest.py): new codes and scales on every run.
    q = torch.randint(-127, 128, (num_experts, n, k), dtype=torch.int8)
    scale = torch.rand(num_experts, n, 1) + 0.5
    return q, scale


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_rows_than_experts_decode_the_used_experts_into_slots(dtype):
    """rows < E: min(rows, E) slots, the used experts' decoded weights and biases first, in expert order,
    with their rows' offsets; the spare slots and the rows of dropped pairs (past offsets[E]) hold no rows."""
    q, scale = _int8_weights()
    bias = torch.randn(6, 24)
    offsets = _offsets([0, 2, 0, 1, 0, 0])  # 3 routed rows; rows 3 and 4 dropped
    w, b, slot_offsets = dequant_kernels.dequantized_experts(q, "int8", [1, -1], scale, None, None, bias, offsets, 5, dtype)
    full = formats.dequantize(q, "int8", (1, -1), scale)
    assert w.shape == (5, 24, 32) and w.dtype == dtype and w.is_contiguous()
    assert torch.equal(w[:2], full[[1, 3]].to(dtype)) and torch.equal(b[:2], bias[[1, 3]])
    assert slot_offsets.dtype == torch.int32 and slot_offsets.tolist() == [0, 2, 3, 3, 3, 3]


def test_as_many_rows_as_experts_take_E_slots():
    q, scale = _int8_weights()
    offsets = _offsets([3, 0, 1, 2, 0, 0])
    w, b, slot_offsets = dequant_kernels.dequantized_experts(q, "int8", [1, -1], scale, None, None, None, offsets, 6, torch.bfloat16)
    assert w.shape[0] == 6 and b is None
    assert torch.equal(w[:3], formats.dequantize(q, "int8", (1, -1), scale)[[0, 2, 3]].to(torch.bfloat16))
    assert slot_offsets.tolist() == [0, 3, 4, 6, 6, 6, 6]


def test_decoding_in_chunks_matches_one_piece(monkeypatch):
    """The float32 temporaries are bounded by decoding a chunk of experts (or rows) at a time."""
    q, scale = _int8_weights()
    whole = dequant_kernels.dequantized_experts(q, "int8", [1, -1], scale, None, None, None, _offsets([1] * 6), 6, torch.float32)[0]
    monkeypatch.setattr(dequant_kernels, "_CHUNK_BYTES", 24 * 32 * 4 * 2)  # two experts per chunk
    chunked = dequant_kernels.dequantized_experts(q, "int8", [1, -1], scale, None, None, None, _offsets([1] * 6), 6, torch.float32)[0]
    assert torch.equal(whole, chunked)


def test_why_not_bounds_the_decoded_weight():
    assert dequant_kernels.why_not("w13", 128, 5760, 2880, torch.bfloat16) is None  # gpt-oss-120b: 4.0 GiB
    why = dequant_kernels.why_not("w13", 256, 4096, 7168, torch.bfloat16)  # DeepSeek-V3 unsharded
    assert why.startswith("w13 decoded to torch.bfloat16 would take 14.0 GiB (E=256, N=4096, K=7168)"), why


# scheme, M, dtype, with an expert map (a rank holding 4 of 5 experts: some pairs dropped)
CASES = [
    ("fp8_w8a8_block", 1, torch.float32, False),
    ("fp8_w8a8_block", 96, torch.bfloat16, False),
    ("fp8_w8a8_per_tensor_dynamic", 2, torch.float32, True),
    ("fp8_w8a8_per_tensor_dynamic", 64, torch.float32, True),
    ("mxfp4_w4a16", 1, torch.bfloat16, False),
    ("mxfp4_w4a16", 40, torch.float32, True),
    ("int4_w4a16_zero_point", 33, torch.float32, False),
    ("nvfp4_w4a4", 2, torch.float32, False),
    ("nvfp4_w4a4", 50, torch.float32, True),
    ("int8_w8a8_static", 20, torch.float32, False),
]


@pytest.mark.parametrize("case, m, dtype, mapped", CASES, ids=[f"{c}-M{m}-{str(d)[6:]}{'-map' if e else ''}" for c, m, d, e in CASES])
def test_compositions_match_the_op_chain(case, m, dtype, mapped):
    """gate_up then down_reduce of the dequantizing path, with the reference standing in for the kernels,
    give fused_experts' op chain: the slots' decoded weights, offsets and biases, the quantization of x and of the intermediate. With an expert map, the rows of dropped pairs
    (left unwritten by the kernel) must not reach a per-tensor scale."""
    scheme, x, q13, q2, config, d13, _, tw, ids, biases = _quant_layer(case, dtype, m=m)
    config = _calibrated(scheme, config, x, d13, ids, q13.shape[0], biases)
    expert_map = torch.tensor([0, 1, -1, 2, 3]) if mapped else None
    if mapped:  # the rank's 4 local experts: drop expert 2's weights
        keep = torch.tensor([0, 1, 3, 4])
        q13, q2 = q13[keep].contiguous(), q2[keep].contiguous()
        config = _local(config, keep)
    want = fused_experts(x, q13, q2, tw, ids, quant_config=config, expert_map=expert_map)
    offsets, gather_idx, inverse = routing_plan(ids, q13.shape[0], expert_map)
    kernels = ReferenceKernels()
    got = _run_quantized(
        kernels, x, q13, q2, tw, Activation(), config.w13_bias, config.w2_bias, None, config, offsets, gather_idx, inverse, None
    )
    # The fp8 kernels multiply every local expert's codes; the decoding and w4a16 paths hand them their slots.
    fp8 = fp8_kernels.serves(*op_args(scheme.activation), *op_args(scheme.weight), dtype)
    experts = q13.shape[0] if fp8 else min(ids.numel(), q13.shape[0])
    assert kernels.calls == [("gate_up", experts), ("down_reduce", experts)]
    assert kernels.w4 == w4_kernels.serves(*op_args(scheme.activation)[:1], *op_args(scheme.weight), dtype, "silu")
    # codes as stored are re-laid by a kernel right before each w4a16 GEMM, which GEMM2 must wait for
    assert kernels.early == ([False, False] if kernels.w4 else [])
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    assert got.dtype == dtype
    err = relative_error(got, want)
    assert err <= tolerance(dtype, a_dtype, fake_quant=True), (case, err)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("m", [1, 12])
def test_tiled_mxfp4_composition_matches_the_op_chain(interleaved, m, rng):
    """Weights tiled at load time reach the w4a16 kernels as they are (all E experts, no slots, no re-laying), with
    the layer's bf16 biases in their own gate layout, and give the op chain's result on the same tiles."""
    from moe_ops.quant import GroupShape, WeightQuant, mxfp4_w4a16, quantize_weight, tile_mxfp4_weights

    e, h, i = 5, 64, 96
    mxfp4 = WeightQuant("mxfp4", GroupShape(1, 32))
    q13 = quantize_weight(torch.randn(e, 2 * i, h, generator=rng), mxfp4)
    q2 = quantize_weight(torch.randn(e, h, i, generator=rng), mxfp4)
    b13, b2 = torch.randn(e, 2 * i, generator=rng).bfloat16(), torch.randn(e, h, generator=rng).bfloat16()
    config = mxfp4_w4a16(q13["scale"], q2["scale"], w13_bias=b13, w2_bias=b2)
    t13, t2, tiled = tile_mxfp4_weights(q13["q"], q2["q"], config, interleaved=interleaved)
    act = Activation("swigluoai", interleaved=True) if interleaved else Activation()
    x = torch.randn(m, h, generator=rng).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=rng)[:2] for _ in range(m)]).int()
    tw = torch.rand(m, 2, generator=rng)
    want = fused_experts(x, t13, t2, tw, ids, activation=act, quant_config=tiled)
    offsets, gather_idx, inverse = routing_plan(ids, e, None)
    kernels = ReferenceKernels()
    got = _run_quantized(kernels, x, t13, t2, tw, act, b13, b2, None, tiled, offsets, gather_idx, inverse, None)
    assert kernels.w4 and kernels.calls == [("gate_up", e), ("down_reduce", e)]
    # GEMM2 starts its tiled weights before waiting for GEMM1, which writes neither them nor the plan's offsets
    assert kernels.early == [False, True]
    assert relative_error(got, want) <= tolerance(torch.bfloat16, None, fake_quant=True)


def _local(config, keep):
    """config with its per-expert tensors ([E, ...] weight scales, zero points, global scales, biases) kept
    for the local experts only."""
    changes = {}
    for name, t in config.tensors().items():
        if t is not None and name.startswith("w") and t.dim() and t.shape[0] == 5:
            changes[name] = t[keep].contiguous()
    return dataclasses.replace(config, **changes)


# ---- on a Hopper GPU ------------------------------------------------------------------------------


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe DSL kernels need a Hopper (sm_90) GPU")
    pytest.importorskip("cute_kernels.interface")


def _cuda_layer(case, m, num_experts=5):
    """A bf16 layer of `case` on the GPU (k = 2: fewer than num_experts rows take fewer slots than experts),
    with the float64 reference's output for the weights the kernels multiply:
    decoded, then rounded to bf16."""
    scheme, x, q13, q2, config, d13, d2, tw, ids, biases = _quant_layer(case, torch.bfloat16, m=m, num_experts=num_experts)
    config = _calibrated(scheme, config, x, d13, ids, q13.shape[0], biases)
    d13, d2 = (d.to(torch.bfloat16).to(d.dtype) for d in (d13, d2))
    ref = moe_float64(x, d13, d2, tw, ids, act_quant=_act_quant(scheme, config), intermediate_dtype=torch.bfloat16, **biases)
    cuda = dataclasses.replace(config, **{k: v.cuda() for k, v in config.tensors().items() if v is not None})
    a_dtype = None if scheme.activation is None else scheme.activation.dtype
    return (x.cuda(), q13.cuda(), q2.cuda(), tw.cuda(), ids.cuda(), cuda), ref, tolerance(torch.bfloat16, a_dtype, fake_quant=True, decoded=True)


GPU_CASES = [
    "fp8_w8a8_block", "fp8_w8a8_per_tensor_dynamic", "fp8_w8a8_per_tensor_static", "fp8_w8a8_per_token", "fp8_w8a16_per_channel", "int8_w8a8_dynamic",
    "int4_w4a16_zero_point", "nvfp4_w4a4", "mxfp4_w4a16", "mxfp4_w4a8_per_tensor_static",
]  # fmt: skip


# (M, E): 32 rows for 64 experts take 32 slots, the others E. Not M = 1 here: with
# GEMM2's input two rows of a per-tensor fp8 scheme, each code the bf16 roundings flip weighs so much
# that the error reached 0.032 (the CPU numerics tests size their layers for the same reason). M = 1
# runs in the graph test below, and against the op chain in test_compositions_match_the_op_chain.
GPU_SIZES = [(16, 64), (37, 5), (300, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, num_experts", GPU_SIZES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_quantized_call_runs_the_kernels_on_decoded_weights(case, m, num_experts):
    """An eager quantized call on sm_90: no fallback warning, the kernels' launches (no grouped_mm or bmm
    of the reference), the float64 result with activation quantization re-applied, and bit for bit the
    output of the same call compiled with the lowering (require_kernels: the same path there)."""
    _hopper()
    import lowering
    from moe_ops.bench import kernel_launches

    (x, q13, q2, tw, ids, config), ref, tol = _cuda_layer(case, m, num_experts)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
        with moe_ops.value_checks(False):
            names = kernel_launches(lambda: fused_experts(x, q13, q2, tw, ids, quant_config=config))
    assert not [w for w in caught if "runs the reference" in str(w.message)], "a fallback warned"
    # mxfp4_w4a16 in bf16 multiplies the codes on the w4a16 kernels (w4_kernels.py), the others decoded weights
    gemm = "W4a16Grouped" if case == "mxfp4_w4a16" else "MoeGemm"
    assert sum(gemm in n for n in names) == 2, names
    assert not any("grouped_mm" in n or "bmm" in n.lower() or "Cijk" in n for n in names), names
    err = relative_error(out.cpu(), ref)
    assert err <= tol, (case, m, err)
    torch._dynamo.reset()
    with torch.no_grad(), lowering.enabled(require_kernels=True):
        compiled = torch.compile(fused_experts, fullgraph=True)(x, q13, q2, tw, ids, quant_config=config)
    assert torch.equal(out, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("fp8_w8a8_block", "fp8_w8a8_per_tensor_static", "fp8_w8a8_per_tensor_dynamic"))
@pytest.mark.parametrize("m", (1, 16))
def test_quantized_call_captures_in_a_cuda_graph(m, case):
    """The quantized paths captured in a CUDA graph (no host sync anywhere: capture would fail), decoding
    (block scales) and on fp8 codes (per-tensor scales): each replay reads the routing copied into the
    captured tensors and equals an eager call with it."""
    _hopper()
    (x, q13, q2, tw, ids, config), _, _ = _cuda_layer(case, m)
    routings = [(torch.rand_like(tw), torch.stack([torch.randperm(5)[:2] for _ in range(m)]).to(ids)) for _ in range(2)]
    with torch.no_grad():
        fused_experts(x, q13, q2, tw, ids, quant_config=config)  # compile the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with moe_ops.value_checks(False), torch.cuda.graph(graph):
            out = fused_experts(x, q13, q2, tw, ids, quant_config=config)
        for new_weights, new_ids in routings:
            tw.copy_(new_weights)
            ids.copy_(new_ids)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_experts(x, q13, q2, new_weights, new_ids, quant_config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("m", (2, 64))
def test_quantized_call_with_dropped_pairs(m):
    """An expert map (expert 2 on another rank) with a per-tensor dynamic scale for GEMM2's input: the
    rows of dropped pairs, which GEMM1 leaves unwritten, must not reach the scale."""
    _hopper()
    scheme, x, q13, q2, config, d13, _, tw, ids, biases = _quant_layer("fp8_w8a8_per_tensor_dynamic", torch.bfloat16, m=m)
    keep = torch.tensor([0, 1, 3, 4])
    local = _local(config, keep)
    want = fused_experts(x, q13[keep].contiguous(), q2[keep].contiguous(), tw, ids, quant_config=local,
                         expert_map=torch.tensor([0, 1, -1, 2, 3]))  # the CPU's op chain  # fmt: skip
    cuda = dataclasses.replace(local, **{k: v.cuda() for k, v in local.tensors().items() if v is not None})
    # Stale values where the intermediate will be allocated: what a reused block of the cache holds.
    torch.full((1 << 20,), 6e4, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = fused_experts(x.cuda(), q13[keep].contiguous().cuda(), q2[keep].contiguous().cuda(), tw.cuda(), ids.cuda(),
                            quant_config=cuda, expert_map=torch.tensor([0, 1, -1, 2, 3], device="cuda"))  # fmt: skip
    a_dtype = scheme.activation.dtype
    assert relative_error(got.cpu().float(), want.float()) <= tolerance(torch.bfloat16, a_dtype, fake_quant=True, decoded=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", (16, 37))
def test_slots_without_rows_are_never_read(m):
    """Slots without rows are not decoded (uninitialised memory): with the allocator's cache full of NaN,
    the output is what it is with a clean cache. 64 experts: M = 16 leaves spare slots of 32, M = 37
    experts without rows among 64 slots."""
    _hopper()
    (x, q13, q2, tw, ids, config), _, _ = _cuda_layer("mxfp4_w4a16", m, num_experts=64)
    with torch.no_grad():
        want = fused_experts(x, q13, q2, tw, ids, quant_config=config)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the first call's blocks go, so the next allocations split the NaN block
        torch.full((1 << 28,), float("nan"), device="cuda", dtype=torch.bfloat16)  # 512 MiB of NaN, freed to the cache
        got = fused_experts(x, q13, q2, tw, ids, quant_config=config)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "a_dtype, group, static", [("fp8", [1, 128], False), ("fp8", [1, -1], False), ("fp8", [-1, -1], True), ("int8", [1, -1], False), ("nvfp4", [1, 16], True)]
)  # fmt: skip
def test_activations_decode_on_the_gpu_as_torch_does(a_dtype, group, static):
    """The quantized activations the kernels read, decoded by the Triton kernel on CUDA: bit for bit
    dequantize_activation(...).to(bf16), as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moe_ops.quant.quantize import dequantize_activation, quantize

    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16) * torch.exp(torch.randn(37, 1, device="cuda"))
    scale = x.abs().amax().float().reshape(1) / 448 if static and a_dtype == "fp8" else None
    global_scale = torch.tensor([0.5], device="cuda") if a_dtype == "nvfp4" else None
    q, s = quantize(x, a_dtype, group, scale, global_scale)
    got = dequant_kernels._activations(q, a_dtype, group, s, global_scale, torch.bfloat16)
    want = dequantize_activation(q, a_dtype, group, s, global_scale).to(torch.bfloat16)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("case", ["fp8_w8a8_per_token", "fp8_w8a8_per_tensor_dynamic"])
def test_fp8_gate_up_with_an_unquantized_intermediate(case):
    """A chain that quantizes GEMM1's input but not GEMM2's (the lowering fuses it as written): the fp8
    path's gate_up returns the intermediate as the op does, with an empty scale, where it used to hand
    "none" to the quantizer, which raised. The reference stands in for the kernels."""
    from lowering.fused_ops import gate_up as gate_up_op

    scheme, x, q13, _, config, _, _, _, ids, _ = _quant_layer(case, torch.bfloat16, m=7)
    a_dtype, a_group = op_args(scheme.activation)
    w_dtype, w_group = op_args(scheme.weight)
    assert fp8_kernels.serves(a_dtype, a_group, w_dtype, w_group, x.dtype)
    offsets, gather_idx, _ = routing_plan(ids, q13.shape[0], None)
    args = dict(
        x=x, a_scale=None, a_global_scale=None, a_dtype=a_dtype, a_group=list(a_group), w=q13, w_scale=config.w13_scale,
        w_global_scale=None, w_zero=None, w_dtype=w_dtype, w_group=list(w_group), bias=None, expert_offsets=offsets,
        gather_idx=gather_idx, activation="silu", alpha=1.702, limit=7.0, interleaved=False, out_quant_dtype="none",
        out_quant_group=[-1, -1], out_scale=None, out_global_scale=None, out_dtype=torch.bfloat16,
    )  # fmt: skip
    want_h, want_s = gate_up_op(*args.values())
    got_h, got_s = dequant_kernels.gate_up(ReferenceKernels(), gate_layout="concat", **args)
    assert got_h.shape == want_h.shape and got_h.dtype == want_h.dtype == torch.bfloat16
    assert got_s.shape == want_s.shape == (0,) and got_s.dtype == want_s.dtype == torch.float32
    assert relative_error(got_h, want_h) <= tolerance(torch.bfloat16)
