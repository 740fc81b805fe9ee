"""The kernel caches (cute_kernels/compile.py): a key names one compiled kernel in memory and on disk, so
every variant that compiles to different code needs its own key, and a kernel's name on disk must change
with the package's sources. A shared key or a stale disk name serves another kernel without any error
(one built for another grid, bias dtype, token dtype or launch order, or from older sources). Nothing
here compiles: cc.get, or the compiler and the object-file export under it, are stubbed."""
from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# Before the DSL's first import: it fixes its target then.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cutlass = pytest.importorskip("cutlass")

from cute_kernels import compile as cc  # noqa: E402
from cute_kernels import interface  # noqa: E402

BIASES = {torch.bfloat16: (None, torch.bfloat16, torch.float32), torch.float16: (None, torch.float16, torch.float32)}


@pytest.fixture
def keys(monkeypatch) -> list[str]:
    """The keys interface asks cc.get for, in order (nothing is built or compiled)."""
    asked = []

    def get(key, build):
        asked.append(key)
        return lambda *args: None

    monkeypatch.setattr(cc, "get", get)
    return asked


# The token sums precompile asks for after the GEMMs: the plain one, then with a post-expert norm whose
# weight has the activations' dtype, then float32.
SUMS = 3


def _precompile(keys: list[str], dtype, sms: int) -> list[str]:
    """The keys precompile asks for: one per variants() entry, then the SUMS token sums'."""
    keys.clear()
    interface.precompile(dtype, sms=sms, bias_dtypes=BIASES[dtype])
    return list(keys)


@pytest.mark.parametrize("dtype", list(BIASES))
def test_every_variant_has_its_own_key(keys, dtype):
    # The variants differ in compiled code: GEMM2 with and without early weights (loads before or
    # after the previous kernel's writes), a bf16 or f32 bias (read as its own dtype). A key shared by
    # two of them serves whichever compiled first to both.
    got = _precompile(keys, dtype, 132)
    gemm, sums = got[:-SUMS], got[-SUMS:]
    assert len(gemm) == len(interface.variants(dtype, BIASES[dtype]))
    assert len(set(gemm)) == len(gemm), sorted(k for k in gemm if gemm.count(k) > 1)
    assert len(set(sums)) == SUMS and not set(sums) & set(gemm)


def test_keys_name_the_sm_count(keys):
    # The persistent GEMM is compiled for a grid of one CTA per SM: a disk cache shared by GPUs with
    # 132 and 114 SMs (H100 SXM and PCIe) must not hand one's kernel to the other.
    h100_sxm = _precompile(keys, torch.bfloat16, 132)[:-SUMS]
    h100_pcie = _precompile(keys, torch.bfloat16, 114)[:-SUMS]
    assert not set(h100_sxm) & set(h100_pcie)


def test_keys_name_the_activation_dtype(keys):
    # fp16 and bf16 kernels read the same bytes differently, the token sum too.
    bf16 = _precompile(keys, torch.bfloat16, 132)
    fp16 = _precompile(keys, torch.float16, 132)
    assert not set(bf16) & set(fp16)
    assert not set(bf16[-SUMS:]) & set(fp16[-SUMS:])  # the token sums'


def test_source_hash_covers_every_source():
    # Editing any file of the package (the kernels in moe_gemm.py and token_sum.py, the argument
    # layout in interface.py) must invalidate the disk cache, so the hash reads all of them.
    package = Path(cc.__file__).parent
    want = {name for name in os.listdir(package) if name.endswith(".py")}
    assert {"moe_gemm.py", "token_sum.py", "norm_token_sum.py", "interface.py", "compile.py"} <= want
    assert {p.name for p in cc._SOURCES} == want
    assert all(p.parent == package for p in cc._SOURCES)


def test_source_hash_changes_with_any_source(tmp_path, monkeypatch):
    # The hash over copies of the sources: the same as the package's for the same bytes, and a new one
    # after a one-line edit of any of them.
    copies = []
    for path in cc._SOURCES:
        copies.append(tmp_path / path.name)
        shutil.copyfile(path, copies[-1])
    monkeypatch.setattr(cc, "_SOURCES", copies)
    assert cc._source_hash() == cc._SOURCE_HASH
    seen = {cc._SOURCE_HASH}
    for copy in copies:
        original = copy.read_bytes()
        copy.write_bytes(original + b"\n# edited\n")
        edited = cc._source_hash()
        assert edited not in seen, copy.name
        seen.add(edited)
        copy.write_bytes(original)
    assert cc._source_hash() == cc._SOURCE_HASH


