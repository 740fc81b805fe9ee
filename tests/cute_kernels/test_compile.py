"""Every kernel variant the fused ops can request compiles for sm_90a on this (CPU-only) machine, and
its generated code has the facts the design relies on: WGMMA for the GEMMs, TMA
(cp.async.bulk.tensor, with an L2 policy in 64-row kernels) for the weights and for GEMM2's rows in 128-row tiles, cp.async for the
other rows, no local memory or spills (ptxas -v for sm_90a), shared memory within the 227 KB an
sm_90 block may use, and no global memory access before griddepcontrol.wait (they launch as
programmatic dependents)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import torch

# Before the DSL's first import: it fixes its target then (exporting object files needs it).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass")
tvm_ffi = pytest.importorskip("tvm_ffi")

from cute_kernels import compile as cc  # noqa: E402
from cute_kernels import interface  # noqa: E402
from cute_kernels.moe_gemm import L2_EVICT_FIRST, SMEM_CAPACITY, MoeGemmSm90  # noqa: E402
from cute_kernels.norm_token_sum import NormTokenSumSm90  # noqa: E402
from cute_kernels.token_sum import TokenSumSm90  # noqa: E402
from cute_kernels import w4a16_grouped as w4  # noqa: E402

import cutlass.cute as cute  # noqa: E402

from tests.ptx import global_accesses, split_at_wait, touches_global  # noqa: E402

VARIANTS = [
    *[(torch.bfloat16, *v) for v in interface.variants(torch.bfloat16, bias_dtypes=(None, torch.bfloat16, torch.float32))],
    *[(torch.float16, *v) for v in interface.variants(torch.float16, bias_dtypes=(None, torch.float16, torch.float32))],
    # fp8 operands (moe_ops/fp8_kernels.py), outputs in bf16: the quantized path's GEMMs.
    *[(torch.bfloat16, *v) for v in interface.variants(torch.bfloat16, bias_dtypes=(None, torch.bfloat16, torch.float32), scales="fp8")],
    *[(torch.bfloat16, *v) for v in interface.variants(torch.bfloat16, bias_dtypes=(None, torch.bfloat16, torch.float32), scales="fp8_block")],
]


def _ptxas(ptx: str, tmp_path) -> str:
    """ptxas -v for sm_90a; the DSL emits a newer PTX ISA version than the machine's ptxas reads,
    and the instructions used exist in ISA 9.0."""
    path = tmp_path / "k.ptx"
    path.write_text(re.sub(r"^\.version .*$", ".version 9.0", ptx, count=1, flags=re.M))
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stderr


def _compile(kernel, args, tmp_path):
    return cute.compile(kernel, *args, options=f"{cc.OPTIONS} --keep-ptx --dump-dir={tmp_path}").artifacts.PTX


def _check_resources(ptx: str, tmp_path) -> None:
    """ptxas -v's facts for sm_90a, last in each test (its other facts checked): a skip, not a pass,
    where ptxas is missing."""
    if not shutil.which("ptxas"):
        pytest.skip("ptxas not found: registers, spills and WGMMA serialisation unchecked")
    report = _ptxas(ptx, tmp_path)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    # C7520: ptxas serialises the WGMMAs (e.g. for a branch it cannot prove warpgroup-uniform).
    assert "C7520" not in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs <= 168, f"{regs} registers: 384 threads would not fit one block per SM"


# What GEMM2 (early_b) may do before its wait: read the offsets past L1, start the weights' TMA.
EARLY_ACCESS = r"ld\.global\.cg\.b32|cp\.async\.bulk\.tensor\.3d\.\S+"
# What GEMM1 may do before its wait (the M = 1 hint): read the token's expert ids, ask L2 for weights.
HINT_PREFETCH = r"cp\.async\.bulk\.prefetch\.tensor\.[35]d\.L2\.global\S*"
HINT_ACCESS = rf"ld\.global\.b32|{HINT_PREFETCH}"


def _waits_before_global_access(ptx: str, early_weights: bool, gather: bool) -> None:
    """The kernels launch as programmatic dependents of the kernel before them (PDL), so they must
    not touch global memory before griddepcontrol.wait: the previous kernel's writes are visible
    only after it. GEMM2's exception (MoeGemmSm90.early_b): the offsets and its weights, which
    GEMM1 does not write, loaded before the wait. GEMM1's (the weight hint): the expert ids, which
    only steer L2 prefetches, and the prefetches themselves; nothing reaches shared memory."""
    before, after = split_at_wait(ptx)
    early = global_accesses(before)
    if early_weights:
        # _load_offsets' loads (3 in every variant when written) and the first tile's weights by TMA.
        offsets = [a for a in early if a == "ld.global.cg.b32"]
        assert 0 < len(offsets) <= 3 and any(a.startswith("cp.async.bulk.tensor.3d") for a in early), early
        early = [a for a in early if not re.fullmatch(EARLY_ACCESS, a)]
    if gather:
        # One load of the hint's ids (a lane's id each); gather_idx or the fp8 scales, which the
        # kernel before may still be writing, would be more loads of the same kind.
        assert any(re.fullmatch(HINT_PREFETCH, a) for a in early), "GEMM1 asks L2 for no weights before its wait"
        assert early.count("ld.global.b32") == 1, early
        early = [a for a in early if not re.fullmatch(HINT_ACCESS, a)]
    assert not early, f"global accesses before griddepcontrol.wait: {early}"
    assert touches_global(after)


def _id(v) -> str:
    dtype, epi, gather, bias_dtype, tile_m, tile_n, early = v
    bias = str(bias_dtype).removeprefix("torch.") if epi.has_bias else "none"
    operands = {"none": "", "fp8": "fp8-", "fp8_block": "fp8block-"}[epi.scales]
    name = f"{operands}{str(dtype).removeprefix('torch.')}-{epi.activation}-{epi.gate_layout}-gather{int(gather)}-bias_{bias}-{tile_m}x{tile_n}"
    return name + ("-early" if early else "")


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_moe_gemm_variant(variant, tmp_path):
    dtype, epi, gather, bias_dtype, tile_m, tile_n, early = variant
    kernel = MoeGemmSm90(epi, tile_n=tile_n, tile_m=tile_m, gather=gather, num_sms=132, early_weights=early)
    fp8 = epi.scales != "none"
    ptx = _compile(kernel, interface.gemm_compile_args(dtype, bias_dtype, fp8=fp8), tmp_path)
    # WGMMA on bf16/fp16 operands (m64nNk16) or e4m3 ones (m64nNk32), two accumulators for [gate; up];
    # swapped (tile_m 16), the tokens are N.
    shape = r"k32\.f32\.(e4m3)\.e4m3" if fp8 else r"k16\.f32\.(bf16|f16)"
    wgmma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n(\d+){shape}", ptx)
    assert wgmma and {n for n, _ in wgmma} == {str(kernel.tile_m if kernel.swap else kernel.part_n // kernel.wg_grid[1])}
    assert kernel.tile_k == (128 if fp8 else 64)
    # e4m3: each k-tile's sums are added to the fp32 accumulators (promotion), after waiting for its
    # WGMMAs (wait_group 0), or with lag for the previous k-tile's while its own run (wait_group 1);
    # 16-bit operands keep one k-tile of WGMMAs in flight.
    # Per-tensor/per-row scales lag in the swapped tiles.
    assert kernel.lag == (epi.scales == "fp8" and tile_m == 16)
    assert bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == (not fp8 or kernel.lag)
    assert "wgmma.fence" in ptx and "wgmma.commit_group" in ptx and "wgmma.wait_group" in ptx
    # Weights by TMA (the compiler may duplicate the load loop's body, so count per part): 3-d
    # (K, rows, expert), or 5-d for paired gate/up rows (K, 8 rows, gate/up, blocks, expert).
    tma = ptx.count(f"cp.async.bulk.tensor.{5 if kernel.paired else 3}d.shared::cta.global")
    assert tma >= kernel.num_parts and tma % kernel.num_parts == 0
    if kernel.hand_over:
        # The second consumer warpgroup hands its accumulators over behind a named barrier.
        assert re.search(r"bar\.sync\s+1, 256;", ptx)
    # 64-row and swapped kernels may load weights as evict-first (for experts of one m-tile, chosen at
    # run time); 128-row kernels keep the DSL's default policy (0) on every load.
    evict_first = re.search(rf"\b({L2_EVICT_FIRST}|0x0*{L2_EVICT_FIRST:X})\b", ptx[ptx.index(".entry"):], flags=re.I)
    assert bool(evict_first) == (kernel.tile_m <= 64), kernel.tile_m
    if not kernel.tma_a:
        # Rows by 16-byte cp.async completing on an mbarrier; rows past the expert are zero-filled:
        # the cp.async takes a source size (16 or 0) from a register.
        assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)
        assert "cp.async.bulk.tensor.2d" not in ptx
    else:
        # GEMM2's contiguous rows in 128-row tiles by TMA (2-D: rows x K), on the weights' barrier.
        assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
        assert "cp.async.cg" not in ptx and "cp.async.mbarrier" not in ptx
    # With 256-row B tiles those rows past the expert are zeroed in shared memory (16-byte stores),
    # made visible to the WGMMAs (async proxy) by a proxy fence and each consumer warpgroup's own
    # named barrier; never with narrower tiles, which are bound by shared memory (bench/NOTES.md v27).
    zero_stores = re.search(r"st\.shared\.v4\.b32\s+\[%r\d+(\+\d+)?\], \{0, 0, 0, 0\};", ptx)
    assert kernel.zero_pad == (kernel.tma_a and kernel.part_n == 256)
    assert bool(zero_stores) == kernel.zero_pad
    assert ("fence.proxy.async.shared::cta" in ptx) == kernel.zero_pad
    assert bool(re.search(r"bar\.sync\s+%r\d+, 128;", ptx)) == kernel.zero_pad
    # GEMM2's 128-row tiles without biases keep a tile's packed outputs beside the next tile's
    # accumulators (deferred stores): their consumers take more registers, the one-thread producer fewer.
    # Not with e4m3 operands: promotion's temporaries take the registers the packed outputs would.
    assert kernel.defer == (kernel.tma_a and not epi.has_bias and epi.scales == "none")
    regs = (40, 232) if kernel.defer else (56, 224)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{regs[0]};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs[1]};", ptx)
    if kernel.staged:
        # GEMM2's epilogue stages rows through shared memory and stores them 16 bytes at a time.
        assert "st.global.v4.b32" in ptx and "st.global.b32" not in ptx
    if kernel.swap:
        # A thread's accumulators are one column of several tokens: element stores.
        assert "st.global.b16" in ptx and "st.global.v4" not in ptx
    if not kernel.staged and not kernel.swap:
        # GEMM1's direct stores: after a transpose across each quad, a lane stores 16 bytes of one
        # row, so a quad writes whole 32-byte sectors (bench/NOTES.md v35). Narrower stores only for
        # a last odd 8-column block (32-bit pairs) or interleaved's last two blocks (64 bits).
        stores = set(re.findall(r"st\.global\.[\w.]+", ptx))
        assert "st.global.v4.b32" in stores, stores
        assert stores <= {"st.global.v4.b32", "st.global.b32", "st.global.v4.b16"}, stores
        assert "shfl.sync.bfly" in ptx
    if epi.has_bias and not kernel.swap:
        # Bias loads are invariant (ld.global.nc), so ptxas may issue them ahead of the output
        # stores, which it must otherwise assume alias them (bench/NOTES.md v35).
        assert "ld.global.nc" in ptx
    assert ".local" not in ptx
    _waits_before_global_access(ptx, kernel.early_b, kernel.gather)
    assert "griddepcontrol.launch_dependents" in ptx
    assert kernel.storage.size_in_bytes() <= SMEM_CAPACITY
    assert kernel.num_stages >= 3
    _check_resources(ptx, tmp_path)


# Every w4a16 variant: each epilogue reading grouped rows by TMA, and each gated one (GEMM1) gathering its rows; the
# rows kind (GEMM2) also with its weights started before the wait (early_weights).
W4_VARIANTS = (
    [(epi, False, False) for epi in interface.w4a16_variants()]
    + [(epi, True, False) for epi in interface.w4a16_variants() if epi.activation]
    + [(epi, False, True) for epi in interface.w4a16_variants() if not epi.activation]
)


def _w4_id(v) -> str:
    epi, gather, early = v
    return f"{epi}-gather={gather}" + ("-early" if early else "")


@pytest.mark.parametrize("tok", w4.TOKS)
@pytest.mark.parametrize("variant", W4_VARIANTS, ids=_w4_id)
def test_w4a16_variant(variant, tok, tmp_path):
    """The w4a16 grouped GEMM: the weights' chunk by 2-D TMA; the rows by 2-D TMA, or with gather in 16-byte
    cp.async chunks, zero-filled past the expert; register-A WGMMA on bf16 (weights
    on M: m64n{tok}k16), KB per k-tile, the decode's bf16x2 multiplies (one per output register; two with a scale
    above 2^1), bf16 stores after an activation, float32 ones otherwise; no local memory or spills; launched as a
    programmatic dependent, with no global access before griddepcontrol.wait but, with early_weights, the offsets
    (past L1) and the first unit's weight chunks."""
    epilogue, gather, early = variant
    kernel = w4.W4a16GroupedSm90(epilogue, tok, gather, early)
    ptx = _compile(kernel, interface.w4a16_compile_args(epilogue), tmp_path)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 [^;]*;", ptx)
    assert len(wgmma) == w4.KB and set(wgmma) == {str(tok)}  # WGMMA's N is the m-tile's rows
    # register A: the operand after the accumulators is a brace list of 4 registers, not a descriptor
    assert all(re.search(r"\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", m) for m in re.findall(r"wgmma\.mma_async[^;]*;", ptx))
    tma_loads = ptx.count("cp.async.bulk.tensor.2d.shared::cta.global")
    gathers = re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^\]]+\], \[[^\]]+\], 16, %r\d+;", ptx)
    if gather:
        # the weights' chunk by TMA; A's rows in 16-byte chunks with a source size (0: zero-filled), tok / 8 per
        # thread and k-tile (the k-loop unrolled: a multiple)
        assert tma_loads >= 1 and gathers and len(gathers) % (tok // 8) == 0, (tma_loads, len(gathers))
        assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    else:
        assert tma_loads >= 2 and not gathers  # the weights' chunk, the rows (the loop unrolled)
    assert ptx.count("mul.rn.bf16x2") == 4 * 2 * w4.GROUPS * 3  # fast path: 1 per register; any scale: 2
    assert ptx.count("vote.sync.any.pred") >= 1
    stores = set(re.findall(r"st\.global\.[\w.]+", ptx))
    scalar = "st.global.b16" if epilogue.activation or epilogue.rows_bf16 else "st.global.b32"
    if kernel.offload:
        # the store warps' lanes store cols / 32 consecutive outputs in one vector store (bf16 pairs of a gated tile;
        # four float32 or bf16 of a rows tile), one at a time where n_out is not a multiple of that
        vector = {"st.global.b32", "st.global.v2.b16"} if epilogue.activation else {"st.global.v2.b32"} if epilogue.rows_bf16 else {"st.global.v4.b32"}
        assert scalar in stores and len(stores) == 2 and stores - {scalar} <= vector, stores
        assert ("ld.shared.v2.b32" if epilogue.activation else "ld.shared.v4.b32") in ptx
    else:
        assert stores == {scalar}, stores
    exchanges = re.search(r"bar\.sync\s+1, 256;", ptx) and re.search(r"bar\.sync\s+2, 256;", ptx)
    if kernel.offload:
        # the sums go to the store warps through shared memory: no exchange between the consumer warpgroups, and the
        # staging buffer's two mbarriers (arrivals by 256 consumer threads and 96 store threads) beside the ring's
        assert not exchanges and kernel.stages == w4.STAGES_OFFLOADED[tok]
        assert len(re.findall(r"mbarrier\.arrive(?:\.release)?(?:\.cta)?\.shared(?:::cta)?\.b64", ptx)) >= 2
    elif epilogue.activation:
        assert exchanges
    assert ".local" not in ptx
    before, _ = split_at_wait(ptx)
    accesses = global_accesses(before)
    if early:
        # the offsets by ld.global.cg, and one TMA in the loop over the first unit's early k-tiles (A's come after)
        tma = [a for a in accesses if a.startswith("cp.async.bulk.tensor.2d")]
        assert "ld.global.cg.b32" in accesses and len(tma) == 1, f"no weights early: {accesses}"
        accesses = [a for a in accesses if a != "ld.global.cg.b32" and a not in tma]
    assert not accesses, f"global accesses before griddepcontrol.wait: {accesses}"
    assert "griddepcontrol.launch_dependents" in ptx
    assert kernel.storage.size_in_bytes() <= SMEM_CAPACITY
    _check_resources(ptx, tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_sum(dtype, tmp_path):
    ptx = _compile(TokenSumSm90(), interface.token_sum_compile_args(dtype), tmp_path)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "16-byte loads and stores"
    assert "atom." not in ptx and "red." not in ptx, "no atomics: the reduction is deterministic"
    assert ".local" not in ptx
    # Before the wait it may read the plan's and the router's outputs (older than GEMM2, 32-bit
    # loads; see token_sum.py), never GEMM2's rows (16-byte loads) nor write anything.
    before, after = split_at_wait(ptx)
    accesses = global_accesses(before)
    assert accesses and set(accesses) == {"ld.global.b32"}, accesses
    assert "ld.global.v4" in after
    # The next kernel (a programmatic dependent: the next layer's plan) may launch only after the wait.
    assert "griddepcontrol.launch_dependents" not in before and "griddepcontrol.launch_dependents" in after
    _check_resources(ptx, tmp_path)


@pytest.mark.parametrize("norm_dtype", ["same", torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_token_sum(dtype, norm_dtype, tmp_path):
    norm_dtype = dtype if norm_dtype == "same" else norm_dtype
    kernel = NormTokenSumSm90(weight_float32=norm_dtype == torch.float32)
    ptx = _compile(kernel, interface.norm_token_sum_compile_args(dtype, norm_dtype), tmp_path)
    assert "st.global.v4" in ptx, "16-byte stores"
    # (an instruction's start: "red." is also the tail of "shared.")
    assert not re.search(r"^\s*(atom|red)\.", ptx, re.M), "no atomics: the reduction is deterministic"
    assert "bar.sync" in ptx and "shfl.sync.bfly" in ptx, "a block reduction of each row's squares"
    assert "rsqrt.approx" in ptx
    assert ".local" not in ptx
    # Nothing global before the wait: GEMM2 writes y (the norm's weight is read after it too).
    before, after = split_at_wait(ptx)
    assert not touches_global(before), "a global access before griddepcontrol.wait"
    assert "ld.global" in after and "griddepcontrol.launch_dependents" in after
    _check_resources(ptx, tmp_path)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    """A variant compiled once is loaded from the disk cache by a fresh in-memory cache."""
    monkeypatch.setenv("MOE_OPS_CUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(cc, "_memory", {})
    _, epi, gather, bias_dtype, tile_m, tile_n, _ = VARIANTS[0]
    interface._gemm(epi, gather, torch.bfloat16, bias_dtype, 132, tile_m, tile_n)
    key = next(iter(k for k in cc._memory))
    assert cc.timings[key][0] == "compile"
    assert list(tmp_path.glob("*.o"))
    monkeypatch.setattr(cc, "_memory", {})
    interface._gemm(epi, gather, torch.bfloat16, bias_dtype, 132, tile_m, tile_n)
    assert cc.timings[key][0] == "disk"
    # Loaded as TVM-FFI, the calling convention the launchers use (ints for pointers and the stream).
    assert isinstance(cc._memory[key], tvm_ffi.Function)


def test_early_weights_only_without_gather():
    """GEMM1 reads the routing plan's offsets, which its previous kernel writes: it cannot start its
    weights before the wait, and asking for it is refused before anything compiles."""
    from cute_kernels.moe_gemm import Epilogue

    with pytest.raises(ValueError, match="early_weights=True with gather=True"):
        MoeGemmSm90(Epilogue("silu", "concat"), gather=True, early_weights=True)


def test_tiles_the_kernel_cannot_store_are_refused():
    """GEMM2's staged stores write 32-column pieces: a 64x96 tile (48 columns per warpgroup) would
    write past n_out, so it is refused before anything compiles; GEMM1 (masked stores) takes it."""
    from cute_kernels.moe_gemm import Epilogue

    with pytest.raises(ValueError, match="48 columns.*multiple of 32"):
        MoeGemmSm90(Epilogue("none", "none"), tile_m=64, tile_n=96, gather=False)
    with pytest.raises(ValueError, match="rows per B part; allowed"):
        MoeGemmSm90(Epilogue("silu", "concat"), tile_m=64, tile_n=176, gather=True)
    MoeGemmSm90(Epilogue("silu", "concat"), tile_m=64, tile_n=96, gather=True)
    MoeGemmSm90(Epilogue("none", "none"), tile_m=64, tile_n=64, gather=False)


def test_swapped_tiles_the_kernel_cannot_build_are_refused():
    """tile_m 16 puts 64 weight rows on each consumer warpgroup's WGMMA M: 64 rows in all (split-K,
    any gate layout) or 128 (one part per warpgroup); other sizes, and 128-row interleaved gate/up
    (its pairs would land in different threads), are refused before compiling."""
    from cute_kernels.moe_gemm import Epilogue

    with pytest.raises(ValueError, match="tile_m=16 .*tile_n=128 and gate_layout 'interleaved'"):
        MoeGemmSm90(Epilogue("swigluoai", "interleaved"), tile_m=16, tile_n=128, gather=True)
    with pytest.raises(ValueError, match="tile_m=16 .*tile_n=256"):
        MoeGemmSm90(Epilogue("silu", "concat"), tile_m=16, tile_n=256, gather=True)
    with pytest.raises(ValueError, match="tile_m=16 .*tile_n=96"):
        MoeGemmSm90(Epilogue("none", "none"), tile_m=16, tile_n=96, gather=False)
    assert MoeGemmSm90(Epilogue("silu", "concat"), tile_m=16, tile_n=128, gather=True).wg_part
    assert not MoeGemmSm90(Epilogue("none", "none"), tile_m=16, tile_n=128, gather=False).staged
    # Split-K: one 64-row part; with a gate, gate and up rows paired in it (32 output columns).
    for layout, act in (("concat", "silu"), ("interleaved", "swigluoai")):
        kernel = MoeGemmSm90(Epilogue(act, layout), tile_m=16, tile_n=64, gather=True)
        assert kernel.k_split and kernel.paired and kernel.num_parts == 1 and kernel.out_n == 32
    kernel = MoeGemmSm90(Epilogue("none", "none"), tile_m=16, tile_n=64, gather=False)
    assert kernel.k_split and not kernel.paired and kernel.out_n == 64


def test_too_many_experts_declined():
    """The offsets table in shared memory holds MAX_EXPERTS + 1 entries: more experts are declined with
    the reason (the lowering then runs the reference), and a direct launch raises before any work."""
    from cute_kernels.moe_gemm import MAX_EXPERTS

    common = dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16, has_bias=False, hidden=128, intermediate=128)
    assert interface.down_reduce_support(num_experts=MAX_EXPERTS, **common)[0]
    ok, why = interface.down_reduce_support(num_experts=MAX_EXPERTS + 1, **common)
    assert not ok and f"{MAX_EXPERTS + 1} local experts" in why
    ok, why = interface.gate_up_support(activation="silu", gate_layout="concat", num_experts=MAX_EXPERTS + 1, **common)
    assert not ok and f"at most {MAX_EXPERTS}" in why
    w = torch.empty(MAX_EXPERTS + 1, 256, 128, dtype=torch.bfloat16)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    offsets = torch.zeros(MAX_EXPERTS + 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"w: {MAX_EXPERTS + 1} experts"):
        interface.gate_up(x, w, None, offsets, torch.zeros(4, dtype=torch.int32), activation="silu", alpha=1.0, limit=7.0, gate_layout="concat")


def test_expert_ids_hint():
    """gate_up's expert_ids (the M = 1 weight hint): int64 ids are read as their low words (stride 2),
    no hint past M = 1; a float tensor or a count other than the routed pairs raises, naming
    expert_ids, before any launch."""
    gather = torch.randint(0, 4, (3,), dtype=torch.int32)
    ids = torch.tensor([[5, 1, 7]])
    view, pairs, stride = interface._hint(torch.randn(1, 64), gather, ids)
    assert (pairs, stride) == (3, 2) and view[0, ::2].tolist() == [5, 1, 7]
    assert interface._hint(torch.randn(1, 64), gather, ids.int())[1:] == (3, 1)
    assert interface._hint(torch.randn(3, 64), torch.zeros(9, dtype=torch.int32), torch.ones(3, 3, dtype=torch.int32))[1] == 0
    assert interface._hint(torch.randn(1, 64), gather, None)[1] == 0
    w = torch.randn(4, 256, 128, dtype=torch.bfloat16)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    kw = dict(activation="silu", alpha=1.0, limit=7.0, gate_layout="concat")
    with pytest.raises(TypeError, match=r"expert_ids: dtype torch.float32; expected torch.int32 or torch.int64"):
        interface.gate_up(x, w, None, offsets, gather, expert_ids=torch.rand(1, 3), **kw)
    with pytest.raises(ValueError, match=r"expert_ids: 2 ids for 3 routed pairs"):
        interface.gate_up(x, w, None, offsets, gather, expert_ids=ids[:, :2].contiguous(), **kw)
    with pytest.raises(ValueError, match=r"expert_ids: on meta, the other tensors on cpu"):
        interface.gate_up(x, w, None, offsets, gather, expert_ids=ids.to("meta"), **kw)
    with pytest.raises(ValueError, match=r"w: 'silu' reads each expert's N rows as gate and up halves; N must be even, got shape \[4, 255, 128\]"):
        interface.gate_up(x, w[:, :255], None, offsets, gather, **kw)


def test_expert_ids_hint_only_where_the_kernel_can_read_it():
    """The hint's ids reach the kernel as a pointer declared 16-byte aligned, read one id per lane of
    warp 0 (HINT_MAX_PAIRS): more ids, or ids off a 16-byte boundary, give no hint (count 0) instead of
    unread ids or a misaligned pointer; the output never depends on the hint, so the call goes on."""
    from cute_kernels.moe_gemm import HINT_MAX_PAIRS

    x = torch.randn(1, 64)
    n = HINT_MAX_PAIRS
    ids = torch.arange(n + 1, dtype=torch.int32).view(1, n + 1)
    gather = torch.zeros(n + 1, dtype=torch.int32)
    assert interface._hint(x, gather[:n], ids[:, :n].contiguous())[1] == n
    assert interface._hint(x, gather, ids)[1] == 0
    for dtype in (torch.int32, torch.int64):
        flat = torch.arange(5, dtype=dtype)
        aligned, off = flat[:4].view(1, 4), flat[1:].view(1, 4)
        assert aligned.data_ptr() % 16 == 0 and off.is_contiguous() and off.data_ptr() % 16 == dtype.itemsize
        assert interface._hint(x, gather[:4], aligned)[1] == 4
        assert interface._hint(x, gather[:4], off)[1] == 0


def test_activation_and_gate_layout_must_agree():
    """A gated activation reads [gate; up] halves or interleaved pairs, relu2 one part of N = I rows:
    any other pairing is declined by gate_up_support with the reason (the lowering then runs the
    reference), and an Epilogue built with it directly is refused before anything compiles."""
    from cute_kernels.moe_gemm import Epilogue

    common = dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16, has_bias=False, hidden=128, intermediate=128, num_experts=8)
    for act, layout in (("silu", "none"), ("swigluoai", "none"), ("relu2", "concat"), ("relu2", "interleaved")):
        assert interface.gate_up_support(activation=act, gate_layout=layout, **common) == (False, f"activation {act!r} with gate layout {layout!r}")
        with pytest.raises(ValueError, match=f"Epilogue: activation {act!r} does not go with gate_layout {layout!r}"):
            Epilogue(act, layout)
    for act, layout in (("silu", "concat"), ("swigluoai", "interleaved"), ("relu2", "none")):
        assert interface.gate_up_support(activation=act, gate_layout=layout, **common)[0]
        Epilogue(act, layout)


def test_gemm2_rows_by_tma_only_in_128_row_tiles():
    """A by TMA only for GEMM2's contiguous rows in 128-row tiles: 64-row tiles (weight streaming) keep
    cp.async with zero-filled rows (TMA there measured no faster, and 2 µs slower at qwen3 M = 1:
    bench/NOTES.md v15), and GEMM1's gathered rows cannot be one TMA box. test_moe_gemm_variant checks
    the code of whichever path the kernel takes, so the choice itself is pinned here."""
    checked = set()
    for _, epi, gather, _, tile_m, tile_n, early in VARIANTS:
        kernel = MoeGemmSm90(epi, tile_m=tile_m, tile_n=tile_n, gather=gather, early_weights=early)
        assert kernel.tma_a == (not gather and tile_m == 128), (epi, gather, tile_m, tile_n)
        checked.add((gather, tile_m))
    assert {(False, 128), (False, 64), (False, 16), (True, 64)} <= checked


def _direct_args(op: str) -> dict:
    """Arguments of a valid direct call (E = 4, H = I = 128, M = 4, k = 2) as CPU tensors: the checks run
    before anything touches a GPU."""
    e, h, i, m, k = 4, 128, 128, 4, 2
    bf16, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    offsets = torch.tensor([0, 3, 5, 8, 8], **i32)
    if op == "gate_up":
        return dict(x=torch.randn(m, h, **bf16), w=torch.randn(e, 2 * i, h, **bf16), bias=None, offsets=offsets,
                    gather=torch.randint(0, m, (m * k,), **i32))  # fmt: skip
    return dict(a=torch.randn(m * k, i, **bf16), w=torch.randn(e, h, i, **bf16), bias=None, offsets=offsets,
                topk_weights=torch.rand(m, k), inverse=torch.randperm(m * k).to(torch.int32))  # fmt: skip


# name -> (op, the argument to replace, its bad value as a function of the good args, the error)
BAD_DIRECT_CALLS = {
    "x_float32": ("gate_up", "x", lambda a: a["x"].float(), (ValueError, "activations in torch.float32")),
    "w_other_dtype": ("gate_up", "w", lambda a: a["w"].half(), (ValueError, "weights in torch.float16")),
    "w_column_major": ("gate_up", "w", lambda a: a["w"].transpose(1, 2).contiguous().transpose(1, 2), (ValueError, "column-major")),
    "x_wrong_hidden": ("gate_up", "x", lambda a: a["x"][:, :64].contiguous(), (ValueError, r"x: shape \[4, 64\]; expected \[\*, 128\]")),
    "x_strided": ("gate_up", "x", lambda a: torch.randn(128, 4, dtype=torch.bfloat16).t(), (ValueError, "x: strides")),
    "offsets_int64": ("gate_up", "offsets", lambda a: a["offsets"].long(), (TypeError, "offsets: dtype torch.int64")),
    "offsets_short": ("gate_up", "offsets", lambda a: a["offsets"][:4], (ValueError, r"offsets: shape \[4\]; expected \[5\]")),
    "gather_2d": ("gate_up", "gather", lambda a: a["gather"].view(4, 2), (ValueError, "gather: shape")),
    "bias_wrong_n": ("gate_up", "bias", lambda a: torch.randn(4, 128, dtype=torch.bfloat16), (ValueError, r"bias: shape \[4, 128\]; expected \[4, 256\]")),
    "a_wrong_rows": ("down_reduce", "a", lambda a: a["a"][:6], (ValueError, r"a: shape \[6, 128\]; expected \[8, 128\]")),
    "topk_weights_bf16": ("down_reduce", "topk_weights", lambda a: a["topk_weights"].bfloat16(), (TypeError, "topk_weights: dtype torch.bfloat16")),
    "inverse_short": ("down_reduce", "inverse", lambda a: a["inverse"][:7], (ValueError, r"inverse: shape \[7\]; expected \[8\]")),
    "intermediate_odd": ("down_reduce", "w", lambda a: torch.randn(4, 128, 96, dtype=torch.bfloat16), (ValueError, "intermediate=96")),
    "w_other_device": ("gate_up", "w", lambda a: a["w"].to("meta"), (ValueError, "w: on meta, the other tensors on cpu")),
    # A contiguous view 4 bytes into its buffer: the kernels declare every pointer 16-byte aligned.
    "gather_misaligned": ("gate_up", "gather", lambda a: torch.cat([a["gather"][:1], a["gather"]])[1:],
                          (ValueError, "gather: its address is 4 bytes past a 16-byte boundary")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DIRECT_CALLS))
def test_direct_calls_reject_what_the_kernels_cannot_read(case):
    """cute_kernels.interface called directly (not through the lowering, which checks the same things
    first): a tensor the kernels would misread gets an error naming it before anything compiles or
    launches; the same call with the good tensor passes the checks (and reaches the GPU-only part)."""
    op, name, bad, (error, message) = BAD_DIRECT_CALLS[case]
    args = _direct_args(op)
    kw = dict(activation="silu", alpha=1.0, limit=7.0, gate_layout="concat") if op == "gate_up" else {}
    call = getattr(interface, op)
    with pytest.raises(error, match=message):
        call(*{**args, name: bad(args)}.values(), **kw)
    # Past every other check, the last one: the kernels need a CUDA device (on a CPU tensor the call
    # used to go on to the launch with host pointers).
    with pytest.raises(ValueError, match=r"the kernels do not serve this call: cpu: the kernels run on CUDA GPUs"):
        call(*args.values(), **kw)
