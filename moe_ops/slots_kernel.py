"""expert_slots.py on CUDA: one Triton program packs the experts with rows into slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_ints import next_power_of_2
from .plan_kernel import compile_options, on_device


@triton.jit
def _slots_kernel(offsets_ptr, idx_ptr, slot_offsets_ptr, num_experts, slots, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    inside = e < num_experts
    start = tl.load(offsets_ptr + e, mask=inside, other=0)
    used = (tl.load(offsets_ptr + e + 1, mask=inside, other=0) > start).to(tl.int32)  # 0 past E
    slot = tl.cumsum(used, 0) - 1
    tl.store(idx_ptr + slot, e, mask=used > 0)
    tl.store(slot_offsets_ptr + slot, start.to(tl.int32), mask=used > 0)
    # The slots past the used ones (and the closing offset) hold no rows: they start and end at offsets[E].
    s = tl.arange(0, BLOCK_S)
    spare = s >= tl.sum(used, 0)
    end = tl.load(offsets_ptr + num_experts).to(tl.int32)
    tl.store(slot_offsets_ptr + s, tl.zeros([BLOCK_S], tl.int32) + end, mask=spare & (s <= slots))
    tl.store(idx_ptr + s, tl.zeros([BLOCK_S], tl.int32), mask=spare & (s < slots))


def expert_slots_cuda(expert_offsets: torch.Tensor, num_experts: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_slots.expert_slots on a CUDA (or, interpreted, CPU) tensor: one launch."""
    idx = torch.empty(slots, dtype=torch.int32, device=expert_offsets.device)
    slot_offsets = torch.empty(slots + 1, dtype=torch.int32, device=expert_offsets.device)
    with on_device(expert_offsets.device):
        _slots_kernel[(1,)](
            expert_offsets, idx, slot_offsets, num_experts, slots,
            BLOCK_E=next_power_of_2(max(num_experts, 2)), BLOCK_S=next_power_of_2(slots + 1),
            **compile_options(False),
        )  # fmt: skip
    return idx, slot_offsets
