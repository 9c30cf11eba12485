"""bench/targets.py: every ratio of a `sparktune bench --json` run is printed, and the exit
status says whether a target was missed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "targets.py"


def _doc(tflops: dict[str, float], *, seqlens=(1024, 8192)) -> dict:
    """One bench document: each op and seqlen with the given TFLOP/s per candidate."""
    results = []
    for op in ("fwd", "bwd", "fwd+bwd"):
        for n in seqlens:
            for cand, t in tflops.items():
                results.append({"dtype": "float16", "op": op, "head_dim": 128, "causal": False,
                                "seqlen": n, "candidate": cand, "status": "ok", "tflops": t})
            results.append({"dtype": "float16", "op": op, "head_dim": 128, "causal": False,
                            "seqlen": n, "candidate": "math", "status": "skipped", "tflops": None})
    return {"format": "sparktune-bench/1", "results": results}


def _run(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True,
                          timeout=60)


def test_all_targets_met(tmp_path):
    res = _run(tmp_path, _doc({"dispatch": 400.0, "own": 380.0, "flash": 300.0, "cudnn": 390.0,
                               "plain": 100.0}))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("  met ") == 5 and "missed" not in res.stdout
    assert "float16 fwd: own/flash min 1.267" in res.stdout


def test_a_missed_target_fails_and_every_ratio_is_still_printed(tmp_path):
    # dispatch 0.95x the fastest (cuDNN): one target missed, the others met
    res = _run(tmp_path, _doc({"dispatch": 380.0, "own": 370.0, "flash": 300.0, "cudnn": 400.0,
                               "plain": 100.0}))
    assert res.returncode == 1, res.stdout + res.stderr
    for op in ("fwd", "bwd", "fwd+bwd"):
        assert f"float16 {op}: own/flash" in res.stdout
    assert "n=8192 hd128 causal=0: dispatch/plain 3.80" in res.stdout
    assert "  missed       dispatch / the fastest candidate >= 0.97" in res.stdout
    assert "float16 fwd hd128 causal=0 n=1024: 0.950" in res.stdout
    assert "1 of 5 targets missed" in res.stdout


def test_a_geometric_mean_below_its_floor_is_missed(tmp_path):
    res = _run(tmp_path, _doc({"dispatch": 400.0, "own": 315.0, "flash": 300.0, "cudnn": 390.0,
                               "plain": 100.0}))
    assert res.returncode == 1
    assert "missed       own / flash >= 1.10 in geometric mean" in res.stdout
    assert "geometric mean 1.050" in res.stdout


def test_a_target_the_run_did_not_measure_is_said_and_does_not_fail(tmp_path):
    # no seqlen 8192 and no plain candidate: the forward+backward target is not measured
    res = _run(tmp_path, _doc({"dispatch": 400.0, "own": 380.0, "flash": 300.0}, seqlens=(1024,)))
    assert res.returncode == 0, res.stdout
    assert "not measured forward+backward at seqlen 8192" in res.stdout


def test_an_unreadable_document_is_status_2(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text("{not json")
    res = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "cannot read" in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
