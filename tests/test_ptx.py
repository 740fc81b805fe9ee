"""tests/ptx.py's global_accesses, the fact behind every "nothing global before griddepcontrol.wait"
check: the forms of PTX that may touch global memory are found, and what does not is left alone."""
from __future__ import annotations

import pytest

from tests.ptx import global_accesses, split_at_wait

ACCESSES = [
    "ld.global.nc.v4.u32 %r1, [%rd1];",
    "ld.volatile.global.u32 %r1, [%rd1];",
    "ld.relaxed.gpu.global.b32 %r2, [%rd3];",
    "@%p1 st.release.gpu.global.b32 [%rd4], %r5;",
    "atom.relaxed.gpu.global.add.u32 %r1, [%rd1], 1;",
    "red.relaxed.gpu.global.add.u32 [%rd1], 1;",
    "atom.add.u32 %r1, [%rd1], 1;",  # generic addressing
    "ld.b32 %r1, [%rd1];",
    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%rd1], [%r1], 16;",
    "cp.async.cg.shared.global [%r1], [%rd1], 16, %r2;",
    "@!%p2 cp.async.bulk.tensor.3d.shared::cta.global.tile [%r1], [%rd1, {%r2, %r3, %r4}], [%r5];",
]
NOT_ACCESSES = [
    "ld.param.b64 %rd1, [param_0];",
    "ld.shared.b32 %r1, [%r2];",
    "st.shared::cluster.b32 [%r1], %r2;",
    "ld.local.u32 %r1, [%rd1];",
    "ld.const.u32 %r1, [c];",
    "cvta.to.global.u64 %rd2, %rd1;",
    "prefetch.tensormap [%rd1];",
    "mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;",
    "$L__BB0_1:",
    ".reg .b32 %r<5>;",
    "// ld.global.b32 in a comment",
]


@pytest.mark.parametrize("line", ACCESSES)
def test_global_access_found(line):
    assert global_accesses(line) == [line.split()[1 if line.startswith("@") else 0].rstrip(";")]


@pytest.mark.parametrize("line", NOT_ACCESSES)
def test_not_a_global_access(line):
    assert global_accesses(line) == []


def test_split_at_wait():
    ptx = ".visible .entry k(\n)\n{\nld.param.b64 %rd1, [p];\ngriddepcontrol.wait;\nld.global.b32 %r1, [%rd1];\n}"
    before, after = split_at_wait(ptx)
    assert global_accesses(before) == [] and global_accesses(after) == ["ld.global.b32"]
