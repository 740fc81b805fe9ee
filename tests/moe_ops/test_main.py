"""`python -m moe_ops`'s arguments: bad ones are argparse errors (exit status 2 with a message naming
the argument) before any layer is built. They were tracebacks: a RuntimeError for --tokens -1, a
StatisticsError for --repeats 0, an AssertionError for --device cuda without CUDA."""
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
