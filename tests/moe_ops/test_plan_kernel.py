"""The routing plan's Triton kernel (moe_ops/plan_kernel.py) against the reference, bit for bit.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when triton.jit decorates, so
in a fresh subprocess); on the GPU it runs compiled, through the op's CUDA registration.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from moe_ops.plan import routing_plan
from tests.ptx import compile_triton, split_at_wait, touches_global
from tests.triton_interpreter import needs_interpreter, run_interpreted

# (M, k, E, expert_map, launch): each kernel with one program or chunk, with many programs and a partial
# last block, with scan steps holding several blocks (a block in the middle of one), with several
# chunks (a key's pairs numbered across them), an expert map with remote and out-of-range ids (in the
# blocks kernel the dropped pairs' key E is one past its bins at E = 16 and 256, one of them at E = 17), skewed
# routing, and no tokens at all. launch: None (launch_config's choice), "keys:CHUNK" or
# "blocks:BLOCK:SCAN".
INTERPRETER_CASES = [
    (1, 8, 128, False, None),
    (37, 3, 8, True, None),
    (150, 4, 16, False, "blocks:128:256"),
    (150, 4, 16, False, "keys:64"),
    (90, 8, 256, True, "blocks:64:512"),
    (150, 4, 16, True, "blocks:32:128"),
    (64, 4, 17, True, "blocks:32:64"),
    (90, 8, 256, True, "keys:128"),
    (200, 2, 8, "skewed", "blocks:64:64"),
    (200, 2, 8, "skewed", "keys:32"),
    (0, 2, 8, False, None),
    (0, 2, 8, False, "blocks:128:128"),
    # int64 ids, and map entries, beyond int32 whose low words name experts: dropped, not wrapped.
    (40, 4, 16, "wide", "keys:32"),
    (40, 4, 16, "wide", "blocks:32:64"),
    (40, 4, 16, "wide_map", "keys:32"),
    (40, 4, 16, "wide_map", "blocks:32:64"),
    # ids exactly one past the experts (E, or the map's length) and negative: dropped. Random draws
    # rarely hit the edge itself, and an off-by-one there (ids <= E counted in range) went unnoticed.
    (40, 4, 16, "edges", "keys:32"),
    (40, 4, 16, "edges", "blocks:32:64"),
    (40, 4, 16, "edges_map", "keys:32"),
    (40, 4, 16, "edges_map", "blocks:32:64"),
    # topk_ids as a transposed view (the op passes the caller's tensor on as it is): read by index, not
    # as if its storage were row-major.
    (50, 4, 16, "strided", "keys:64"),
    (50, 4, 16, "strided", "blocks:32:64"),
]



def plan_launch(spec: str | None, num_warps: int = 4):
    """The PlanLaunch written as "keys:CHUNK" or "blocks:BLOCK:SCAN"; None (or "None") for launch_config's."""
    from moe_ops.plan_kernel import PlanLaunch

    if spec in (None, "None"):
        return None
    method, *sizes = spec.split(":")
    fields = {"keys": ("chunk",), "blocks": ("block", "scan")}[method]
    return PlanLaunch(method, num_warps, **{name: int(v) for name, v in zip(fields, sizes)})


