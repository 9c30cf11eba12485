"""The shipped tuning records (tuning_db/*.jsonl) travel with the package: a wheel carries them
as sparktune/tuning_db/, and the layer loader finds them there, or in tuning_db/ of a source
checkout; a tuning_db directory of another project beside an installed package is not taken."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import sparktune
from sparktune import db, dispatch
from sparktune.dispatch import _ranking
from tests._store_helpers import problem, record

ROOT = Path(__file__).resolve().parent.parent

LOADER = r"""
import json
import sparktune
from sparktune.dispatch import load_shipped, shipped_dir
d = shipped_dir()
records, bad = load_shipped()
print("LOADER " + json.dumps({"package": sparktune.__file__, "dir": str(d) if d else None,
                              "sources": sorted({r.source for r in records}), "bad": len(bad)}))
"""


def _run_loader(paths: list[Path]) -> dict:
    """Run the layer loader in a fresh interpreter that sees only ``paths`` and this
    environment's site-packages, without its .pth files (so an editable install of the
    checkout does not answer for ``import sparktune``)."""
    env = {k: v for k, v in os.environ.items() if k not in (dispatch.ENV_SHIPPED, "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), sysconfig.get_paths()["purelib"]])
    done = subprocess.run([sys.executable, "-S", "-c", LOADER], capture_output=True, text=True, env=env,
                          cwd=paths[0], timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("LOADER "))
    return json.loads(line[len("LOADER "):])


def _jsonl(path: Path, config: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(db.dumps_record(record(problem(), config=config)) + "\n")
    return path


def _copy_package(dest: Path) -> Path:
    pkg = dest / "sparktune"
    shutil.copytree(ROOT / "sparktune", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    return pkg


def test_wheel_state_maps_tuning_db_into_the_package():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
    assert "tuning_db" in config["sdist"]["include"]
    import re

    wheel_overrides = [
        o for o in config.get("overrides", [])
        if re.search(o.get("if", {}).get("state", "$^"), "wheel")
    ]
    assert len(wheel_overrides) == 1, config.get("overrides")
    (o,) = wheel_overrides
    # the editable install keeps reading the checkout: the override is for wheels only
    for other in ("editable", "sdist", "metadata_editable"):
        assert not re.search(o["if"]["state"], other), other
    assert o["wheel"]["packages"] == {"sparktune": "sparktune", "sparktune/tuning_db": "tuning_db"}
    assert config["wheel"]["packages"] == ["sparktune"]


def test_source_checkout_reads_tuning_db_beside_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv(dispatch.ENV_SHIPPED, raising=False)
    if not Path(sparktune.__file__).resolve().is_relative_to(ROOT):
        pytest.skip(f"sparktune is imported from {sparktune.__file__}, not from this checkout")
    assert dispatch.shipped_dir() == ROOT / "tuning_db"
    # a checkout elsewhere: tuning_db beside the package, next to pyproject.toml
    checkout = tmp_path / "checkout"
    (checkout / "sparktune").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'sparktune'\n")
    _jsonl(checkout / "tuning_db" / "test-gpu.jsonl", "fast")
    assert _ranking.packaged_dir(checkout / "sparktune") == checkout / "tuning_db"
    records, bad = dispatch.load_shipped(_ranking.packaged_dir(checkout / "sparktune"))
    assert [r.config for r in records] == ["fast"] and bad == []
    assert records[0].source == "shipped:test-gpu.jsonl"


@pytest.mark.slow
def test_installed_layout_reads_the_packaged_records_and_nothing_beside(tmp_path):
    site = tmp_path / "site-packages"
    pkg = _copy_package(site)
    _jsonl(pkg / "tuning_db" / "test-gpu.jsonl", "fast")
    # another project's directory of the same name, beside the installed package
    _jsonl(site / "tuning_db" / "decoy-gpu.jsonl", "slow")
    found = _run_loader([site])
    assert found["package"] == str(pkg / "__init__.py")
    assert found["dir"] == str(pkg / "tuning_db")
    assert found["sources"] == ["shipped:test-gpu.jsonl"] and found["bad"] == 0
    # an installation without shipped records has no shipped layer (not the decoy)
    shutil.rmtree(pkg / "tuning_db")
    found = _run_loader([site])
    assert found["dir"] is None and found["sources"] == []


def _build_tools_missing() -> str:
    missing = [m for m in ("scikit_build_core", "pybind11") if importlib.util.find_spec(m) is None]
    if shutil.which("cmake") is None:
        missing.append("cmake")
    return ", ".join(missing)


@pytest.mark.slow
@pytest.mark.skipif(bool(_build_tools_missing()), reason=f"needs the build tools offline: {_build_tools_missing()} missing")
def test_wheel_carries_the_shipped_records(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "CMakeLists.txt", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    _copy_package(src)
    shutil.copytree(ROOT / "tuning_db", src / "tuning_db", ignore=shutil.ignore_patterns("*.jsonl"))
    _jsonl(src / "tuning_db" / "test-gpu.jsonl", "fast")
    wheels = tmp_path / "wheels"
    env = {**os.environ, "SPARKTUNE_CUDA_ARCHS": "none", "SPARKTUNE_REQUIRE_CUDA": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(wheels), str(src)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = wheels.glob("sparktune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparktune/tuning_db/test-gpu.jsonl" in names, names
    assert "sparktune/dispatch/_ranking.py" in names
    target = tmp_path / "installed"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = _run_loader([target])
    assert found["package"] == str(target / "sparktune" / "__init__.py")
    assert found["dir"] == str(target / "sparktune" / "tuning_db")
    assert found["sources"] == ["shipped:test-gpu.jsonl"] and found["bad"] == 0
