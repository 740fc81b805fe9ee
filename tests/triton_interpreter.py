"""Running a Triton kernel in Triton's interpreter on the CPU: TRITON_INTERPRET=1 is read when
triton.jit decorates, so the kernel's module must be imported fresh, in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


# Triton's interpreter before 3.8 (the README) turns a loop bound into an int through a one-element
# numpy array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
# scalars"; Triton 3.6 with NumPy 2.4.6 here, and every case on the GPU host's Triton 3.6, where the
# GPU tests run the compiled kernel instead). The test extra asks for 3.8.
needs_interpreter = pytest.mark.skipif(
    _triton_version() < (3, 8), reason="Triton's interpreter before 3.8 fails on NumPy 2.4 (tests/triton_interpreter.py)"
)


def run_interpreted(script: str, *args, timeout: int = 300) -> str:
    """stdout of `python -c script *args` with the interpreter on and the project importable; fails the
    test with the subprocess's output when it exits non-zero."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
