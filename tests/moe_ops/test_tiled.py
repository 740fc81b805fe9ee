"""mxfp4 weights tiled at load time (moe_ops/quant/tiled.py, cute_kernels/w4a16_pack.tile_mxfp4_experts).

Tiling must change nothing but the layout: the same values back (untile), the same grouped GEMM as float64 on the
decoded weights, the same layer output as the untiled layer bit for bit (reference on CPU, the w4a16 kernels on
the GPU, eager, compiled and in a CUDA graph), and clear errors where a tiled weight meets a call it was not tiled
for.
"""
from __future__ import annotations

import pytest
import torch

import lowering
import moe_ops
from cute_kernels import w4a16_pack as wp
from moe_ops.gemm import grouped_gemm
from moe_ops.plan import routing_plan
from moe_ops.quant import GroupShape, QuantScheme, WeightQuant, mxfp4_w4a16, mxfp4_w4a16_tiled, quantize_weight, tile_mxfp4_weights
from moe_ops.quant import formats, tiled
from tests.moe_ops.test_opcheck import check, random_ids

MXFP4 = WeightQuant("mxfp4", GroupShape(1, 32))
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _codes(e, n, k, gen):
    """Random mxfp4 codes and scales (scales near 2^0, some above 2^1, as the kernel's second multiply needs)."""
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 132, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    return codes, scales


@pytest.mark.parametrize("kind,layout,n,k", [("rows", None, 2880, 2880), ("gate_up", "interleaved", 5760, 2880),
                                             ("rows", None, 200, 96), ("gate_up", "concat", 1536, 2048)])  # fmt: skip
