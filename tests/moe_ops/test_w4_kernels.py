"""mxfp4_w4a16 on the w4a16 kernels (moe_ops/w4_kernels.py): the per-call packing of the experts in use
(w4_pack_kernel.py) equals cute_kernels.w4a16_pack's bit for bit, and which GEMMs the path takes.

On CPU the packing kernel runs in Triton's interpreter (in a fresh subprocess); on the GPU compiled (the GPU test
here, and the layer's numerics through tests/moe_ops/test_numerics.py's mxfp4 cases, which now run on it).
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from moe_ops import w4_kernels
from tests.triton_interpreter import needs_interpreter, run_interpreted

# (kind, gate layout, N, K, expert offsets): N and K off the tile sizes, empty experts, all experts in use, one.
CASES = [
    ("rows", None, 200, 320, [0, 3, 3, 7, 7, 9]),
    ("gate_up", "interleaved", 144, 96, [0, 1, 1, 1, 1, 1]),
    ("gate_up", "concat", 192, 256, [0, 2, 4, 6, 8, 10]),
    ("rows", None, 128, 128, [0, 0, 0, 0, 0, 5]),
]

_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from cute_kernels import w4a16_pack as wp
    from moe_ops.expert_slots import expert_slots
    from moe_ops.w4_pack_kernel import pack_slots
    seed, kind, layout, n, k = int(sys.argv[1]), sys.argv[2], (None if sys.argv[3] == "None" else sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    offsets = torch.tensor([int(v) for v in sys.argv[6].split(",")], dtype=torch.int32)
    torch.manual_seed(seed)
    e = offsets.shape[0] - 1
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(0, 256, (e, n, k // 32), dtype=torch.uint8)
    idx, slot_offsets = expert_slots(offsets, e, min(int(offsets[-1]), e))
    got = pack_slots(codes, scales, idx, slot_offsets, kind=kind, gate_layout=layout)
    want = wp.pack_mxfp4_experts(codes[idx.long()], scales[idx.long()], kind=kind, gate_layout=layout)
    used = slot_offsets[1:] > slot_offsets[:-1]
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got[used], want[used])
    print("same", int(used.sum()))
    """
)


@needs_interpreter
@pytest.mark.parametrize("kind,layout,n,k,offsets", CASES)
def test_slot_packing_matches_the_reference_packer_in_interpreter(kind, layout, n, k, offsets, rng):
    out = run_interpreted(_SCRIPT, rng.initial_seed(), kind, layout, n, k, ",".join(map(str, offsets)))
    assert out.startswith("same"), out


_ROW_SCRIPT = textwrap.dedent(
    """
    import torch, triton, triton.language as tl
    from cute_kernels import w4a16_pack as wp
    from moe_ops.w4_pack_kernel import _weight_row

    @triton.jit
    def rows_of(out, n, GATE_UP: tl.constexpr, CONCAT: tl.constexpr):
        tile = tl.program_id(0)
        r = tl.arange(0, 128)
        tl.store(out + tile * 128 + r, _weight_row(tile, r, n, GATE_UP, CONCAT))

    checked = 0
    for kind, layout in (("rows", None), ("gate_up", "concat"), ("gate_up", "interleaved")):
        for n in (2, 62, 64, 126, 128, 130, 200, 256, 384, 1000):
            want = wp.row_map(kind, layout, n).flatten().to(torch.int32)
            got = torch.empty_like(want)
            rows_of[(wp.tiles_of(kind, n),)](got, n, GATE_UP=kind == "gate_up", CONCAT=layout == "concat")
            assert torch.equal(got, want), (kind, layout, n)
            checked += 1
    print("same", checked)
    """
)


@needs_interpreter
def test_in_kernel_weight_rows_are_the_row_map_in_interpreter():
    """The packer's in-kernel rule (_weight_row) gives w4a16_pack.row_map's rows, padding -1 included, for N
    below, at and past the tile sizes and for both gate layouts."""
    out = run_interpreted(_ROW_SCRIPT)
    assert out.startswith("same 30"), out


def test_served_recipes():
    """mxfp4 (1x32) weights, unquantized bf16 activations; GEMM1 with a gated activation and no requantization."""
    assert w4_kernels.serves("none", "mxfp4", (1, 32), torch.bfloat16)
    assert w4_kernels.serves("none", "mxfp4", [1, 32], torch.bfloat16, "swigluoai")
    assert not w4_kernels.serves("none", "mxfp4", (1, 32), torch.bfloat16, "relu2")
    assert not w4_kernels.serves("none", "mxfp4", (1, 32), torch.bfloat16, "silu", out_quant_dtype="fp8")
    assert not w4_kernels.serves("none", "mxfp4", (1, 32), torch.float16)
    assert not w4_kernels.serves("fp8", "mxfp4", (1, 32), torch.bfloat16)
    assert not w4_kernels.serves("none", "nvfp4", (1, 16), torch.bfloat16)


