"""Distributed tuning across processes against PostgreSQL: eight workers at once over one
recipe; a worker killed with SIGKILL mid-problem; the database server restarted mid-run.

The workers are forked from one process that imported torch once (tests/_cluster_worker.py);
each runs ``sparktune tune --recipe ...`` through the command line's code with the known-cost
backend and a cost timer that sleeps a little per measurement and logs it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from sparktune import dispatch
from sparktune.cli import build_parser
from sparktune.cli import tune as tune_cli
from sparktune.db import Store, problem_key
from sparktune.tune import CostTimer, LeaseBoard
from tests._pg import admin_url, pg_url, terminate_connections, with_password  # noqa: F401 - fixture
from tests._store_helpers import DEVICE, known_cost, registered_plugin

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_cluster_worker.py"
SECRET = "pw-never-shown-7f3a"

pytestmark = pytest.mark.slow


def _recipe(path: Path, seqlens: list[int], causal=(False, True)) -> Path:
    path.write_text(
        "name: cluster-test\nbackends: [knowncost]\nshapes:\n"
        f"  - {{seqlen: {list(seqlens)}, heads: 1, head_dim: 16, ops: fwd, causal: {list(causal)}}}\n".replace("False", "false").replace("True", "true")
    )
    return path


class Cluster:
    """The forked workers of one test."""

    def __init__(self, tmp: Path, *, db: str, recipe: Path, workers: int, delay_s: float, args: list[str]):
        self.out = tmp / "out"
        cfg = tmp / "cluster.json"
        cfg.write_text(json.dumps({"out": str(self.out), "workers": workers, "recipe": str(recipe), "db": db,
                                   "delay_s": delay_s, "args": args}))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARKTUNE_SHIPPED_DB": ""}
        env.pop("SPARKTUNE_DB", None)
        self.workers = workers
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(cfg)], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pids = self._wait_for_pids()

    def _wait_for_pids(self) -> dict[int, int]:
        deadline = time.monotonic() + 120
        path = self.out / "pids.json"
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker launcher died: {self.proc.stdout.read()}")
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        return {int(k): v for k, v in json.loads(path.read_text()).items()}

    def wait(self, timeout: float = 240) -> None:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the workers did not finish:\n" + self.stderr_all()) from None
        assert self.proc.returncode == 0, out

    def kill(self) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()

    def code(self, i: int) -> int | None:
        f = self.out / f"w{i}.code"
        return int(f.read_text()) if f.exists() else None

    def stdout(self, i: int) -> str:
        return (self.out / f"w{i}.out").read_text()

    def stderr(self, i: int) -> str:
        return (self.out / f"w{i}.err").read_text()

    def stderr_all(self) -> str:
        return "\n".join(f"--- w{i}\n{self.stderr(i)}" for i in range(self.workers) if (self.out / f"w{i}.err").exists())

    def json(self, i: int) -> dict:
        return json.loads(self.stdout(i))

    def measured(self, i: int | None = None) -> list[tuple[str, str]]:
        out = []
        for j in range(self.workers) if i is None else [i]:
            f = self.out / f"w{j}.measured"
            if f.exists():
                out += [tuple(line.split("\t")) for line in f.read_text().splitlines() if line]
        return out


def _assert_every_problem_once(store: Store, keys: set[str], candidates: int) -> None:
    """Every problem done, its records committed once: one record per candidate."""
    rows = LeaseBoard(store).rows()
    assert {r.label.split(" | ")[0] for r in rows} == keys
    assert all(r.state == "done" and r.records == candidates for r in rows), rows
    per = Counter((problem_key(r.problem), r.label) for r in store.records())
    assert {k for k, _ in per} == keys
    assert len(per) == len(keys) * candidates and set(per.values()) == {1}, per


def _assert_no_secret(cluster: Cluster) -> None:
    for i in range(cluster.workers):
        for f in cluster.out.glob(f"w{i}.*"):
            assert SECRET not in f.read_text(), f


def _keys(recipe_problems) -> set[str]:
    return {problem_key(p) for p in recipe_problems}


def _problems(recipe: Path):
    from sparktune.tune import load_recipe

    return load_recipe(recipe).problems


def test_eight_workers_tune_every_problem_exactly_once(tmp_path, pg_url, monkeypatch):  # noqa: F811
    recipe = _recipe(tmp_path / "r.yaml", [16, 24, 32, 40, 48])
    keys = _keys(_problems(recipe))
    db = with_password(pg_url, SECRET)
    cluster = Cluster(tmp_path, db=db, recipe=recipe, workers=8, delay_s=0.02,
                      args=["--lease", "10", "--exclude", "*:slow", "--exclude", "*:long"])
    cluster.wait()
    assert [cluster.code(i) for i in range(8)] == [0] * 8, cluster.stderr_all()
    # no problem measured twice, none left out: each timed candidate of each problem once
    measured = Counter(cluster.measured())
    assert set(measured.values()) == {1} and {k for k, _ in measured} == keys
    assert len(measured) == 2 * len(keys)  # fast and medium are timed; wrong and crash never are
    # each problem tuned by exactly one worker, and every worker's output agrees
    tuned = [p["key"] for i in range(8) for p in cluster.json(i)["cluster"]["problems"] if p["state"] == "tuned"]
    assert sorted(tuned) == sorted(keys)
    for i in range(8):
        data = cluster.json(i)
        assert {p["state"] for p in data["cluster"]["problems"]} <= {"tuned", "done"}
        assert SECRET not in json.dumps(data) and "***" in data["database"]
    _assert_no_secret(cluster)
    with Store(pg_url) as store:
        _assert_every_problem_once(store, keys, candidates=4)
        assert all(r.attempts == 1 for r in LeaseBoard(store).rows())
    # dispatch on a node reads the shared database: the winner of every problem (for the
    # kernel build the workers saw)
    with Store(pg_url) as store:
        builds = {r.build_id for r in store.records()}
    assert len(builds) == 1
    monkeypatch.setattr(dispatch, "build_id", lambda: next(iter(builds)))
    with registered_plugin(pg_url):
        for p in _problems(recipe):
            sel = dispatch.select(p, DEVICE)
            assert (sel.candidate.label, sel.source) == ("knowncost:fast", "tuned")
    # a rerun skips everything
    timer = CostTimer(known_cost)
    args = build_parser().parse_args(["tune", "--recipe", str(recipe), "--db", db, "--json", "--no-progress",
                                      "--exclude", "*:slow", "--exclude", "*:long"])
    problems, extra = tune_cli.problems_from_args(args)
    with registered_plugin(pg_url):
        assert tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=timer) == 0
    assert timer.calls == []


def test_a_killed_worker_loses_nothing_committed_and_its_problem_is_taken_over(tmp_path, pg_url):  # noqa: F811
    recipe = _recipe(tmp_path / "r.yaml", [16, 24, 32, 40], causal=[False])
    keys = _keys(_problems(recipe))
    cluster = Cluster(tmp_path, db=pg_url, recipe=recipe, workers=2, delay_s=0.4,
                      args=["--lease", "2", "--exclude", "*:slow", "--exclude", "*:long"])
    try:
        with Store(pg_url) as store:
            board = LeaseBoard(store)
            deadline = time.monotonic() + 120
            victim = None
            while victim is None:  # a worker that committed a problem and is half-way through another
                rows = board.rows()
                for i, pid in cluster.pids.items():
                    mine = [r for r in rows if f":{pid}:" in r.owner]
                    done = [r for r in mine if r.state == "done"]
                    running = [r for r in mine if r.state == "running"]
                    if done and running:
                        key = running[0].label.split(" | ")[0]
                        # the second measurement is in flight: the first one is in the study
                        if sum(1 for k, _ in cluster.measured(i) if k == key) >= 2:
                            victim, survivor = i, 1 - i
                            break
                assert cluster.proc.poll() is None and time.monotonic() < deadline, cluster.stderr_all()
                time.sleep(0.02)
            committed = {r.label.split(" | ")[0] for r in done}
            records_before = {r.uid for r in store.records() if problem_key(r.problem) in committed}
            os.kill(cluster.pids[victim], signal.SIGKILL)
        cluster.wait()
    finally:
        if cluster.proc.poll() is None:
            cluster.kill()
    vpid = cluster.pids[victim]
    assert cluster.code(victim) is None and cluster.code(survivor) == 0, cluster.stderr_all()
    with Store(pg_url) as store:
        _assert_every_problem_once(store, keys, candidates=4)
        rows = {r.label.split(" | ")[0]: r for r in LeaseBoard(store).rows()}
        # what the killed worker had committed is all there, still its own
        assert {r.uid for r in store.records() if problem_key(r.problem) in committed} == records_before
        assert all(f":{vpid}:" in rows[k].owner and rows[k].attempts == 1 for k in committed)
        # its unfinished problem was finished by the other worker, after the lease expired
        taken = rows[key]
        assert taken.attempts == 2 and f":{cluster.pids[survivor]}:" in taken.owner
    (o,) = [p for p in cluster.json(survivor)["cluster"]["problems"] if p["key"] == key]
    assert o["state"] == "tuned" and f":{vpid}:" in o["taken_over_from"] and o["resumed_trials"] >= 1
    assert "taking over from" in cluster.stderr(survivor)
    # the measurements the dead worker had finished were not repeated: at most the one in flight
    before = [c for k, c in cluster.measured(victim) if k == key]
    again = [c for k, c in cluster.measured(survivor) if k == key]
    assert len(before) + len(again) <= 2 + 1 and not set(again) & set(before[:-1]), (before, again)


def _restart_server() -> str:
    """Restart the local PostgreSQL cluster serving the tests (pg_ctlcluster, as root); where
    that is not possible, end every connection to it instead. Returns what was done."""
    url = sa.engine.make_url(admin_url())
    local = url.host in ("127.0.0.1", "localhost", None) and shutil.which("pg_lsclusters") and os.geteuid() == 0
    if local:
        listing = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True).stdout
        for line in listing.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == str(url.port or 5432) and parts[3] == "online":
                subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", parts[0], parts[1], "restart"],
                               check=True, capture_output=True, timeout=60)
                return f"restarted PostgreSQL {parts[0]}/{parts[1]}"
    return "not restartable here"


def test_server_restarted_mid_run(tmp_path, pg_url):  # noqa: F811
    recipe = _recipe(tmp_path / "r.yaml", [16, 24, 32, 40, 48], causal=[False])
    keys = _keys(_problems(recipe))
    db = with_password(pg_url, SECRET)
    cluster = Cluster(tmp_path, db=db, recipe=recipe, workers=3, delay_s=0.15,
                      args=["--lease", "20", "--reconnect", "60", "--exclude", "*:slow", "--exclude", "*:long"])
    try:
        with Store(pg_url) as store:
            board = LeaseBoard(store)
            deadline = time.monotonic() + 120
            while sum(r.state == "done" for r in board.rows()) < 2:
                assert time.monotonic() < deadline, cluster.stderr_all()
                time.sleep(0.05)
        how = _restart_server()
        if how == "not restartable here":
            dbname = sa.engine.make_url(pg_url).database
            how = f"ended {terminate_connections(dbname)} connection(s) with pg_terminate_backend"
        print(how)
        cluster.wait()
    finally:
        if cluster.proc.poll() is None:
            cluster.kill()
    assert [cluster.code(i) for i in range(3)] == [0] * 3, cluster.stderr_all()
    with Store(pg_url) as store:
        _assert_every_problem_once(store, keys, candidates=4)
    errs = cluster.stderr_all()
    print(errs)
    assert re.search(r"reconnected to the tuning database|went away mid-study|lost the tuning database", errs) or \
        "pg_terminate_backend" in how, errs
    assert "Traceback" not in errs
    _assert_no_secret(cluster)