def test_tiled_chunks_hold_whole_experts(kind, layout, n, k):
    """N * B bytes are exactly S whole chunks, at least the expert's own; gpt-oss pads w2 by 11 chunks of 540."""
    s, b = wp.tiled_chunks(kind, n, k)
    need = wp.tiles_of(kind, n) * -(-k // wp.KT)
    assert n * b == s * 4 * wp.WORDS and s >= need
    if n % 64 == 0:
        assert s - need < need / (-(-k // wp.KT)) + 1
    if (kind, n, k) == ("rows", 2880, 2880):
        assert (s, need, b) == (540, 529, 1632)


@pytest.mark.parametrize("kind,layout,n,k", [("rows", None, 200, 320), ("gate_up", "interleaved", 144, 96), ("gate_up", "concat", 192, 256)])
def test_tile_round_trip_and_kernel_view(kind, layout, n, k, rng):
    """untile(tile(codes)) is the codes; the kernels' int32 view starts with pack_mxfp4_experts' chunks, zeros after."""
    codes, scales = _codes(3, n, k, rng)
    t = wp.tile_mxfp4_experts(codes, scales, kind=kind, gate_layout=layout)
    s, b = wp.tiled_chunks(kind, n, k)
    assert t.shape == (3, n, b) and t.dtype == torch.uint8
    back = wp.untile_mxfp4_experts(t, kind=kind, gate_layout=layout, k=k)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    words = wp.tiled_words(t)
    packed = wp.pack_mxfp4_experts(codes, scales, kind=kind, gate_layout=layout)
    used = packed.shape[1] * packed.shape[2]
    assert words.shape == (3, s, wp.WORDS)
    assert torch.equal(words[:, :used], packed.flatten(1, 2)) and not words[:, used:].any()


def _gemm_args(w_dtype, m, gather, rng, bias=True):
    e, n, k = 5, 192, 96
    codes, scales = _codes(e, n, k, rng)
    w = tiled.tile(codes, scales, w_dtype)
    ids = random_ids(m, 2, e)
    offsets, gather_idx, _ = routing_plan(ids, e, None)
    a = torch.randn(m if gather else 2 * m, k, generator=rng)
    b = torch.randn(e, n, generator=rng) if bias else None
    args = [a, None, None, "none", [-1, -1], w, None, None, None, w_dtype, [1, 32], b, offsets, gather_idx if gather else None, torch.float32]
    return args, codes, scales


@pytest.mark.parametrize("w_dtype", list(tiled.TILED_FORMATS))
@pytest.mark.parametrize("m,gather", [(0, True), (3, True), (4, False)])
def test_grouped_gemm_on_tiled_weights(w_dtype, m, gather, rng):
    """opcheck and fake impl; float64 against the decoded codes' product, row by row."""
    args, codes, scales = _gemm_args(w_dtype, m, gather, rng)
    check(grouped_gemm, args)
    out = grouped_gemm(*args)
    a, w64 = args[0].double(), formats.dequantize(codes, "mxfp4", (1, 32), scales, None, None).double()
    offsets, gather_idx, bias = args[12], args[13], args[11]
    rows = a[gather_idx.long()] if gather else a
    expert = torch.searchsorted(offsets[1:].long(), torch.arange(rows.shape[0]), right=True)
    want = torch.einsum("rk,rnk->rn", rows, w64[expert]) + bias.double()[expert]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "change,error",
    [
        (lambda args: args.__setitem__(6, torch.ones(5, 192, 3, dtype=torch.uint8)), "w_scale: 'mxfp4_tiled_rows' weights hold their scales"),
        (lambda args: args.__setitem__(10, [1, 16]), "w_group: 'mxfp4_tiled_rows' has mxfp4's groups"),
        (lambda args: args.__setitem__(5, args[5][:, :, :-4]), "is [E, 192, 136] bytes"),
        (lambda args: args.__setitem__(5, args[5].view(torch.int8)), "w: dtype torch.int8"),
        # K is known to the k-tile of 128 (the tiles hold no finer size): 160 columns need two.
        (lambda args: args.__setitem__(0, torch.randn(args[0].shape[0], 160)), "N=192, K=160 is"),
        (lambda args: args.__setitem__(9, "mxfp4_tiled"), "w_dtype"),
    ],
    ids=["scale_given", "group", "bytes", "dtype", "k_off_the_tiles", "unknown_format"],
)
def test_grouped_gemm_rejects_bad_tiled_args(change, error, rng):
    """Real and fake impl raise the same clear error."""
    args, _, _ = _gemm_args("mxfp4_tiled_rows", 3, True, rng)
    change(args)
    with pytest.raises((ValueError, TypeError), match=error.replace("[", r"\[").replace("(", r"\(")):
        grouped_gemm(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), pytest.raises((ValueError, TypeError)):
        grouped_gemm(*args)


def _layer(interleaved: bool, rng, e=6, h=96, i=160):
    act = moe_ops.Activation("swigluoai", interleaved=True) if interleaved else moe_ops.Activation("silu")
    q13 = quantize_weight(torch.randn(e, 2 * i, h, generator=rng), MXFP4)
    q2 = quantize_weight(torch.randn(e, h, i, generator=rng), MXFP4)
    config = mxfp4_w4a16(q13["scale"], q2["scale"], w13_bias=torch.randn(e, 2 * i, generator=rng), w2_bias=torch.randn(e, h, generator=rng))
    return act, q13["q"], q2["q"], config


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("m", [1, 9])
def test_tiled_layer_equals_untiled_layer(interleaved, m, rng):
    """fused_experts on tiled weights: the untiled layer's output bit for bit, eager and compiled (the lowering's
    fused ops reading the tiles); explain() names the tiled formats."""
    act, w13, w2, config = _layer(interleaved, rng)
    t13, t2, tconfig = tile_mxfp4_weights(w13, w2, config, interleaved=interleaved)
    assert tconfig.scheme.weight.tiled == ("interleaved" if interleaved else "concat")
    assert tconfig.w13_scale is None and tconfig.w13_bias is config.w13_bias
    x = torch.randn(m, 96, generator=rng).bfloat16()
    ids = random_ids(m, 2, 6)
    weights = torch.rand(m, 2, generator=rng)
    want = moe_ops.fused_experts(x, w13, w2, weights, ids, activation=act, quant_config=config)
    got = moe_ops.fused_experts(x, t13, t2, weights, ids, activation=act, quant_config=tconfig)
    assert torch.equal(got, want)

    def layer(x):
        return moe_ops.fused_experts(x, t13, t2, weights, ids, activation=act, quant_config=tconfig)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer)(x), want)
    (row,) = lowering.explain(layer, x).layers
    gate = "mxfp4_tiled_gate_up_interleaved" if interleaved else "mxfp4_tiled_gate_up"
    assert f"w-quant={gate} 1x32 (w13), mxfp4_tiled_rows 1x32 (w2)" in row.recipe


