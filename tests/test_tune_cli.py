"""`sparktune tune`: arguments, recipes, the no-GPU message, the table and --json output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparktune.cli import build_parser, main
from sparktune.cli import tune as tune_cli
from sparktune.db import Store
from sparktune.problem import Problem
from sparktune.tune import CostTimer
from tests._store_helpers import DEVICE, known_cost, registered_plugin

ROOT = Path(__file__).resolve().parent.parent


def test_no_gpu_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--seqlen", "8192", "--heads", "12"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "sparktune tune: no CUDA GPU is available (torch.cuda.is_available() is False); "
        "tuning measures kernels on the GPU they will run on"
    ]


def test_defaults_of_the_readme_example():
    args = build_parser().parse_args(["tune", "--seqlen", "8192", "--heads", "12"])
    problems, extra = tune_cli.problems_from_args(args)
    assert problems == [
        Problem("fwd", "float16", 1, 12, 12, 8192, 8192, 128, False),
        Problem("bwd", "float16", 1, 12, 12, 8192, 8192, 128, False),
    ]
    assert extra == {}


def test_op_keeps_that_op_of_a_recipe():
    recipe = ROOT / "recipes" / "fa2-long-sequence.yaml"
    every, _ = tune_cli.problems_from_args(build_parser().parse_args(["tune", "--recipe", str(recipe)]))
    assert {p.op for p in every} == {"fwd", "bwd"}
    for op in ("fwd", "bwd"):
        args = build_parser().parse_args(["tune", "--recipe", str(recipe), "--op", op])
        problems, _ = tune_cli.problems_from_args(args)
        assert problems == [p for p in every if p.op == op]
    both = build_parser().parse_args(["tune", "--recipe", str(recipe), "--op", "both"])
    assert tune_cli.problems_from_args(both)[0] == every


def test_op_of_a_recipe_without_it_is_an_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: fwd-only\ndefaults:\n  heads: 4\n  head_dim: 64\n  ops: [fwd]\nshapes:\n  - seqlen: [128]\n")
    args = build_parser().parse_args(["tune", "--recipe", str(recipe), "--op", "bwd"])
    with pytest.raises(ValueError, match="has no bwd problem"):
        tune_cli.problems_from_args(args)


def test_every_shape_option():
    args = build_parser().parse_args([
        "tune", "--seqlen", "100", "--seqlen-k", "300", "--batch", "3", "--heads", "8", "--heads-kv", "2",
        "--head-dim", "64", "--causal", "--dtype", "bf16", "--op", "bwd", "--allow-fp16-accum",
    ])
    (p,) = tune_cli.problems_from_args(args)[0]
    assert p == Problem("bwd", "bfloat16", 3, 8, 2, 100, 300, 64, True, True)


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["tune", "--heads", "12"], "--seqlen required"),
        (["tune", "--seqlen", "1", "--heads", "12", "--dtype", "fp8"], "--dtype must be one of"),
        (["tune", "--seqlen", "1", "--heads", "12", "--heads-kv", "5"], "multiple of heads_kv"),
    ],
)
def test_argument_errors(capsys, argv, expect):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_recipe_errors_without_a_gpu(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nshapes:\n  - {seqlen: 8, heads: 2, head_dim: big}\n")
    assert main(["tune", "--recipe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: shapes[0].head_dim: expected a positive integer, got 'big'" in err
    assert "invalid recipe (1 error(s))" in err


def _run(tmp_path, argv):
    db = tmp_path / "cli.sqlite3"
    args = build_parser().parse_args(["tune", *argv, "--db", str(db), "--no-progress"])
    problems, extra = tune_cli.problems_from_args(args)
    with registered_plugin(db):
        code = tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))
    return code, db


SHAPE = ["--seqlen", "64", "--heads", "2", "--head-dim", "64", "--backend", "knowncost"]


def test_table_output(tmp_path, capsys):
    code, db = _run(tmp_path, SHAPE)
    out = capsys.readouterr().out
    assert code == 0
    fwd, bwd = out.split("\nfwd:")[1], out.split("\nbwd:")[1]
    assert "exhaustive, 7 trials" in fwd and "PyTorch SDPA default" in fwd
    first = fwd.splitlines()[2].split()
    assert first[:2] == ["1", "knowncost:d64only"] and first[5] == "6.00x"
    assert "wrong: knowncost:wrong: out: max abs error" in fwd
    assert "failed: knowncost:crash: while checking: RuntimeError" in fwd
    assert "knowncost:bwd_fast" in bwd
    assert "2 problem(s) tuned" in out
    with Store(db) as s:
        assert s.count() == 10


def test_json_output_and_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: tiny\nbudget: {trials: 3}\nbackends: [knowncost]\n"
        "shapes:\n  - {seqlen: [32, 64], heads: 2, head_dim: 32, ops: fwd}\n"
    )
    code, _ = _run(tmp_path, ["--recipe", str(recipe), "--json", "--optuna-storage", "memory"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["problem"]["seqlen_q"] for r in data["results"]] == [32, 64]
    for r in data["results"]:
        assert r["mode"] == "tpe" and len(r["candidates"]) == 3 and r["trials"] >= 3
        assert r["best"]["status"] == "ok" and r["best"]["speedup_vs_sdpa"] > 0
    assert "cli.sqlite3" in data["database"]
