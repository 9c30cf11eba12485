"""`sparktune tune`: budget and lease numbers checked before anything else (also without a
GPU); a database that fails under a tuning run stops it with one line, never a traceback."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
import torch

from sparktune.cli import build_parser, main
from sparktune.cli import tune as tune_cli
from sparktune.db import Store
from sparktune.tune import CostTimer, Tuner
from tests._store_helpers import DEVICE, known_cost, registered_plugin

SHAPE = ["--seqlen", "64", "--heads", "2", "--head-dim", "64", "--op", "fwd", "--backend", "knowncost"]


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["--timeout", "-1"], "--timeout must be more than 0, got -1"),
        (["--timeout", "0"], "--timeout must be more than 0, got 0"),
        (["--timeout", "nan"], "--timeout must be more than 0, got nan"),
        (["--trials", "0"], "--trials must be at least 1, got 0"),
        (["--lease", "0"], "--lease must be more than 0, got 0"),
        (["--reconnect", "-5"], "--reconnect must be at least 0, got -5"),
        (["--top", "-1"], "--top must be at least 0, got -1"),
    ],
)
def test_budget_numbers_are_checked_first(capsys, monkeypatch, extra, expect):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", *SHAPE, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [f"sparktune tune: {expect}"]


def test_tuner_refuses_a_negative_timeout():
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), timeout=-1.0)


def _args(tmp_path, *argv):
    db = tmp_path / "t.sqlite3"
    args = build_parser().parse_args(["tune", *SHAPE, *argv, "--db", str(db), "--no-progress"])
    problems, extra = tune_cli.problems_from_args(args)
    return args, problems, extra, db


def test_a_database_failure_while_tuning_is_one_line(tmp_path, capsys, monkeypatch):
    args, problems, extra, db = _args(tmp_path)

    def broken(self, records):
        raise sa.exc.OperationalError("INSERT INTO sparktune_records ...", {}, Exception("database disk image is malformed"))

    monkeypatch.setattr(Store, "add", broken)
    with registered_plugin(db):
        code = tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))
    out, err = capsys.readouterr()
    assert code == 3 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("sparktune tune:")]
    assert "the tuning database" in line and "database disk image is malformed" in line and "stopping" in line


def test_other_errors_are_not_taken_for_database_errors(tmp_path, monkeypatch):
    args, problems, extra, db = _args(tmp_path)

    def broken(self, problem, *, resume=False):
        raise KeyError("a bug, not the database")

    monkeypatch.setattr(Tuner, "tune", broken)
    with registered_plugin(db), pytest.raises(KeyError, match="a bug"):
        tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))


def test_outputs_the_check_cannot_compare_fail_that_candidate_only(tmp_path):
    from sparktune import registry
    from tests._store_helpers import plugin_module, problem

    class OddLse(plugin_module().KnownCostBackend):
        def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
            lse = super().forward(q, k, v, out, config=config, causal=causal, scale=scale, need_lse=need_lse)
            return lse.tolist() if config == "fast" else lse  # not a tensor: the check cannot compare it

    with Store(tmp_path / "s.sqlite3") as store, registered_plugin(tmp_path / "s.sqlite3"):
        registry.register_backend(OddLse(), replace=True)
        tuner = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), store=store,
                      backends=["knowncost"], exclude=["*:crash", "*:wrong"])
        result = tuner.tune(problem(batch=1, heads_q=1, heads_kv=1, seqlen_q=16, seqlen_k=16, head_dim=64))
        status = {m.candidate.config: (m.status, m.message) for m in result.measurements}
        assert status["fast"][0] == "failed" and "while checking its outputs" in status["fast"][1]
        assert result.best.candidate.config == "d64only"
        assert {r.config: r.status for r in store.records()}["fast"] == "failed"


def test_an_unknown_backend_to_tune_is_named(tmp_path, capsys):
    args, problems, extra, db = _args(tmp_path, "--backend", "knowncots")
    with registered_plugin(db):
        code = tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))
    err = capsys.readouterr().err
    assert code == 2 and "unknown backend 'knowncots' to tune; registered backends: " in err and "knowncost" in err
