"""Integer arithmetic for the Triton kernels' launches, on the host.

triton.cdiv and triton.next_power_of_2 are constexpr_functions in recent Triton: about 2.7 µs a call on
the host (Triton 3.8 on the CPU machine), paid several times per eager layer call (route, plan, router,
quantize). These are plain Python with the same results.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for n = 0, as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
