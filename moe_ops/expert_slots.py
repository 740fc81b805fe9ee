"""The experts a call's grouped rows use, packed into slots: what dequant_kernels.py decodes.

expert_slots(expert_offsets [>= E+1], E, slots) -> (idx int32 [slots], slot_offsets int32 [slots + 1]):
slot j < A (A = the experts with rows) holds the j-th such expert in expert order, idx[j], with its rows
slot_offsets[j] .. slot_offsets[j + 1]; slots from A on hold no rows (idx 0, offsets at offsets[E]), nor
do the rows from offsets[E] on (dropped pairs). With slots = min(rows, E) every expert with rows has a
slot (a row belongs to one expert), so a grouped GEMM over the slots' weights and offsets reads the same
rows with the same weights as over all E experts, and decoding only the A slots with rows reads each
used expert once: at M = 1 the token's k experts, at M = 16 of gpt-oss ~40% of 128 (k = 4), not the 64
rows' worth a weight per row would decode, nor all 128.

On CUDA one Triton program computes both (slots_kernel.py: a cumulative sum over the experts' flags);
elsewhere torch does. No host sync: slots is a shape, the rest stays on the device.
"""
from __future__ import annotations

import torch

def _expert_slots_torch(expert_offsets: torch.Tensor, num_experts: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = expert_offsets[: num_experts + 1].to(torch.int32)
    active = offsets[1:] > offsets[:-1]
    slot = torch.cumsum(active, 0) - 1
    # Experts without rows scatter to a spare entry past the slots (dropped after).
    target = torch.where(active, slot, slots + 1)
    experts = torch.arange(num_experts, dtype=torch.int32, device=offsets.device)
    idx = torch.zeros(slots + 2, dtype=torch.int32, device=offsets.device).scatter_(0, target, experts)[:slots]
    starts = offsets[num_experts:].repeat(slots + 2).scatter_(0, target, offsets[:-1])[: slots + 1]
    return idx, starts


def expert_slots(expert_offsets: torch.Tensor, num_experts: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int32 [slots], slot_offsets int32 [slots + 1]) as the module docstring says. expert_offsets:
    the routing plan's [E + 1] (or longer) int offsets; slots: at least the number of experts with rows
    (min(rows, E) always is)."""
    if not 0 <= slots <= num_experts:
        raise ValueError(f"slots: expected 0 <= slots <= num_experts={num_experts}, got {slots}")
    if expert_offsets.dim() != 1 or expert_offsets.shape[0] < num_experts + 1:
        raise ValueError(f"expert_offsets: expected [>= {num_experts + 1}], got {list(expert_offsets.shape)}")
    if expert_offsets.device.type != "cuda":
        return _expert_slots_torch(expert_offsets, num_experts, slots)
    from .slots_kernel import expert_slots_cuda  # Triton: imported where it runs

    return expert_slots_cuda(expert_offsets, num_experts, slots)
