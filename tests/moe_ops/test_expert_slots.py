"""moe_ops/expert_slots.py: the experts with rows packed into slots, by torch (any device) and by the
Triton program (CUDA; on the CPU in Triton's interpreter), which must agree entry for entry."""
from __future__ import annotations

import pytest
import torch

from moe_ops.expert_slots import expert_slots
from tests.triton_interpreter import needs_interpreter, run_interpreted


def _offsets(counts, dropped=0):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32), sum(counts) + dropped


def test_slots_hold_the_used_experts_in_order():
    offsets, rows = _offsets([0, 2, 0, 1, 0, 3], dropped=2)  # 6 routed rows and 2 dropped pairs
    idx, slot_offsets = expert_slots(offsets, 6, min(rows, 6))
    assert idx.dtype == slot_offsets.dtype == torch.int32
    assert idx.tolist() == [1, 3, 5, 0, 0, 0]
    assert slot_offsets.tolist() == [0, 2, 3, 6, 6, 6, 6]  # the dropped rows 6 and 7 are in no slot


def test_no_rows_and_every_expert_used():
    assert [t.tolist() for t in expert_slots(torch.zeros(5, dtype=torch.int32), 4, 0)] == [[], [0]]
    offsets, rows = _offsets([1, 1, 1])
    assert [t.tolist() for t in expert_slots(offsets.long(), 3, 3)] == [[0, 1, 2], [0, 1, 2, 3]]


def test_bad_slots_or_offsets_raise():
    offsets, _ = _offsets([1, 1, 1])
    with pytest.raises(ValueError, match=r"slots: expected 0 <= slots <= num_experts=3, got 4"):
        expert_slots(offsets, 3, 4)
    with pytest.raises(ValueError, match=r"expert_offsets: expected \[>= 4\], got \[3\]"):
        expert_slots(offsets[:3], 3, 2)


_SCRIPT = r"""
import sys, torch
from moe_ops.expert_slots import _expert_slots_torch
from moe_ops.slots_kernel import expert_slots_cuda
device = sys.argv[1]
g = torch.Generator().manual_seed(int(sys.argv[2]))
bad = 0
for num_experts, rows, used in ((8, 3, 0.3), (128, 16, 0.1), (128, 1000, 0.9), (256, 8, 0.03), (5, 0, 0.0), (5, 40, 1.0), (1000, 64, 0.05)):
    counts = (torch.rand(num_experts, generator=g) < used).int() * torch.randint(1, 9, (num_experts,), generator=g)
    routed = int(counts.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int(), torch.full((1,), routed + 5, dtype=torch.int32)])
    slots = min(max(rows, routed), num_experts)
    want = _expert_slots_torch(offsets, num_experts, slots)
    got = expert_slots_cuda(offsets.to(device), num_experts, slots)
    for w, t in zip(want, got):
        if not torch.equal(w, t.cpu()):
            bad += 1
            print("differs:", num_experts, rows, w.tolist()[:20], t.tolist()[:20])
print("bad", bad)
"""


@needs_interpreter
def test_the_triton_program_matches_torch_in_the_interpreter():
    out = run_interpreted(_SCRIPT, "cpu", torch.initial_seed() % 2**31)
    assert out.strip().endswith("bad 0"), out


@pytest.mark.gpu
def test_the_triton_program_matches_torch_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import os
    import subprocess
    import sys

    from tests.triton_interpreter import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "cuda", str(torch.initial_seed() % 2**31)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("bad 0"), proc.stdout + proc.stderr
