"""A third-party backend installed as a package (tests/plugin_pkg, entry point group
``sparktune.backends``) is discovered, tuned and then dispatched to without being named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "plugin_pkg"

SCRIPT = r"""
import importlib, json, sys
import torch
import sparktune
from sparktune import dispatch, registry
from sparktune.cli import build_parser
from sparktune.cli import tune as tune_cli
from sparktune.problem import DeviceInfo, Problem
from sparktune.tune import CostTimer
import sparktune_testplugin as tp

db = sys.argv[1]
device = DeviceInfo("Plugin Test GPU", (9, 0), 132, driver="1", cuda="13.0")
backend = registry.backends()["knowncost"]  # discovered through the entry point
report = {"module": type(backend).__module__, "file": tp.__file__}

def cost(candidate, problem):
    if candidate.backend == "knowncost":
        return tp.cost_ms(candidate.config, problem)
    if candidate.label == "sdpa:default":
        return tp.cost_ms("sdpa:default", problem)
    return 100.0

args = build_parser().parse_args(
    ["tune", "--seqlen", "64", "--heads", "2", "--head-dim", "64", "--op", "fwd", "--db", db, "--json", "--no-progress"]
)
problems, extra = tune_cli.problems_from_args(args)
report["code"] = tune_cli.run(args, problems, extra, device=device, torch_device="cpu", timer=CostTimer(cost))

dispatch.configure(db)
p = problems[0]
sel = dispatch.select(p, device)
report["selection"] = [sel.candidate.label, sel.source]
report["explain"] = str(dispatch.explain(p, device))

# end to end: attention() on tensors of that shape runs the tuned plugin kernel
plan = importlib.import_module("sparktune._plan")
if hasattr(plan, "device_info"):
    plan.device_info = lambda dev: device
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
    before = backend.calls["d64only"]
    out = sparktune.attention(q, k, v)
    ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / 8.0, -1) @ v.float()
    report["attention_calls"] = backend.calls["d64only"] - before
    report["attention_error"] = (out.float() - ref).abs().max().item()
print("REPORT " + json.dumps(report))
"""


def _install(target: Path, work: Path) -> str:
    """Install the plugin into ``target``: with pip (no network, no build isolation); where
    pip cannot build it, lay out the same installed metadata by hand."""
    src = work / "src"
    shutil.copytree(PLUGIN, src)  # the build leaves files next to the sources
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
           "--no-build-isolation", "--target", str(target), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "pip"
    shutil.copytree(src / "sparktune_testplugin", target / "sparktune_testplugin")
    info = target / "sparktune_testplugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sparktune-testplugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[sparktune.backends]\nknowncost = sparktune_testplugin:KnownCostBackend\n"
    )
    return "simulated (pip failed: " + done.stderr.strip().splitlines()[-1] + ")"


@pytest.mark.slow
def test_installed_plugin_is_tuned_and_dispatched(tmp_path):
    target = tmp_path / "site"
    how = _install(target, tmp_path)
    assert (target / "sparktune_testplugin").is_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "SPARKTUNE_SHIPPED_DB": ""}
    env.pop("SPARKTUNE_DB", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "plugin.sqlite3")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    assert report["file"].startswith(str(target)), (how, report)
    assert report["module"] == "sparktune_testplugin"
    assert report["code"] == 0
    tuned = json.loads(done.stdout[: done.stdout.index("REPORT ")])["results"][0]
    assert tuned["best"]["candidate"] == "knowncost:d64only"
    statuses = {c["candidate"]: c["status"] for c in tuned["candidates"]}
    assert statuses["knowncost:wrong"] == "wrong" and statuses["knowncost:crash"] == "failed"
    assert report["selection"] == ["knowncost:d64only", "tuned"]
    assert "choice:   knowncost:d64only (tuned)" in report["explain"]
    print(how, {k: v for k, v in report.items() if k != "explain"})
    if "attention_calls" in report:
        assert report["attention_calls"] == 1
        assert report["attention_error"] < 1e-2
