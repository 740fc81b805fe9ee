"""moe_ops/launch_ints.py: the host's cdiv and next_power_of_2 give Triton's results."""
from __future__ import annotations

import triton

from moe_ops.launch_ints import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    for n in [*range(0, 4200), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for a in range(0, 600):
        for b in (1, 2, 3, 7, 16, 64, 128, 511):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_kernel_launch_code_uses_the_host_helpers():
    """Each launch path calls these, not triton's constexpr_functions (2.7 µs a call on the host)."""
    import inspect

    from moe_ops import decode_kernel, plan_kernel, route_kernel, router_kernel, slots_kernel
    from moe_ops.quant import quantize_kernel

    for module in (decode_kernel, plan_kernel, route_kernel, router_kernel, slots_kernel, quantize_kernel):
        source = inspect.getsource(module)
        assert "triton.cdiv(" not in source and "triton.next_power_of_2(" not in source, module.__name__
