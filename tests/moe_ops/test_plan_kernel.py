"""The routing plan's Triton kernel (moe_ops/plan_kernel.py) against the reference, bit for bit.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when triton.jit decorates, so
in a fresh subprocess); on the GPU it runs compiled, through the op's CUDA registration.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_ops.plan import routing_plan

# (M, k, E, expert_map, block, scan): one program, many programs with a partial last block, scan
# steps holding several blocks (a block in the middle of one), an expert map with remote and
# out-of-range ids, skewed routing, and no tokens at all.
INTERPRETER_CASES = [
    (1, 8, 128, False, None, None),
    (37, 3, 8, True, None, None),
    (150, 4, 16, False, 128, 256),
    (90, 8, 256, True, 64, 512),
    (200, 2, 8, "skewed", 64, None),
    (0, 2, 8, False, None, None),
]

_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from moe_ops.plan import routing_plan
    from moe_ops.plan_kernel import routing_plan_triton
    seed, m, k, e, kind, block, scan = sys.argv[1:]
    torch.manual_seed(int(seed))
    m, k, e = int(m), int(k), int(e)
    block, scan = [int(v) if v != "None" else None for v in (block, scan)]
    emap = None
    if kind == "True":
        # Remote experts (-1) in the map, and ids beyond it (dropped as out of range).
        emap = torch.randint(-1, e, (e + 4,), dtype=torch.int32)
        ids = torch.randint(-2, e + 7, (m, k), dtype=torch.int64)
    elif kind == "skewed":
        ids = torch.where(torch.rand(m, k) < 0.9, 3, torch.randint(0, e, (m, k))).to(torch.int32)
    else:
        ids = torch.randint(0, e, (m, k), dtype=torch.int32)
    want = routing_plan(ids, e, emap)
    got = routing_plan_triton(ids, e, emap, block=block, scan=scan)
    for name, a, b in zip(("expert_offsets", "gather_idx", "inverse"), want, got):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())
    print("same", [t.numel() for t in got])
    """
)


@pytest.mark.parametrize("m,k,e,kind,block,scan", INTERPRETER_CASES)
def test_triton_plan_matches_reference_in_interpreter(m, k, e, kind, block, scan, rng):
    seed = rng.initial_seed()
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(seed), str(m), str(k), str(e), str(kind), str(block), str(scan)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("same"), proc.stdout


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
