"""`sparktune bench` on CPU tensors (the hidden ``--device cpu``): the table, the CSV, the JSON
document, the PNG charts, the candidates that cannot run, the no-GPU line and argument errors."""

from __future__ import annotations

import csv
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparktune import benchmark, dispatch
from sparktune.backends.base import Backend
from sparktune.backends.reference import reference_attention, reference_attention_backward
from sparktune.benchmark import _candidates
from sparktune.cli import bench as bench_cli
from sparktune.cli import main
from sparktune.db import Store
from sparktune.problem import Problem
from sparktune.tune import CostTimer
from tests._store_helpers import DEVICE, OTHER_DEVICE, record

ROOT = Path(__file__).resolve().parents[1]
OPS = ("fwd", "bwd", "fwd+bwd")
STATUSES = {"ok", "wrong", "failed", "unavailable", "skipped", "not run"}
#: two tiny shapes: 32 tokens at seqlen 16 (batch 2) and 32 (batch 1), 2 heads of 16
SHAPES = ["--seqlens", "16,32", "--head-dims", "16", "--causal", "1", "--heads", "2", "--tokens", "32"]
CANDS = ["--candidates", "dispatch,own,flash,math,plain", "--baseline", "math"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-m", "sparktune", "bench", "--device", "cpu", "--cpu-runs", "1", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )


def fa_flops(batch: int, heads: int, n: int, d: int, causal: bool, op: str) -> float:
    fwd = 4 * batch * heads * n * n * d / (2 if causal else 1)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[op]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG whose chunks all have valid CRCs and which ends with IEND."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, chunks, size = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in the {kind!r} chunk of {path}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    assert size is not None
    return size


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run_cli(*SHAPES, *CANDS, "--csv", str(out / "bench.csv"), "--out", str(out / "charts"))
    return proc, out


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    proc = run_cli(*SHAPES, *CANDS, "--json")
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout)


# --------------------------------------------------------------------------- the pipeline


def test_table(table_run):
    proc, _ = table_run
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Traceback" not in proc.stderr
    assert "\r" not in proc.stderr  # no progress bar when stderr is not a terminal
    lines = text.splitlines()
    for op in OPS:
        title = f"{op} float16: TFLOP/s and speedup over PyTorch math"
        assert title in lines
        at = lines.index(title)
        header = lines[at + 1].split()
        assert header[:5] == ["hd", "causal", "seqlen", "batch", "heads"]
        assert header[6:] == ["dispatch", "own", "flash", "math", "plain"]
        rows = [line.split() for line in lines[at + 2 : at + 4]]
        assert [r[:5] for r in rows] == [["16", "yes", "16", "2", "2"], ["16", "yes", "32", "1", "2"]]
        for r in rows:
            # dispatch, math and plain: TFLOP/s and the speedup over math; own and flash: n/a
            d_tf, d_sp, own, flash, m_tf, m_sp, p_tf, p_sp = r[6:]
            assert (own, flash) == ("n/a", "n/a")
            assert m_sp == "1.00x"  # the baseline against itself
            for tf, sp in ((d_tf, d_sp), (m_tf, m_sp), (p_tf, p_sp)):
                assert float(tf) > 0 and float(sp.removesuffix("x")) > 0
    assert "not timed:" in lines
    notes = lines[lines.index("not timed:") + 1 :]
    own = next(line for line in notes if line.lstrip().startswith("own unavailable"))
    flash = next(line for line in notes if line.lstrip().startswith("flash unavailable"))
    assert "every case (6)" in own and "spark:" in own and "triton:" in own
    assert "every case (6)" in flash and "CUDA" in flash
    assert "peak memory: measured on CUDA devices only" in lines