def test_fused_moe_tile_weights(rng):
    """FusedMoE.tile_weights: same float weights and output, scales gone, expert weights refused afterwards."""
    torch.manual_seed(rng.initial_seed() % 2**31)
    layer = moe_ops.FusedMoE(
        8, 2, 64, 96, activation=moe_ops.Activation("swigluoai", interleaved=True), expert_bias=True,
        quant_config=QuantScheme(None, MXFP4), dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.no_grad():
        layer.w13_bias.normal_()
        layer.w2_bias.normal_()
    x = torch.randn(7, 64, generator=rng).bfloat16()
    floats, want = layer.float_weights(), layer(x)
    layer.tile_weights()
    assert layer.w13_scale is None and layer.w2_scale is None and "(tiled)" in repr(layer)
    assert layer.w13.shape == (8, 192, wp.tiled_chunks("gate_up", 192, 64)[1])
    assert all(torch.equal(a, b) for a, b in zip(floats, layer.float_weights()))
    assert torch.equal(layer(x), want)
    with pytest.raises(ValueError, match="expert weights are tiled"):
        layer.load_weights({"w13": torch.randn(8, 192, 64)})
    with pytest.raises(ValueError, match="takes an untiled mxfp4_w4a16 layer"):
        layer.tile_weights()


def test_tiled_errors(rng):
    act, w13, w2, config = _layer(True, rng)
    t13, t2, tconfig = tile_mxfp4_weights(w13, w2, config, interleaved=True)
    x, ids, weights = torch.randn(2, 96).bfloat16(), random_ids(2, 2, 6), torch.rand(2, 2)
    with pytest.raises(ValueError, match="tiled for a gated activation with interleaved gates"):
        moe_ops.fused_experts(x, t13, t2, weights, ids, activation="silu", quant_config=tconfig)
    with pytest.raises(ValueError, match="w13: mxfp4_tiled_rows of N=320, K=96 is"):
        moe_ops.fused_experts(x, t13[:, :, :-4].contiguous(), t2, weights, ids, activation=act, quant_config=tconfig)
    with pytest.raises(ValueError, match="tiled mxfp4 weights are for 16-bit activations"):
        QuantScheme(moe_ops.quant.ActivationQuant("fp8", GroupShape(-1, -1)), WeightQuant("mxfp4", GroupShape(1, 32), tiled="concat"))
    with pytest.raises(ValueError, match="only mxfp4 weights are tiled"):
        WeightQuant("nvfp4", GroupShape(1, 16), tiled="concat")
    with pytest.raises(ValueError, match="WeightQuant.tiled: got 'yes'"):
        WeightQuant("mxfp4", GroupShape(1, 32), tiled="yes")
    with pytest.raises(ValueError, match="gates: got"):
        mxfp4_w4a16_tiled("pairs")
    with pytest.raises(ValueError, match="w13: tiling pairs gate and up rows"):
        tile_mxfp4_weights(w13[:, :160], w2, config)
    assert tconfig.scheme.name == "mxfp4_w4a16"


def test_gate_up_rejects_a_tiled_format_of_other_gates(rng):
    """The fused gate_up op on tiled weights: opcheck (fake impl included); tiles pair gate and up rows by one gate
    layout, and an activation reading the other raises."""
    from lowering.fused_ops import check_gate_up_args, gate_up

    act, w13, w2, config = _layer(True, rng)
    t13, _, _ = tile_mxfp4_weights(w13, w2, config, interleaved=True)
    offsets, gather_idx, _ = routing_plan(random_ids(2, 2, 6), 6, None)
    args = dict(
        x=torch.randn(2, 96).bfloat16(), a_scale=None, a_global_scale=None, a_dtype="none", a_group=[-1, -1], w=t13,
        w_scale=None, w_global_scale=None, w_zero=None, w_dtype="mxfp4_tiled_gate_up_interleaved", w_group=[1, 32],
        bias=None, expert_offsets=offsets, gather_idx=gather_idx, activation="swigluoai", alpha=1.702, limit=7.0,
        interleaved=True, out_quant_dtype="none", out_quant_group=[-1, -1], out_scale=None, out_global_scale=None,
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    check_gate_up_args(**args)
    torch.library.opcheck(gate_up, tuple(args.values()))
    with pytest.raises(ValueError, match="needs a gate_up format with concat gates"):
        check_gate_up_args(**{**args, "interleaved": False})
    with pytest.raises(ValueError, match="needs no tiled format"):
        check_gate_up_args(**{**args, "activation": "relu2", "interleaved": False})


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("m", [1, 16, 200])
def test_tiled_layer_on_the_kernels_equals_untiled(interleaved, m, rng):
    """On the w4a16 kernels, eager and in a CUDA graph: the tiled layer's output is the per-call packed layer's bit for
    bit (the same chunks, read in place), and both run there (no reference fallback)."""
    from moe_ops import eager_kernels

    act, w13, w2, config = _layer(interleaved, rng, e=8, h=2880, i=2880)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    w13, w2 = w13.cuda(), w2.cuda()
    config = mxfp4_w4a16(cuda(config.w13_scale), cuda(config.w2_scale), w13_bias=cuda(config.w13_bias), w2_bias=cuda(config.w2_bias))
    t13, t2, tconfig = tile_mxfp4_weights(w13, w2, config, interleaved=interleaved)
    x = torch.randn(m, 2880, device="cuda").bfloat16()
    ids = random_ids(m, 4, 8).cuda()
    weights = torch.rand(m, 4, device="cuda")
    for w, v, c in ((w13, w2, config), (t13, t2, tconfig)):
        assert eager_kernels.why_not(x, w, v, weights, act, c, c.w13_bias, c.w2_bias)[1] is None
    want = moe_ops.fused_experts(x, w13, w2, weights, ids, activation=act, quant_config=config)
    got = moe_ops.fused_experts(x, t13, t2, weights, ids, activation=act, quant_config=tconfig)
    assert torch.equal(got, want)
    torch._dynamo.reset()
    with lowering.enabled(require_kernels=True):
        compiled = torch.compile(lambda x: moe_ops.fused_experts(x, t13, t2, weights, ids, activation=act, quant_config=tconfig))(x)
    assert torch.equal(compiled, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = moe_ops.fused_experts(x, t13, t2, weights, ids, activation=act, quant_config=tconfig)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(replay, moe_ops.fused_experts(x, w13, w2, weights, ids, activation=act, quant_config=config))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("w_dtype,e,n,k", [("mxfp4_tiled_rows", 3, 2880, 2880), ("mxfp4_tiled_gate_up_interleaved", 3, 5760, 2880),
                                           ("mxfp4_tiled_gate_up", 35, 200, 96)])  # fmt: skip
def test_cuda_tiling_equals_the_torch_tiler(w_dtype, e, n, k, rng):
    """Tiling on CUDA (the Triton packer, 16 experts a launch) gives the CPU's torch tiles bit for bit, padding included."""
    codes, scales = _codes(e, n, k, rng)
    want = tiled.tile(codes, scales, w_dtype)
    got = tiled.tile(codes.cuda(), scales.cuda(), w_dtype)
    assert got.shape == want.shape and torch.equal(got.cpu(), want)


def test_down_reduce_opcheck_on_tiled_weights(rng):
    """The fused down_reduce op on mxfp4_tiled_rows weights (fake impl included), and a gate_up format refused there."""
    from lowering.fused_ops import check_down_reduce_args, down_reduce

    _, w13, w2, config = _layer(True, rng)
    _, t2, _ = tile_mxfp4_weights(w13, w2, config, interleaved=True)
    ids = random_ids(3, 2, 6)
    offsets, _, inverse = routing_plan(ids, 6, None)
    args = dict(
        a=torch.randn(6, 160, generator=rng).bfloat16(), a_scale=None, a_global_scale=None, a_dtype="none", a_group=[-1, -1],
        w=t2, w_scale=None, w_global_scale=None, w_zero=None, w_dtype="mxfp4_tiled_rows", w_group=[1, 32],
        bias=config.w2_bias.bfloat16(), expert_offsets=offsets, topk_weights=torch.rand(3, 2, generator=rng), inverse=inverse,
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    torch.library.opcheck(down_reduce, tuple(args.values()))
    with pytest.raises(ValueError, match="GEMM2's tiled weights are 'mxfp4_tiled_rows'"):
        check_down_reduce_args(**{**args, "w_dtype": "mxfp4_tiled_gate_up"})
