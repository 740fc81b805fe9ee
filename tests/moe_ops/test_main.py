"""`python -m moe_ops`: bad arguments are argparse errors (exit status 2 with a message naming the
argument) before any layer is built (they were tracebacks: a RuntimeError for --tokens -1, a
StatisticsError for --repeats 0, an AssertionError for --device cuda without CUDA); the demo's verdict
and what it shows of the lowering."""
from __future__ import annotations

import re

import pytest
import torch

from moe_ops.__main__ import main


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tokens", "-1"], r"argument --tokens: got -1; allowed: an int >= 0"),
        (["--tokens", "x"], r"argument --tokens: invalid int value: 'x'"),
        (["--repeats", "0"], r"argument --repeats: got 0; allowed: an int >= 1"),
        (["--device", "nonsense"], r"--device: "),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cuda"])
    assert "--device: cuda asked for, but torch.cuda.is_available() is False" in capsys.readouterr().err


def test_the_demo_passes_on_the_cpu_and_fails_when_its_check_does(monkeypatch, capsys):
    """The demo's verdict is its exit status: 0 with "ok" on the CPU (float32, judged by float32's
    tolerance), 1 with "FAILED" when an error exceeds the tolerance or is NaN. A demo that always
    returned 0, judged float32 by bf16's looser bound, or let a NaN error pass went unnoticed."""
    import moe_ops.__main__ as demo

    asked = []

    real_tolerance = demo.tolerance

    def tolerance(dtype):
        asked.append(dtype)
        return real_tolerance(dtype)

    monkeypatch.setattr(demo, "tolerance", tolerance)
    assert main(["--device", "cpu", "--tokens", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert asked == [torch.float32] and out.rstrip().endswith(": ok")
    # The compiled rows ran the lowering's fused ops, and the demo says so: one MoE layer fused, on the
    # CPU by the reference (on a Hopper GPU the same row names the CuTe DSL kernels).
    fused_rows = [line for line in out.splitlines() if line.startswith("| 0 | gate_up + down_reduce | act=silu;")]
    assert len(fused_rows) == 1 and "gate_up: reference (cpu" in fused_rows[0], out
    assert "compiled graphs: 1 for 1 token counts" in out
    monkeypatch.setattr(demo, "tolerance", lambda dtype: 0.0)
    assert main(["--device", "cpu", "--tokens", "3", "--repeats", "1"]) == 1
    assert capsys.readouterr().out.rstrip().endswith(": FAILED")
    monkeypatch.setattr(demo, "tolerance", real_tolerance)
    monkeypatch.setattr(demo, "relative_error", lambda out, ref: float("nan"))
    assert main(["--device", "cpu", "--tokens", "3", "--repeats", "1"]) == 1


@pytest.mark.gpu
def test_the_demo_on_a_gpu_replays_the_compiled_layer_in_a_cuda_graph(capsys):
    """On CUDA each token count > 0 gets a third row, the compiled layer captured in a CUDA graph and
    replayed: within bf16's tolerance and with the compiled row's errors (the graph replays the same
    kernels on the same input); no graph row for 0 tokens, which launch nothing."""
    assert main(["--tokens", "0", "1", "37", "--repeats", "2"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1].isdigit():
            rows[(cells[0], int(cells[1]))] = cells[4:6]
    for m in (1, 37):
        assert rows[("compiled + CUDA graph", m)] == rows[("compiled", m)], rows
    assert ("compiled", 0) in rows and ("compiled + CUDA graph", 0) not in rows