def test_csv(table_run):
    proc, out = table_run
    assert proc.returncode == 0, proc.stderr
    with open(out / "bench.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == benchmark.CSV_FIELDS
        rows = list(reader)
    assert len(rows) == 2 * 3 * 5
    assert {(r["seqlen"], r["batch"]) for r in rows} == {("16", "2"), ("32", "1")}
    assert {r["op"] for r in rows} == set(OPS)
    base = {(r["op"], r["seqlen"]): float(r["median_ms"]) for r in rows if r["candidate"] == "math"}
    for r in rows:
        assert r["status"] in STATUSES
        flops = fa_flops(int(r["batch"]), int(r["heads"]), int(r["seqlen"]), int(r["head_dim"]), r["causal"] == "1", r["op"])
        assert float(r["flops"]) == pytest.approx(flops, rel=1e-5)
        if r["candidate"] in ("own", "flash"):
            assert r["status"] == "unavailable" and r["reason"] and not r["median_ms"]
            continue
        assert r["status"] == "ok", r
        ms = float(r["median_ms"])
        assert ms > 0 and int(r["runs"]) == 1
        assert float(r["tflops"]) == pytest.approx(flops / (ms * 1e-3) / 1e12, rel=1e-4)
        assert float(r["speedup"]) == pytest.approx(base[(r["op"], r["seqlen"])] / ms, rel=1e-4)
        assert float(r["error"]) <= float(r["error_limit"])
        assert r["peak_mem_bytes"] == ""  # measured on CUDA only
        n, d, b, h = int(r["seqlen"]), int(r["head_dim"]), int(r["batch"]), int(r["heads"])
        assert int(r["input_bytes"]) == (3 if r["op"] == "fwd" else 4) * b * h * n * d * 2


def test_charts(table_run):
    proc, out = table_run
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(p.name for p in (out / "charts").iterdir())
    assert pngs == sorted(benchmark.chart_name(op, "float16") for op in OPS)
    for name in pngs:
        w, h = png_size(out / "charts" / name)
        assert w > 300 and h > 300
        assert f"PNG: {(out / 'charts' / name).resolve()}" in proc.stdout


def test_json_document(json_run):
    _, doc = json_run
    assert doc["format"] == benchmark.FORMAT
    for key in ("sparktune", "torch", "device", "settings", "wall_s", "results", "unavailable", "files", "warnings", "memory"):
        assert key in doc, key
    assert doc["device"]["type"] == "cpu"
    s = doc["settings"]
    assert s["ops"] == list(OPS) and s["candidates"] == ["dispatch", "own", "flash", "math", "plain"]
    assert s["baseline"] == "math" and s["max_quadratic_bytes"] == 4 << 30
    results = doc["results"]
    assert len(results) == 30
    for r in results:
        assert set(r) == set(benchmark.CSV_FIELDS) | {"tried"}
        assert r["status"] in STATUSES
        if r["status"] == "ok":
            assert r["median_ms"] > 0 and r["tflops"] > 0 and r["kernel"]
        else:
            assert r["reason"]
    dispatch = [r for r in results if r["candidate"] == "dispatch"]
    assert all(r["kernel"].startswith("torch:math") for r in dispatch)  # what dispatch picks on CPU
    groups = {g["candidate"]: g for g in doc["unavailable"]}
    assert set(groups) == {"own", "flash"}
    for g in groups.values():
        assert g["status"] == "unavailable" and g["count"] == 6 and g["reason"]
    assert "spark" in groups["own"]["reason"] and "triton" in groups["own"]["reason"]
    assert doc["files"] == {}


def test_from_json_gives_the_same_table(json_run, tmp_path):
    proc, doc = json_run
    path = tmp_path / "bench.json"
    path.write_text(proc.stdout)
    again = run_cli("--from-json", str(path), "--csv", str(tmp_path / "again.csv"))
    assert again.returncode == 0, again.stderr
    assert "fwd+bwd float16: TFLOP/s and speedup over PyTorch math" in again.stdout
    with open(tmp_path / "again.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["op"], r["candidate"], r["status"]) for r in rows] == [
        (r["op"], r["candidate"], r["status"]) for r in doc["results"]
    ]


# --------------------------------------------------------------------------- in process


def _json(capsys, *argv: str) -> tuple[int, dict, str]:
    code = main(["bench", "--device", "cpu", "--cpu-runs", "1", "--json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else {}, err


def test_quadratic_candidates_skip_above_the_limit(capsys):
    # score matrix B*H*N*N*2 bytes: seqlen 32 (batch 2) 8 KiB, seqlen 64 (batch 1) 16 KiB
    code, doc, _ = _json(capsys, "--seqlens", "32,64", "--head-dims", "16", "--causal", "0", "--heads", "2",
                         "--tokens", "64", "--ops", "fwd", "--candidates", "math,plain",
                         "--max-quadratic-bytes", "8KiB")
    assert code == 0
    by = {(r["seqlen"], r["candidate"]): r for r in doc["results"]}
    for cand in ("math", "plain"):
        assert by[(32, cand)]["status"] == "ok"
        skipped = by[(64, cand)]
        assert skipped["status"] == "skipped" and skipped["median_ms"] is None
        assert skipped["reason"] == "the N^2 score matrix needs 16 KiB, above --max-quadratic-bytes 8 KiB"
    assert {g["candidate"] for g in doc["unavailable"]} == {"math", "plain"}


def test_a_wrong_candidate_is_reported_not_timed(capsys, monkeypatch):
    real = _candidates._plain_forward

    def off_by_a_bit(shape, mask_device):
        make = real(shape, mask_device)
        return lambda: (lambda q, k, v: make()(q, k, v) * 1.01)

    monkeypatch.setattr(_candidates, "_plain_forward", off_by_a_bit)
    code, doc, err = _json(capsys, "--seqlens", "32", "--head-dims", "16", "--heads", "2", "--tokens", "32",
                           "--causal", "0", "--ops", "fwd", "--candidates", "math,plain")
    assert code == 1
    by = {r["candidate"]: r for r in doc["results"]}
    assert by["math"]["status"] == "ok"
    assert by["plain"]["status"] == "wrong" and by["plain"]["median_ms"] is None
    assert "exceeds the bound" in by["plain"]["reason"] and by["plain"]["error"] > by["plain"]["error_limit"]
    assert "1 result(s) failed the reference check: plain plain" in err


def test_recipe(capsys, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "name: tiny\nshapes:\n  - {seqlen: 16, heads: 4, heads_kv: 2, head_dim: 16, batch: [1, 2], "
        "causal: true, dtype: bf16, ops: [fwd]}\n"
    )
    code, doc, _ = _json(capsys, "--recipe", str(recipe), "--candidates", "plain")
    assert code == 0
    assert doc["settings"]["ops"] == ["fwd"]
    got = sorted((r["batch"], r["heads"], r["heads_kv"], r["dtype"], r["causal"], r["status"]) for r in doc["results"])
    assert got == [(1, 4, 2, "bfloat16", True, "ok"), (2, 4, 2, "bfloat16", True, "ok")]


def test_without_matplotlib_the_charts_are_skipped_with_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark, "matplotlib_missing", lambda: True)
    code = main(["bench", "--device", "cpu", "--cpu-runs", "1", "--seqlens", "16", "--head-dims", "16",
                 "--heads", "1", "--tokens", "16", "--causal", "0", "--ops", "fwd", "--candidates", "plain",
                 "--out", str(tmp_path / "charts")])
    out, err = capsys.readouterr()
    assert code == 0
    assert [line for line in err.splitlines() if "matplotlib" in line] == [
        f"sparktune bench: {benchmark.MISSING_MATPLOTLIB}"
    ]
    assert "PNG:" not in out and "fwd float16: TFLOP/s" in out
    assert not (tmp_path / "charts").exists()


def test_no_gpu_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "sparktune bench: no CUDA GPU is available (torch.cuda.is_available() is False); the benchmark "
        "times kernels on a GPU"
    ]


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--seqlens", "512,0"], "--seqlens: expected positive integers, got '0'"),
        (["--seqlens", "512,,1024"], "--seqlens: expected a comma-separated list"),
        (["--head-dims", "x"], "--head-dims: expected positive integers, got 'x'"),
        (["--causal", "maybe"], "--causal: expected 0, 1 or 0,1, got 'maybe'"),
        (["--ops", "fwd,back"], "--ops: unknown 'back'; choose from fwd, bwd, fwd+bwd"),
        (["--candidates", "flash,fa3"], "--candidates: unknown 'fa3'; choose from dispatch, own, flash"),
        (["--dtype", "fp8"], "--dtype: expected float16 and/or bfloat16, got 'fp8'"),
        (["--tokens", "1000", "--seqlens", "512"], "--tokens 1000 is not a multiple of seqlen 512"),
        (["--heads", "0"], "--heads must be a positive integer, got 0"),
        (["--candidates", "math", "--baseline", "flash"], "--baseline 'flash' is not among the candidates (math)"),
        (["--max-quadratic-bytes", "lots"], "--max-quadratic-bytes: expected a size such as 4GiB"),
        (["--recipe", "recipes/gpt2-small.yaml", "--seqlens", "512"], "--seqlens cannot be combined with --recipe"),
        (["--device", "tpu"], "--device: expected cuda, cuda:N or cpu, got 'tpu'"),
        (["--from-json", "/nonexistent/bench.json"], "cannot read /nonexistent/bench.json"),
        (["--csv", "/nonexistent/dir/bench.csv"], "--csv /nonexistent/dir/bench.csv: the directory /nonexistent/dir does not exist"),
    ],
)
def test_argument_errors(capsys, argv, expect):
    assert main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert expect in err and err.startswith("sparktune bench: ") and "Traceback" not in err


