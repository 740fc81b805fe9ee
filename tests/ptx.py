"""PTX facts shared by the kernel tests (CuTe DSL and Triton kernels alike)."""
from __future__ import annotations

# Instructions that touch global memory.
GLOBAL_OPS = ("ld.global", "st.global", "cp.async", "atom.global", "red.global")


def split_at_wait(ptx: str) -> tuple[str, str]:
    """The kernel body before and after its first griddepcontrol.wait. A kernel launched as a
    programmatic dependent (PDL) sees the previous kernel's writes only after that wait."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, "no griddepcontrol.wait"
    return body[:wait], body[wait:]


def touches_global(text: str) -> bool:
    return any(op in text for op in GLOBAL_OPS)
