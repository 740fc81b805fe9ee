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


def compile_triton(kernel, signature: dict, constexprs: dict, capability: int, options: dict):
    """Triton's compile of `kernel` for sm_<capability> through its own ptxas, no GPU needed: the
    runtime arguments' types in signature, the constexprs' values in constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(kernel, signature | {c: "constexpr" for c in constexprs}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