def test_recipe_errors_are_listed(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nshapes:\n  - {seqlen: 8, heads: 2, head_dim: big}\n")
    assert main(["bench", "--recipe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: shapes[0].head_dim: expected a positive integer, got 'big'" in err
    assert "sparktune bench: invalid recipe (1 error(s))" in err


def test_from_json_rejects_other_documents(capsys, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"results": []}))
    assert main(["bench", "--from-json", str(other)]) == 2
    assert "not a sparktune bench JSON document" in capsys.readouterr().err


# --------------------------------------------------------------------------- pieces


@pytest.mark.parametrize(
    ("text", "expect"),
    [("4GiB", 4 << 30), ("512M", 512 << 20), ("8k", 8192), ("1e9", 1e9), ("100", 100), ("inf", math.inf),
     ("1.5 GB", 1.5 * (1 << 30))],
)
def test_parse_size(text, expect):
    assert bench_cli.parse_size(text) == expect


def test_default_limit_keeps_8k_and_skips_16k():
    limit = bench_cli.parse_size("4GiB")
    shapes = benchmark.sweep_shapes(dtypes=["float16"], head_dims=[128], causal=[False],
                                    seqlens=list(benchmark.DEFAULT_SEQLENS), heads=12, tokens=16384)
    over = [s.seqlen_q for s in shapes if benchmark.score_bytes(s) > limit]
    assert over == [16384]
    assert [(s.seqlen_q, s.batch) for s in shapes][:2] == [(512, 32), (1024, 16)]


def test_flops_follow_anchors():
    for s in benchmark.sweep_shapes(dtypes=["float16"], head_dims=[64, 128], causal=[False, True],
                                    seqlens=[512, 4096], heads=12, tokens=16384):
        for op in OPS:
            assert benchmark.case_flops(s, op) == pytest.approx(
                fa_flops(s.batch, s.heads_q, s.seqlen_q, s.head_dim, s.causal, op)
            )


def test_own_takes_the_fastest_runnable_record_of_its_backend():
    recs = [
        SimpleNamespace(backend="torch", config="cudnn"),
        SimpleNamespace(backend="triton", config="tfwd_broken"),
        SimpleNamespace(backend="triton", config="tfwd_m128n64_w8s3"),
        SimpleNamespace(backend="triton", config="tfwd_m64n64_w4s3"),
    ]
    pick = benchmark.pick_tuned(recs, "triton", lambda c: c != "tfwd_broken")
    assert pick is recs[2]
    assert benchmark.pick_tuned(recs, "spark", lambda c: True) is None


# --------------------------------------------------------------------------- own, with stand-ins


class _StandIn(Backend):
    """A backend computing the float32 reference, its forward output scaled by ``factor``
    (1: right)."""

    tunable = True

    def __init__(self, name: str, *, factor: float = 1.0) -> None:
        self.name, self.factor = name, factor

    def configs(self, op: str = "fwd"):
        return ("fa", "fb") if op == "fwd" else ("ba",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if config is None or config in self.configs(problem.op) else [f"no config {config}"]

    def default_config(self, problem, device=None):
        return self.configs(problem.op)[0]

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        o, lse = reference_attention(q, k, v, causal, scale, torch.float32)
        out.copy_(o * self.factor)
        return lse.float()

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, *, config, causal, scale):
        for dst, src in zip((dq, dk, dv), reference_attention_backward(dout, q, k, v, causal, scale, torch.float32), strict=True):
            dst.copy_(src)


def _own_sweep(monkeypatch, tmp_path, spark: Backend, triton: Backend):
    shape = Problem("fwd", "float16", 2, 2, 2, 16, 16, 16, True)
    db = tmp_path / "tuned.sqlite3"
    with Store(db) as store:
        store.add([
            record(shape, backend="triton", config="fa", median=2.0, device=DEVICE, build=dispatch.build_id()),
            record(shape, backend="triton", config="fb", median=1.0, device=DEVICE, build=dispatch.build_id()),
            record(shape, backend="triton", config="fa", median=0.1, device=OTHER_DEVICE, build=dispatch.build_id()),
        ])
    monkeypatch.setattr(_candidates.Context, "registered", lambda self: {"spark": spark, "triton": triton})
    settings = benchmark.SweepSettings(ops=("fwd", "fwd+bwd"), candidates=("own",), baseline="",
                                       torch_device="cpu", db=str(db))
    # spark's kernels cost 2 ms a run, triton's 1 ms (each still runs once through the timer)
    timer = CostTimer(lambda c, p: 2.0 if c.backend == "spark" else 1.0, runs=3)
    sweep = benchmark.Sweep([shape], settings, timer=timer, device=DEVICE)
    return sweep.run()


def test_own_is_the_faster_backend_with_its_tuned_config(monkeypatch, tmp_path):
    report = _own_sweep(monkeypatch, tmp_path, _StandIn("spark"), _StandIn("triton"))
    fwd, both = report.rows
    assert fwd.status == "ok" and fwd.kernel == "triton:fb (tuned)"
    assert both.status == "ok" and both.kernel == "triton:fb + triton:ba (fwd tuned, bwd default)"
    for row in (fwd, both):
        tried = {t["kernel"].split(":")[0]: t for t in row.tried}
        assert set(tried) == {"spark", "triton"} and all(t["status"] == "ok" for t in tried.values())
        assert tried["spark"]["median_ms"] > tried["triton"]["median_ms"] == row.median_ms
        assert tried["spark"]["kernel"].startswith("spark:fa")  # no tuned record: the default
    assert report.wrong() == []
    assert report.meta["tuning_store"]["note"] == ""


def test_own_reports_a_wrong_backend_and_uses_the_other(monkeypatch, tmp_path):
    report = _own_sweep(monkeypatch, tmp_path, _StandIn("spark", factor=1.05), _StandIn("triton"))
    fwd, both = report.rows
    for row in (fwd, both):
        assert row.status == "ok" and row.kernel.startswith("triton:fb")
        spark = next(t for t in row.tried if t["kernel"].startswith("spark"))
        assert spark["status"] == "wrong" and "out: max abs error" in spark["reason"]
    assert len(report.wrong()) == 2
    text = benchmark.render_table(report)
    assert "own (spark:fa (default)) wrong in 1 case(s): op fwd;" in text


def test_tuning_store_that_cannot_be_read_is_a_note(tmp_path):
    missing = benchmark.TunedRecords(DEVICE, tmp_path / "none.sqlite3")
    assert missing.note == "" and missing.where.endswith("(no database)")
    broken = tmp_path / "broken.sqlite3"
    broken.write_bytes(b"this is not a database" * 100)
    tuned = benchmark.TunedRecords(DEVICE, broken)
    assert tuned.note.startswith("cannot read the tuning database") and tuned.get(Problem("fwd", "float16", 1, 2, 2, 16, 16, 16, False)) == []


def test_passes_alternate_the_order_and_keep_the_faster_median(tmp_path):
    """Two passes: the candidates in order, then reversed; each keeps its faster pass."""
    shape = Problem("fwd", "float16", 1, 2, 2, 16, 16, 16, False)
    calls: list[str] = []
    # the candidate timed first in a pass pays 3 ms, the other 1 ms
    timer = CostTimer(lambda c, p: 3.0 if len(calls) in (1, 3) else 1.0, runs=3)
    settings = benchmark.SweepSettings(ops=("fwd",), candidates=("math", "plain"), baseline="",
                                       torch_device="cpu", db=str(tmp_path / "none.sqlite3"), passes=2)
    sweep = benchmark.Sweep([shape], settings, timer=timer, device=None)
    real = sweep._run_candidate

    def run_candidate(shape, op, cand, *args):
        calls.append(cand)
        return real(shape, op, cand, *args)

    sweep._run_candidate = run_candidate
    report = sweep.run()
    assert calls == ["math", "plain", "plain", "math"]
    assert [r.candidate for r in report.rows] == ["math", "plain"]
    for row in report.rows:
        assert row.status == "ok" and row.passes == 2
        assert row.median_ms == pytest.approx(1.0, rel=0.02), row
    one = benchmark.SweepSettings(ops=("fwd",), candidates=("math", "plain"), baseline="",
                                  torch_device="cpu", db=str(tmp_path / "none.sqlite3"), passes=1)
    calls.clear()
    sweep = benchmark.Sweep([shape], one, timer=timer, device=None)
    real = sweep._run_candidate
    sweep._run_candidate = run_candidate
    rows = {r.candidate: r for r in sweep.run().rows}
    assert calls == ["math", "plain"] and rows["math"].median_ms == pytest.approx(3.0, rel=0.02)
