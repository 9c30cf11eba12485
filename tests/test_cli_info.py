"""``sparktune info`` (text and JSON), the CLI's plumbing, and a light ``import sparktune``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparktune
from sparktune import cli

ROOT = Path(__file__).resolve().parents[1]
HAS_C = importlib.util.find_spec("sparktune._C") is not None


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_info_text():
    proc = run_python("-m", "sparktune", "info")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith(f"sparktune {sparktune.__version__}\n")
    if HAS_C:
        assert "kernels:" in text and "configs excluded" in text
    else:
        assert "WARNING: pure-Python install: no compiled kernels (" in text
    assert f"torch:    {torch.__version__}" in text
    if not torch.cuda.is_available():
        assert "GPU:      no GPU (" in text
    else:
        assert torch.cuda.get_device_name(0) in text
    lines = text.splitlines()
    backends_at = lines.index("backends:")
    listed = {line.split()[0]: line for line in lines[backends_at + 1 :]}
    assert {"spark", "triton", "torch", "reference"} <= set(listed)
    assert "available (2 configs: float32, float64)" in listed["reference"]
    assert "features: alibi, decode, deterministic, dropout, softcap, varlen, window" in listed["reference"]
    for line in listed.values():
        assert " available (" in line or " unavailable: " in line


def test_info_json():
    proc = run_python("-m", "sparktune", "info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["version"] == sparktune.__version__
    assert info["build"]["compiled"] is HAS_C
    if not HAS_C:
        assert info["build"]["reason"]
    assert info["torch"] == {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    assert len(info["gpu"]["devices"]) == torch.cuda.device_count()
    ref = info["backends"]["reference"]
    assert ref == {
        "available": True,
        "reasons": [],
        "tunable": False,
        "configs": ["float32", "float64"],
        "features": ["alibi", "decode", "deterministic", "dropout", "softcap", "varlen", "window"],
    }
    for b in info["backends"].values():
        assert b["available"] is (not b["reasons"])


def test_main_in_process(capsys):
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == sparktune.__version__
    assert cli.main([]) == 2  # no subcommand: help, exit code 2
    assert "info" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_subcommand_that_cannot_import_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("info", "sparktune_missing_cmd"))
    assert cli.main(["sparktune_missing_cmd", "--anything"]) == 2
    assert (
        "sparktune sparktune_missing_cmd: unavailable: ModuleNotFoundError"
        in capsys.readouterr().err
    )


def test_import_is_light():
    proc = run_python(
        "-c",
        "import sys, sparktune; "
        "print(sorted(m for m in ('optuna', 'sqlalchemy', 'triton') if m in sys.modules))",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
