"""PTX facts shared by the kernel tests (CuTe DSL and Triton kernels alike)."""
from __future__ import annotations

import re

# Memory instructions whose state space says where they go (ld.volatile.global, atom.relaxed.gpu.global,
# ...); without one they address generically, which may be global memory.
_SPACED = {"ld", "ldu", "st", "atom", "red", "multimem"}
_SPACES = {"global", "shared", "local", "param", "const"}
_PREDICATE = re.compile(r"^@!?%\w+\s+")


def split_at_wait(ptx: str) -> tuple[str, str]:
    """The kernel body before and after its first griddepcontrol.wait. A kernel launched as a
    programmatic dependent (PDL) sees the previous kernel's writes only after that wait."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, "no griddepcontrol.wait"
    return body[:wait], body[wait:]


def global_accesses(text: str) -> list[str]:
    """The instructions in PTX text that may touch global memory: ld/st/atom/red/multimem in the global
    state space or in none (generic addressing), and every cp.* (cp.async in all its forms, TMA, bulk
    reductions, L2 prefetches by TMA). Address arithmetic (cvta), tensormap prefetches and other state
    spaces are not accesses."""
    found = []
    for line in text.splitlines():
        mnemonic = _PREDICATE.sub("", line.strip()).split(None, 1)[0].rstrip(";") if line.strip() else ""
        parts = mnemonic.split(".")
        if parts[0] == "cp" or (parts[0] in _SPACED and not {p.split("::")[0] for p in parts[1:]} & (_SPACES - {"global"})):
            found.append(mnemonic)
    return found


def touches_global(text: str) -> bool:
    return bool(global_accesses(text))


def compile_triton(kernel, signature: dict, constexprs: dict, capability: int, options: dict):
    """Triton's compile of `kernel` for sm_<capability> through its own ptxas, no GPU needed: the
    runtime arguments' types in signature, the constexprs' values in constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(kernel, signature | {c: "constexpr" for c in constexprs}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