_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from moe_ops.plan import local_expert_ids, routing_plan
    from moe_ops.plan_kernel import routing_plan_triton
    from tests.moe_ops.test_plan_kernel import plan_launch
    seed, m, k, e, kind, launch = sys.argv[1:]
    torch.manual_seed(int(seed))
    m, k, e = int(m), int(k), int(e)
    launch = plan_launch(launch)
    emap = None
    if kind == "True":
        # Remote experts (-1) in the map, and ids beyond it (dropped as out of range).
        emap = torch.randint(-1, e, (e + 4,), dtype=torch.int32)
        ids = torch.randint(-2, e + 7, (m, k), dtype=torch.int64)
    elif kind == "skewed":
        ids = torch.where(torch.rand(m, k) < 0.9, 3, torch.randint(0, e, (m, k))).to(torch.int32)
    elif kind.startswith("wide"):
        ids = torch.randint(0, e, (m, k), dtype=torch.int64)
        shift = (torch.randint(0, 2, (m, k)) * 2 - 1) * 2**32
        ids = torch.where(torch.rand(m, k) < 0.3, ids + shift, ids)
        if kind == "wide_map":
            emap = torch.randint(-1, e, (e,), dtype=torch.int64)
            emap = torch.where(torch.rand(e) < 0.3, emap + 2**32, emap)
    elif kind.startswith("edges"):
        # Every pair's id on an edge: -1, E (one past the experts) or, with a map, its length and one
        # below it; the rest valid.
        ids = torch.randint(0, e, (m, k), dtype=torch.int32)
        edges = torch.tensor([-1, e] if kind == "edges" else [-1, e + 4, e + 3], dtype=torch.int32)
        pick = torch.rand(m, k) < 0.4
        ids = torch.where(pick, edges[torch.randint(0, len(edges), (m, k))], ids)
        if kind == "edges_map":
            emap = torch.randint(-1, e, (e + 4,), dtype=torch.int32)
            emap[e + 3] = 2  # the map's last entry is a local expert: ids equal to it count
        assert (ids == edges[1]).any() and (ids == -1).any()
    elif kind == "strided":
        ids = torch.randint(0, e, (k, m), dtype=torch.int32).t()
        assert not ids.is_contiguous()
    else:
        ids = torch.randint(0, e, (m, k), dtype=torch.int32)
    if kind.startswith("wide"):
        assert local_expert_ids(ids, e, emap).lt(e).sum() < ids.numel(), "no wide id or entry was drawn"
    want = routing_plan(ids, e, emap)
    # Every buffer the kernel path allocates gets a tail of sentinels past its end: a write beyond
    # its size (a scratch area too small for the programs) shows there instead of in freed memory.
    empty, guards = torch.empty, []
    def guarded_empty(*size, **kw):
        n = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel()
        buf = empty(n + 256, **kw)
        buf[n:] = -7
        guards.append((buf, n))
        return buf[:n].view(*size)
    torch.empty = guarded_empty
    try:
        got = routing_plan_triton(ids, e, emap, launch)
    finally:
        torch.empty = empty
    for buf, n in guards:
        assert buf[n:].eq(-7).all(), ("write past an allocation", n, buf[n:].tolist())
    for name, a, b in zip(("expert_offsets", "gather_idx", "inverse"), want, got):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())
    print("same", [t.numel() for t in got])
    """
)


@needs_interpreter
@pytest.mark.parametrize("m,k,e,kind,launch", INTERPRETER_CASES)
def test_triton_plan_matches_reference_in_interpreter(m, k, e, kind, launch, rng):
    out = run_interpreted(_SCRIPT, rng.initial_seed(), m, k, e, kind, launch)
    assert out.startswith("same"), out


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,e", [(1, 8, 128), (16, 2, 8), (1024, 8, 256), (8192, 8, 256), (16384, 8, 128), (3000, 4, 1)])
@pytest.mark.parametrize("with_map", [False, True])
def test_cuda_plan_is_one_launch_and_matches_reference(m, k, e, with_map):
    """The op on CUDA (the Triton kernel) equals the CPU reference and launches exactly one kernel."""
    ids = torch.randint(0, e + (2 if with_map else 0), (m, k), dtype=torch.int32)
    ids[: m // 2] = torch.where(torch.rand(m // 2, k) < 0.9, 0, ids[: m // 2])  # skew half the tokens
    emap = torch.randint(-1, e, (e + 2,), dtype=torch.int32) if with_map else None
    want = routing_plan(ids, e, emap)
    cuda_ids, cuda_map = ids.cuda(), (emap.cuda() if emap is not None else None)
    routing_plan(cuda_ids, e, cuda_map)  # compile the kernel outside the profiled call
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = routing_plan(cuda_ids, e, cuda_map)
        torch.cuda.synchronize()
    kernels = [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,e", [(1, 8, 256), (300, 8, 128), (2048, 8, 256)])
@pytest.mark.parametrize("launch", ["keys:16", "keys:4096", "blocks:256:1024", "blocks:2048:16384"])
def test_cuda_plan_both_kernels_match_reference(m, k, e, launch):
    """Either kernel, forced with chunks and blocks far from launch_config's choice, equals the reference."""
    from moe_ops.plan_kernel import routing_plan_triton

    ids = torch.randint(0, e, (m, k), dtype=torch.int32)
    want = routing_plan(ids, e, None)
    got = routing_plan_triton(ids.cuda(), e, None, plan_launch(launch, num_warps=4 if launch.startswith("keys") else 8))
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,e", [(1, 8, 128), (1024, 8, 256), (3000, 4, 16)])
@pytest.mark.parametrize("with_map", [False, True])
def test_cuda_plan_drops_int64_ids_beyond_int32(m, k, e, with_map, rng):
    """int64 ids (and map entries) whose low words name experts are dropped, as the reference drops them."""
    ids = torch.randint(0, e, (m, k), dtype=torch.int64, generator=rng)
    shift = (torch.randint(0, 2, (m, k), generator=rng) * 2 - 1) * 2**32
    ids = torch.where(torch.rand(m, k, generator=rng) < 0.3, ids + shift, ids)
    emap = None
    if with_map:
        emap = torch.randint(-1, e, (e,), dtype=torch.int64, generator=rng)
        emap = torch.where(torch.rand(e, generator=rng) < 0.3, emap + 2**32, emap)
    want = routing_plan(ids, e, emap)
    got = routing_plan(ids.cuda(), e, emap.cuda() if emap is not None else None)
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())


