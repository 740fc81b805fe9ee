"""The FX graph cache with the MoE pass installed: a second process hits the cache (and so does not
run the pass again), and changing the lowering package's source makes it miss, since the pass's
uuid hashes its files. Each run is a fresh Python process sharing one TORCHINDUCTOR_CACHE_DIR."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json
import os

import torch

torch.manual_seed(int(os.environ["MOE_OPS_SEED"]))  # the test's fresh seed: new draws every run

import lowering
import moe_ops


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w13", torch.randn(4, 128, 64) / 8)
        self.register_buffer("w2", torch.randn(4, 64, 64) / 8)

    def forward(self, x, topk_weights, topk_ids):
        return moe_ops.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


model = MoE()
x = torch.randn(5, 64)
topk_weights, topk_ids = moe_ops.route(torch.randn(5, 4), 2)
moe_pass = lowering.install()
ran = []
moe_pass.listeners.append(ran)  # the pass reports here each time it runs on a graph
with torch.no_grad():
    out = torch.compile(model, fullgraph=True, dynamic=True)(x, topk_weights, topk_ids)
    ref = model(x, topk_weights, topk_ids)
assert torch.equal(out, ref), (out - ref).abs().max()
print("lowering_file=" + lowering.__file__)
print("pass_runs=" + str(len(ran)))
print("fused=" + str(sum(len(report.fused) for _, report in ran)))
print(json.dumps(dict(torch._dynamo.utils.counters["inductor"])))
'''


def run_script(tmp_path: Path, *pythonpath: Path) -> tuple[dict, dict]:
    """Run SCRIPT in a fresh process; return (key=value lines, the inductor counters)."""
    script = tmp_path / "compile_moe.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath),
        MOE_OPS_SEED=str(torch.initial_seed()),  # tests/conftest.py's seed for this test
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    info = dict(line.split("=", 1) for line in lines[:-1] if "=" in line)
    return info, json.loads(lines[-1])


def assert_miss(info: dict, counts: dict):
    assert counts.get("fxgraph_cache_miss", 0) >= 1 and counts.get("fxgraph_cache_hit", 0) == 0, counts
    assert info["pass_runs"] == "1" and info["fused"] == "1", info  # the pass ran and fused the layer


def assert_hit(info: dict, counts: dict):
    assert counts.get("fxgraph_cache_hit", 0) >= 1 and counts.get("fxgraph_cache_miss", 0) == 0, counts
    assert info["pass_runs"] == "0", info  # the cached (fused) graph was used: the pass did not run


def test_fx_graph_cache_hits_and_misses_when_the_pass_changes(tmp_path):
    info, counts = run_script(tmp_path, ROOT)
    assert Path(info["lowering_file"]).resolve().is_relative_to(ROOT / "lowering")
    assert_miss(info, counts)

    info, counts = run_script(tmp_path, ROOT)
    assert_hit(info, counts)

    # Control: an unchanged copy shadowing the package still hits (the uuid hashes the files'
    # contents, so what makes the next run miss is the change, not the copy's other path).
    same = tmp_path / "same"
    shutil.copytree(ROOT / "lowering", same / "lowering", ignore=shutil.ignore_patterns("__pycache__"))
    info, counts = run_script(tmp_path, same, ROOT)
    assert Path(info["lowering_file"]).resolve().is_relative_to(same.resolve())
    assert_hit(info, counts)

    # A change to the pass's own file, and one to the chain patterns it imports (chains.py): the
    # cached graph was fused by the old code either way, so each must miss.
    for name in ("graph_pass.py", "chains.py"):
        changed = tmp_path / f"changed_{name[:-3]}"
        shutil.copytree(ROOT / "lowering", changed / "lowering", ignore=shutil.ignore_patterns("__pycache__"))
        with open(changed / "lowering" / name, "a") as f:
            f.write("\n# a harmless change: the pass's uuid, and so the cache key, must change with it\n")
        info, counts = run_script(tmp_path, changed, ROOT)
        assert Path(info["lowering_file"]).resolve().is_relative_to(changed.resolve())
        assert_miss(info, counts)


UUID_SCRIPT = r'''
import json
from pathlib import Path

from torch._inductor.custom_graph_pass import get_hash_for_files

import lowering

package = Path(lowering.__file__).parent
moe_pass = lowering.MoEFusionPass()
out = {"package": str(package), "base": moe_pass.uuid(), "after": {}}
for path in sorted(package.glob("*.py")):
    with open(path, "a") as f:
        f.write("\n# edited\n")
    get_hash_for_files.cache_clear()  # it caches the last hash by file names, not contents
    out["after"][path.name] = moe_pass.uuid()
print(json.dumps(out))
'''


def test_pass_uuid_changes_with_every_lowering_file(tmp_path):
    """The pass's behaviour is the whole lowering package (chain patterns, fused ops, backend choice,
    explain), so appending to any one of its files must give the pass a new uuid, or the FX graph cache
    serves graphs fused by the old code. Each file is edited in turn in a copy of the package, in a
    fresh process that imports the copy."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "lowering", copy / "lowering", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "uuids.py"
    script.write_text(UUID_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(ROOT)])
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["package"]).resolve() == (copy / "lowering").resolve()
    names = sorted(p.name for p in (ROOT / "lowering").glob("*.py"))
    assert sorted(out["after"]) == names and "chains.py" in names
    seen = [out["base"], *out["after"].values()]
    assert len(set(seen)) == len(seen), f"an edit left the uuid unchanged: {out}"