def test_activations_are_the_kernels_gated_kinds():
    pytest.importorskip("cutlass")
    from cute_kernels.moe_gemm import GATED

    assert w4_kernels.ACTIVATIONS == GATED


@pytest.mark.gpu
@pytest.mark.parametrize("kind,layout,n,k,offsets", CASES + [("gate_up", "interleaved", 5760, 2880, [0, 1, 2, 2, 3, 4])])
def test_cuda_slot_packing_matches_the_reference_packer(kind, layout, n, k, offsets):
    from cute_kernels import w4a16_pack as wp
    from moe_ops.expert_slots import expert_slots
    from moe_ops.w4_pack_kernel import pack_slots

    offsets = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    e = offsets.shape[0] - 1
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0, 256, (e, n, k // 32), dtype=torch.uint8, device="cuda")
    idx, slot_offsets = expert_slots(offsets, e, min(int(offsets[-1]), e))
    got = pack_slots(codes, scales, idx, slot_offsets, kind=kind, gate_layout=layout)
    want = wp.pack_mxfp4_experts(codes[idx.long()], scales[idx.long()], kind=kind, gate_layout=layout)
    used = slot_offsets[1:] > slot_offsets[:-1]
    assert torch.equal(got[used], want[used])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,layout", [("rows", None), ("gate_up", "concat"), ("gate_up", "interleaved")])
def test_cuda_slot_packing_captures_a_shape_never_run_eagerly(kind, layout):
    """The packer needs no per-shape tensor: a CUDA graph may capture it for an N it has never packed (an upload
    made on first use would fail inside the capture)."""
    from cute_kernels import w4a16_pack as wp
    from moe_ops.expert_slots import expert_slots
    from moe_ops.w4_pack_kernel import pack_slots

    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device="cuda")

    def inputs(n, k):
        codes = torch.randint(0, 256, (3, n, k // 2), dtype=torch.uint8, device="cuda")
        return codes, torch.randint(0, 256, (3, n, k // 32), dtype=torch.uint8, device="cuda")

    idx, slot_offsets = expert_slots(offsets, 3, 3)
    pack_slots(*inputs(256, 128), idx, slot_offsets, kind=kind, gate_layout=layout)  # compiles the kernel
    codes, scales = inputs(384, 192)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pack_slots(codes, scales, idx, slot_offsets, kind=kind, gate_layout=layout)
    codes.copy_(torch.randint_like(codes, 0, 256))
    graph.replay()
    torch.cuda.synchronize()
    want = wp.pack_mxfp4_experts(codes[idx.long()], scales[idx.long()], kind=kind, gate_layout=layout)
    used = slot_offsets[1:] > slot_offsets[:-1]
    assert torch.equal(got[used], want[used])


@pytest.mark.parametrize("tiled_weights", [True, False], ids=["tiled", "codes"])
@pytest.mark.parametrize("weights_early", [True, False])
def test_gemm2_loads_weights_early_only_when_tiled(tiled_weights, weights_early, monkeypatch):
    """down_reduce asks the kernel to read its offsets and start its weights before waiting for GEMM1
    (early_weights) only when the caller says both were written before GEMM1 and the weights are tiled at load time:
    codes as stored are re-laid per call by a kernel right before GEMM2, which GEMM2 must then wait for."""
    from moe_ops import w4_pack_kernel

    e, hidden, inter, p = 4, 128, 64, 6
    calls = []

    class Interface:
        @staticmethod
        def w4a16_down_reduce(a, packed, bias, offsets, topk_weights, inverse, **kwargs):
            calls.append(kwargs["early_weights"])
            return torch.zeros(p // 2, hidden, dtype=torch.bfloat16)

    monkeypatch.setattr(w4_pack_kernel, "pack_slots", lambda w, s, idx, offsets, **kw: torch.zeros(1, dtype=torch.int32))
    if tiled_weights:
        w, w_scale, w_dtype = torch.zeros(e, hidden, 68, dtype=torch.uint8), None, "mxfp4_tiled_rows"  # one chunk an expert
    else:
        w, w_scale, w_dtype = torch.zeros(e, hidden, inter // 2, dtype=torch.uint8), torch.zeros(e, hidden, inter // 32, dtype=torch.uint8), "mxfp4"
    w4_kernels.down_reduce(
        Interface, a=torch.zeros(p, inter, dtype=torch.bfloat16), w=w, w_scale=w_scale, w_dtype=w_dtype, bias=None,
        expert_offsets=torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32), topk_weights=torch.ones(p // 2, 2),
        inverse=torch.arange(p, dtype=torch.int32), norm_weight=None, norm_eps=1e-6, weights_early=weights_early,
    )  # fmt: skip
    assert calls == [weights_early and tiled_weights]
