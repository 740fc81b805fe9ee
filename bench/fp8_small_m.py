"""python bench/fp8_small_m.py SHAPE ...: GEMM1 (gate_up) and GEMM2 + token sum (down_reduce) alone at
M = 1, 4, 16, 128, bf16 against e4m3 operands with per-row scales, each in the tiles its rule picks,
replayed in turn as CUDA graphs (moe_ops.bench.alternating_times_us). Prints µs and the rate at which
the active experts' weights stream (bytes / time: bf16's are twice fp8's). bench/NOTES.md v51."""
import sys

import torch

from cute_kernels import interface
from moe_ops.bench import SHAPES, alternating_times_us, expert_weights, layer_inputs, active_experts
from moe_ops.plan import routing_plan
sys.path.insert(0, "bench")
from tile_sweep import _codes

sms = interface.num_sms(0)
print(torch.cuda.get_device_name())
for name in sys.argv[1:]:
    e, k, h, i = SHAPES[name]
    w13, w2 = expert_weights(name)
    c13, c2 = _codes(w13), _codes(w2)
    s13, s2 = torch.rand(e, 2 * i, device="cuda") * 1e-3, torch.rand(e, h, device="cuda") * 1e-3
    for m in (1, 4, 16, 128):
        x, tw, ids = layer_inputs(name, m)
        act = active_experts(ids)
        offsets, gather, inverse = routing_plan(ids, e, None)
        inter = torch.empty(m * k, i, device="cuda", dtype=torch.bfloat16)
        xq, aq = _codes(x), _codes(torch.randn(m * k, i, device="cuda"))
        as1, as2 = torch.rand(m, 1, device="cuda") * 1e-2, torch.rand(m * k, 1, device="cuda") * 1e-2
        fns = {
            "bf16 g1": lambda: interface.gate_up(x, w13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0, gate_layout="concat", out=inter),
            "fp8 g1": lambda: interface.gate_up(xq, c13, None, offsets, gather, activation="silu", alpha=1.702, limit=7.0, gate_layout="concat", out=inter, a_scale=as1, w_scale=s13, out_dtype=torch.bfloat16),
            "bf16 g2": lambda: interface.down_reduce(inter, w2, None, offsets, tw, inverse),
            "fp8 g2": lambda: interface.down_reduce(aq, c2, None, offsets, tw, inverse, a_scale=as2, w_scale=s2, out_dtype=torch.bfloat16),
        }
        t = alternating_times_us(fns)
        b1 = act * 2 * i * h * 2 / 1e6
        b2 = act * i * h * 2 / 1e6
        r1 = interface.choose_tiles("concat", i, m, k, e, sms, k_dim=h), interface.choose_fp8_tiles("concat", i, m, k, e, sms, k_dim=h)
        r2 = interface.choose_tiles("none", h, m, k, e, sms, k_dim=i), interface.choose_fp8_tiles("none", h, m, k, e, sms, k_dim=i)
        print(f"{name} M={m} act={act}: g1 bf16 {t['bf16 g1']:.1f} ({b1/t['bf16 g1']:.2f} TB/s) fp8 {t['fp8 g1']:.1f} ({b1/2/t['fp8 g1']:.2f}) tiles {r1}; "
              f"g2 bf16 {t['bf16 g2']:.1f} ({b2/t['bf16 g2']:.2f}) fp8 {t['fp8 g2']:.1f} ({b2/2/t['fp8 g2']:.2f}) tiles {r2}", flush=True)
    del w13, w2, c13, c2
    torch.cuda.empty_cache()