@pytest.fixture
def stub_compiler(tmp_path, monkeypatch) -> list:
    """cc.get's compiler, export and loader stubbed, its caches empty and its directory tmp_path: each
    compile gives SimpleNamespace(built=jit_fn), each load SimpleNamespace(loaded=path), and the export
    writes an empty object file. Returns the list of the load calls' paths."""
    loads = []
    monkeypatch.setenv("MOE_OPS_CUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(cc, "_memory", {})
    monkeypatch.setattr(cc, "timings", {})
    monkeypatch.setattr(cc, "cute", SimpleNamespace(compile=lambda fn, *args, options: SimpleNamespace(built=fn)))
    monkeypatch.setattr(cc, "_export", lambda fn, path, prefix: path.write_bytes(b""))

    def load_module(path, *, enable_tvm_ffi):
        # The launchers pass ints for pointers and the stream: only a TVM-FFI module takes them.
        assert enable_tvm_ffi
        loads.append(path)
        return SimpleNamespace(**{Path(path).stem: SimpleNamespace(loaded=path)})

    monkeypatch.setattr(cc, "load_module", load_module)
    return loads


def test_disk_cache_is_keyed_by_the_source_hash(tmp_path, monkeypatch, stub_compiler):
    # cc.get's own path from key to object file, with the compiler and the export stubbed: a kernel
    # exported under one source hash loads from disk under the same hash only; after an edit of the
    # sources (another hash) the same key compiles again instead of loading the old binary.
    def get(key: str, source_hash: str) -> str:
        monkeypatch.setattr(cc, "_SOURCE_HASH", source_hash)
        monkeypatch.setattr(cc, "_memory", {})  # a fresh process
        cc.get(key, lambda: ("kernel", ()))
        return cc.timings[key][0]

    assert get("moe_gemm:k", "a" * 16) == "compile"
    assert len(list(tmp_path.glob("*.o"))) == 1
    assert get("moe_gemm:k", "a" * 16) == "disk"
    assert get("moe_gemm:other", "a" * 16) == "compile"
    assert get("moe_gemm:k", "b" * 16) == "compile"
    assert len(list(tmp_path.glob("*.o"))) == 3


def test_memory_cache_serves_a_key_again_without_the_disk(tmp_path, stub_compiler):
    # In one process a key compiles once and is then the very same function from memory: no second
    # build, no load of the object file the first call exported (a load per call costs milliseconds at
    # every launch, and gives a new function object each time).
    builds = []
    first = cc.get("moe_gemm:k", lambda: builds.append(1) or ("kernel", ()))
    assert first.built == "kernel" and cc.timings["moe_gemm:k"][0] == "compile"
    assert cc.get("moe_gemm:k", lambda: builds.append(1) or ("kernel", ())) is first
    assert builds == [1] and stub_compiler == []


def test_concurrent_first_uses_compile_once(stub_compiler, monkeypatch):
    # Two threads ask for one key; the second asks while the first is compiling it, so the second
    # finds nothing in memory and waits for the lock. Once it has the lock it must take the first's
    # function, not compile again nor load the object file (another function object). The lock is
    # wrapped only to know when the second thread waits on it: no sleeps, no timing.
    building, release, second_waits = threading.Event(), threading.Event(), threading.Event()
    lock, builds, results = threading.Lock(), [], []

    class ObservedLock:
        def __enter__(self):
            if building.is_set():
                second_waits.set()
            lock.acquire()

        def __exit__(self, *exc):
            lock.release()

    def build():
        builds.append(1)
        building.set()
        assert release.wait(30)
        return "kernel", ()

    monkeypatch.setattr(cc, "_lock", ObservedLock())
    threads = [threading.Thread(target=lambda: results.append(cc.get("moe_gemm:k", build))) for _ in range(2)]
    threads[0].start()
    assert building.wait(30)
    threads[1].start()
    assert second_waits.wait(30)
    release.set()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and results[0] is results[1]
    assert builds == [1] and stub_compiler == []


def test_compile_quiets_only_the_dsls_static_loop_warning(stub_compiler, monkeypatch):
    # The kernels unroll loops over a thread's accumulator registers in Python on purpose; the DSL warns about
    # every such loop of 64 iterations or more, which would reach each user at a first compile. Any other
    # warning of the compile still comes through.
    def compile_(fn, *args, options):
        warnings.warn("This static loop has 64 iterations, which may be very slow to compile", UserWarning)
        warnings.warn("another warning", UserWarning)
        return SimpleNamespace(built=fn)

    monkeypatch.setattr(cc, "cute", SimpleNamespace(compile=compile_))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cc.get("moe_gemm:k", lambda: ("kernel", ()))
    assert [str(w.message) for w in seen] == ["another warning"]


def test_cache_dir_default_and_override(tmp_path, monkeypatch):
    # The README's default, ~/.cache/moe_ops/cute, and $MOE_OPS_CUTE_CACHE over it.
    monkeypatch.delenv("MOE_OPS_CUTE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cc.cache_dir() == tmp_path / ".cache" / "moe_ops" / "cute"
    monkeypatch.setenv("MOE_OPS_CUTE_CACHE", str(tmp_path / "elsewhere"))
    assert cc.cache_dir() == tmp_path / "elsewhere"


def test_source_hash_changes_with_the_dsl_version(monkeypatch):
    # Object files from another DSL release may not load, or may call into a runtime that changed:
    # a DSL upgrade must invalidate the disk cache like an edit of the sources does.
    monkeypatch.setattr(cutlass, "__version__", cutlass.__version__ + ".other")
    assert cc._source_hash() != cc._SOURCE_HASH


class _Exportable:
    """A TVM-FFI compiled function's stand-in for cc._export: export_to_c writes the object file it is
    given (as the DSL does) with the exported function's name in it, or raises `error`."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def export_to_c(self, object_file_path, function_name):
        if self.error is not None:
            raise self.error
        Path(object_file_path).write_text(f"functions named {function_name}")


def test_export_creates_the_cache_dir(tmp_path, monkeypatch):
    # The default cache directory does not exist before the first export: _export makes it (a cache
    # that is never written costs every process a compile, and says nothing). The file lands at the
    # path cc.get loads from, its functions named by the prefix cc.get looks up.
    monkeypatch.setattr(cc, "export_errors", [])
    path = tmp_path / "not" / "yet" / "moe_abc.o"
    cc._export(_Exportable(), path, "moe_abc")
    assert cc.export_errors == []
    assert path.read_text() == "functions named moe_abc"
    assert [p.name for p in path.parent.iterdir()] == ["moe_abc.o"]  # no temporary folder left behind


def test_export_failure_is_recorded_not_raised(tmp_path, monkeypatch):
    # An export that fails (here the DSL's own error, not an OSError) costs the next process a compile,
    # nothing else: the kernel in hand still runs, and the reason is kept for the compile-time report.
    monkeypatch.setattr(cc, "export_errors", [])
    cc._export(_Exportable(RuntimeError("cannot export\nmore detail")), tmp_path / "moe_abc.o", "moe_abc")
    assert cc.export_errors == ["moe_abc.o: RuntimeError: cannot export"]
    assert not (tmp_path / "moe_abc.o").exists()


def test_keys_name_only_the_parameters_a_kind_reads():
    # The epilogue of silu reads neither alpha nor limit and silu_clamped reads limit only: a value of
    # an unread parameter must not compile a variant of its own, while a read one must.
    from cute_kernels.moe_gemm import Epilogue

    def key(act, **params):
        return interface._gemm_key(Epilogue(act, "concat", **params), True, torch.bfloat16, torch.bfloat16, 132, 128, 256, False)

    assert key("silu", alpha=2.5, limit=3.0) == key("silu")
    assert key("silu_clamped", alpha=2.5) == key("silu_clamped")
    assert key("silu_clamped", limit=3.0) != key("silu_clamped")
    assert key("swigluoai", alpha=2.5) != key("swigluoai")
    assert key("swigluoai", limit=3.0) != key("swigluoai")
    assert key("swiglu_softcapped", alpha=2.5) != key("swiglu_softcapped")
    assert key("swiglu_softcapped", limit=3.0) != key("swiglu_softcapped")