def test_launch_config_switches_kernel_at_keys_max_pairs():
    from moe_ops.plan_kernel import KEYS_MAX_PAIRS, launch_config

    for e in (8, 128, 256):
        assert launch_config(1, e).method == "keys"
        assert launch_config(KEYS_MAX_PAIRS, e).method == "keys"
        assert launch_config(KEYS_MAX_PAIRS + 1, e).method == "blocks"


def test_launch_config_by_keys_scans_the_whole_plan_in_one_chunk():
    # The keys kernel's timings assume one chunk per scan: its chunk holds all P pairs, no more than twice that.
    from moe_ops.plan_kernel import KEYS_MAX_PAIRS, launch_config

    for p in (1, 15, 16, 17, 100, 512, 513, 1024, 3000, KEYS_MAX_PAIRS):
        launch = launch_config(p, 128)
        assert launch.method == "keys"
        assert p <= launch.chunk <= max(16, 2 * p), (p, launch)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="sort", num_warps=4, chunk=64), "method must be one of"),
        (dict(method="keys", num_warps=4), "chunk must be a power of two"),
        (dict(method="keys", num_warps=3, chunk=64), "num_warps must be a power of two"),
        (dict(method="blocks", num_warps=4, block=512, scan=256), r"scan \(256\) must be at least block \(512\)"),
    ],
)
def test_plan_launch_rejects_bad_settings(kwargs, match):
    from moe_ops.plan_kernel import PlanLaunch

    with pytest.raises(ValueError, match=match):
        PlanLaunch(**kwargs)


# Each kernel's signature for compiling it without a GPU (Triton's own ptxas, target sm_90).
_SIGNATURES = {
    "_routing_plan_by_keys_kernel": ({"CHUNK": 64}, ()),
    "_routing_plan_by_blocks_kernel": ({"BLOCK": 128, "BINS": 16, "SCAN": 256}, ("scratch_ptr",)),
}


def _compile_without_gpu(name: str, capability: int, grid_dependency: bool):
    """Triton's compile of one plan kernel for sm_<capability> (through its own ptxas), with or without
    PDL and the early launch, as routing_plan_triton launches it."""
    from moe_ops import plan_kernel

    sizes, extra_ptrs = _SIGNATURES[name]
    ptrs = ("ids_ptr", "map_ptr", "offsets_ptr", "gather_ptr", "inverse_ptr", *extra_ptrs)
    signature = {p: "*i32" for p in ptrs} | {s: "i32" for s in ("num_pairs", "k", "num_experts", "num_global")}
    constants = {"HAS_MAP": True, "EARLY_LAUNCH": grid_dependency, "PDL": grid_dependency, **sizes}
    return compile_triton(getattr(plan_kernel, name), signature, constants, capability, plan_kernel.compile_options(grid_dependency))


@pytest.mark.parametrize("name", sorted(_SIGNATURES))
def test_cuda_plan_waits_for_the_kernel_before_it(name):
    """Launched as a programmatic dependent (launch_pdl), each kernel must not read topk_ids (or touch
    any global memory) before griddepcontrol.wait: the kernel before it may still be writing them."""
    compiled = _compile_without_gpu(name, 90, grid_dependency=True)
    assert compiled.metadata.launch_pdl
    before, after = split_at_wait(compiled.asm["ptx"])
    assert not touches_global(before), "a global access before griddepcontrol.wait"
    assert touches_global(after)


@pytest.mark.parametrize(
    "device,capability,expected",
    [("cuda:0", (8, 0), False), ("cuda:0", (8, 9), False), ("cuda:0", (9, 0), True), ("cuda:0", (10, 0), True),
     ("cpu", (9, 0), False)],
)  # fmt: skip
def test_grid_dependency_only_from_sm90(monkeypatch, device, capability, expected):
    """PDL and the early launch of the GEMM emit griddepcontrol, which ptxas rejects below sm_90: A100,
    L4 and RTX 4090 must run the plan in plain stream order."""
    from moe_ops import plan_kernel

    monkeypatch.setattr(plan_kernel.devices, "_capability", lambda index: capability)
    assert plan_kernel.uses_grid_dependency(torch.device(device)) is expected


@pytest.mark.parametrize("name", sorted(_SIGNATURES))
def test_cuda_plan_builds_for_sm80_without_grid_dependency(name):
    """What an sm_80 GPU runs (uses_grid_dependency False): each kernel goes through ptxas for sm_80 and
    holds no griddepcontrol instruction."""
    compiled = _compile_without_gpu(name, 80, grid_dependency=False)
    assert compiled.asm["cubin"]
    assert "griddepcontrol" not in compiled.asm["ptx"]
