"""Compiling CuTe DSL kernels once, with an in-memory and an on-disk cache.

A kernel variant is named by a key (the kernel, its recipe and tile configuration). The first use
compiles it (for sm_90a; `CUTE_DSL_ARCH` is set to sm_90a when unset, so compiling works without a
GPU) and exports it as an object file under the cache directory; later processes load that file in
milliseconds instead of compiling. The disk key also hashes this package's sources and the DSL version,
so editing a kernel invalidates its cached binaries. Launches never compile: callers compile on first
use, which happens in eager warm-up before any CUDA-graph capture.

Kernels are compiled with TVM-FFI calling (apache-tvm-ffi): the compiled function takes plain ints
for pointers, scalars and the stream, and converts them in C (about 4 µs per call on the GPU host).
The DSL's own calling convention wraps each argument in a Python object first (make_ptr, Int32,
CUstream): with it an eager gate_up cost 104-117 µs of host time, 28-37 µs now (bench/NOTES.md v38).

Cache directory: $MOE_OPS_CUTE_CACHE, else ~/.cache/moe_ops/cute.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

try:
    import tvm_ffi  # noqa: F401  (the DSL imports it only when compiling; fail here with the fix)
except ImportError as e:
    raise ImportError(f"cute_kernels launches its kernels through TVM-FFI: pip install 'apache-tvm-ffi==0.1.15.post2' (the [cute] extra) ({e})") from e
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute import AddressSpace  # noqa: E402
from cutlass.cute.runtime import load_module, make_fake_stream, make_ptr  # noqa: E402

ARCH = "sm_90a"
# The target is given per compile: the DSL reads CUTE_DSL_ARCH only when it is first imported, which
# may happen before this module (its default target is sm_100a).
OPTIONS = f"--gpu-arch {ARCH} --enable-tvm-ffi"
_SOURCES = sorted(Path(__file__).parent.glob("*.py"))
_memory: dict[str, object] = {}
_lock = threading.Lock()
# Seconds spent per key, for benchmarks and the compile-time report: (how, seconds).
timings: dict[str, tuple[str, float]] = {}


def cache_dir() -> Path:
    """Where compiled kernels are kept across processes: $MOE_OPS_CUTE_CACHE or ~/.cache/moe_ops/cute."""
    return Path(os.environ.get("MOE_OPS_CUTE_CACHE", Path.home() / ".cache" / "moe_ops" / "cute"))


def _source_hash() -> str:
    h = hashlib.sha256(cutlass.__version__.encode() if hasattr(cutlass, "__version__") else b"")
    h.update(ARCH.encode())
    for path in _SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_SOURCE_HASH = _source_hash()


def fake_ptr(dtype) -> cute.Pointer:
    """A 16-byte aligned global pointer for compiling (its value is never dereferenced)."""
    return make_ptr(dtype, 1 << 20, AddressSpace.gmem, assumed_align=16)


def fake_stream():
    """The stream placeholder a launcher's signature is compiled with."""
    # A stream argument of the signature (not the TVM-FFI environment's stream, which is set only
    # when a call passes tensors): launchers pass torch's current stream as an int.
    return make_fake_stream(use_tvm_ffi_env_stream=False)


def get(key: str, build: Callable[[], tuple[object, tuple]]):
    """The compiled function for `key`; build() returns (jit callable, example args) to compile."""
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        digest = hashlib.sha256(f"{_SOURCE_HASH}:{key}".encode()).hexdigest()[:24]
        prefix = f"moe_{digest}"
        path = cache_dir() / f"{prefix}.o"
        start = time.perf_counter()
        if path.exists():
            fn = getattr(load_module(str(path), enable_tvm_ffi=True), prefix)
            how = "disk"
        else:
            jit_fn, args = build()
            with warnings.catch_warnings():
                # Loops over a thread's accumulator registers unroll in Python on purpose (register indices must be
                # compile-time constants); the DSL warns about every such loop of 64 iterations or more.
                warnings.filterwarnings("ignore", message="This static loop has")
                fn = cute.compile(jit_fn, *args, options=OPTIONS)
            how = "compile"
            _export(fn, path, prefix)
        timings[key] = (how, time.perf_counter() - start)
        _memory[key] = fn
        return fn


export_errors: list[str] = []


def _export(fn, path: Path, prefix: str) -> None:
    """Write the object file atomically (a concurrent process may be writing the same key). A cache
    that cannot be written costs the next process a compile, nothing else; the reason is kept in
    export_errors (the DSL cannot export when it was first imported without CUTE_DSL_ARCH set)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            fn.export_to_c(str(Path(tmp) / f"{prefix}.o"), prefix)
            os.replace(Path(tmp) / f"{prefix}.o", path)
    except Exception as e:  # noqa: BLE001 - OSError, or the DSL's own export errors
        export_errors.append(f"{path.name}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
