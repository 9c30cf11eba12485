"""Every shipped tuning file (``tuning_db/*.jsonl``) is sound: it imports through the store's
own validation, names only kernels that the kernel spaces declare and whose rules they pass,
for the problem they were measured on, and states numbers that agree with one another (TFLOP/s
from the FLOPs and the median; ordered run statistics; no spread made of copies)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparktune import db
from sparktune.backends.torch_sdpa import TorchSDPABackend
from sparktune.db import Store, problem_key
from sparktune.kernels import triton_decode_space, triton_space
from sparktune.kernels.kernel_space import DTYPES as SPARK_DTYPES
from sparktune.kernels.kernel_space import full_space

ROOT = Path(__file__).resolve().parent.parent

FILES = sorted((ROOT / "tuning_db").glob("*.jsonl"))
SPARK = {e.name: e for e in full_space()}
TRITON = {c.name for c in (*triton_space.FWD_SPACE, *triton_space.BWD_SPACE)}


def _records(path):
    good, errors = db.read_jsonl_file(path)
    assert errors == [], errors[:3]
    return [r for _, r in good]


def _where(r) -> str:
    return f"{r.source}: {r.uid} ({problem_key(r.problem)} {r.label})"


def test_there_are_shipped_files():
    assert FILES, "no tuning_db/*.jsonl"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_imports_through_the_store(path, tmp_path):
    """The store's own import takes every line, and the records come back as written."""
    written = _records(path)
    with Store(tmp_path / "check.sqlite3") as store:
        report = db.import_jsonl(store, path)
        assert (report.refused, report.errors, report.skipped) == (False, [], 0)
        assert report.added == len(written) and report.duplicates == 0
        back = {r.uid: db.record_to_json(r) for r in store.records()}
    assert back == {r.uid: db.record_to_json(r) for r in written}


def _spark_problems(r) -> list[str]:
    e = SPARK.get(r.config)
    if e is None:
        return [f"{r.config!r} is not in the spark kernel space"]
    p, out = r.problem, []
    if not r.config.startswith(f"{p.op}_"):
        out.append(f"a {r.config.split('_')[0]} kernel for a {p.op} problem")
    if SPARK_DTYPES[e.dtype][0] != p.dtype:
        out.append(f"dtype {e.dtype} for a {p.dtype} problem")
    if e.head_dim != p.head_dim:
        out.append(f"head dim {e.head_dim} for a problem of head dim {p.head_dim}")
    if getattr(e, "accum", 32) == 16 and not p.allow_fp16_accum:
        out.append("fp16 accumulation where the problem did not allow it")
    if e.family > r.device.arch:
        out.append(f"sm_{e.family} kernel on an sm_{r.device.arch} device")
    return out


def _triton_problems(r) -> list[str]:
    if r.problem.op == "decode":  # the split-KV kernels (docs/DECODING.md)
        if r.config not in triton_decode_space.DECODE_SPACE:
            return [f"{r.config!r} is not in the triton decode space"]
        return triton_decode_space.problem_reasons(r.problem)
    if r.config not in TRITON:
        return [f"{r.config!r} is not in the triton kernel space"]
    cfg = triton_space.parse_config(r.config)
    if cfg.op != r.problem.op:
        return [f"a {cfg.op} kernel for a {r.problem.op} problem"]
    return triton_space.config_reasons(cfg, r.problem, r.device)


def _torch_problems(r) -> list[str]:
    configs = TorchSDPABackend().configs(r.problem.op)
    return [] if r.config in configs else [f"{r.config!r} is not one of the torch backend's {sorted(configs)}"]


CHECKS = {"spark": _spark_problems, "triton": _triton_problems, "torch": _torch_problems}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_kernels_exist_and_fit_their_problem(path):
    bad = []
    for r in _records(path):
        check = CHECKS.get(r.backend)
        found = check(r) if check is not None else [f"backend {r.backend!r} has no kernel space here"]
        bad += [f"{_where(r)}: {why}" for why in found]
    assert not bad, "\n".join(bad[:20])


def _cutlass_include() -> str | None:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return str(inc) if (inc / "cute" / "tensor.hpp").exists() else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the C++ rules are compiled)")
@pytest.mark.skipif(_cutlass_include() is None, reason="needs the nvidia-cutlass headers")
def test_spark_kernels_pass_the_compile_time_rules(tmp_path):
    """The generator asks the C++ rules (fwd_config.h, bwd_config.h) about every spark kernel
    the shipped files name (every family): each must be valid."""
    names = sorted({r.config for path in FILES for r in _records(path) if r.backend == "spark" and r.config in SPARK})
    if not names:
        pytest.skip("no spark records shipped")
    subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(tmp_path), "--nvcc", "nvcc",
         "--include", _cutlass_include(), "--include", str(ROOT / "csrc" / "include"), "--filter", ",".join(names),
         "--families", "70,80,90"],
        check=True, capture_output=True, text=True,
    )
    rows = {r.split("\t")[0]: r.split("\t") for r in (tmp_path / "space.tsv").read_text().splitlines()}
    assert set(rows) == set(names)
    invalid = {n: rows[n][4] for n in names if rows[n][1] != "1"}
    assert not invalid, invalid


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_numbers_agree(path):
    bad = []
    for r in _records(path):
        if r.status != "ok":
            continue
        why = []
        tflops = r.problem.flops() / (r.median_ms * 1e-3) / 1e12
        if r.tflops is None or abs(r.tflops - tflops) > 1e-9 * tflops:
            why.append(f"tflops {r.tflops} where FLOPs / median give {tflops}")
        stats = [x for x in (r.min_ms, r.q1_ms, r.q3_ms, r.max_ms) if x is not None]
        if stats != sorted(stats):
            why.append(f"run statistics out of order: min, q1, q3, max = {r.min_ms}, {r.q1_ms}, {r.q3_ms}, {r.max_ms}")
        if r.runs >= 2 and len(stats) == 4 and set(stats) == {r.median_ms}:
            why.append("a spread made of copies of the median")
        if r.floor_ms is not None:
            if r.median_ms < r.floor_ms:
                why.append(f"median {r.median_ms} under the burst floor {r.floor_ms}")
            if r.min_ms is not None and r.min_ms == r.median_ms:
                why.append("min is a copy of the floored median")
        elif r.q1_ms is not None and r.q3_ms is not None and not r.q1_ms <= r.median_ms <= r.q3_ms:
            why.append(f"median {r.median_ms} outside its quartiles {r.q1_ms}-{r.q3_ms} with no floor")
        if r.error is not None and r.error_limit is not None and r.error > r.error_limit:
            why.append(f"error {r.error} over its limit {r.error_limit}")
        bad += [f"{_where(r)}: {w}" for w in why]
    assert not bad, "\n".join(bad[:20])
