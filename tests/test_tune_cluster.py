"""Distributed tuning in one process: leases divide the problems, a rerun skips what is done, a
crashed worker's problem is taken over and its study resumed, a worker that lost its lease
cannot commit, and a database that goes away mid-study is waited for (or the worker stops with
a clear message). The multi-process tests are in test_tune_cluster_procs.py."""

from __future__ import annotations

import json

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from sparktune import dispatch
from sparktune.cli import build_parser
from sparktune.cli import tune as tune_cli
from sparktune.db import Store, problem_key
from sparktune.tune import (
    CostTimer,
    DatabaseUnavailable,
    LeaseBoard,
    Tuner,
    Worker,
    work_id,
    work_label,
)
from tests._pg import pg_url, terminate_connections, with_password  # noqa: F401 - fixture
from tests._store_helpers import DEVICE, ServerClock, known_cost, problem, registered_plugin

SMALL = {"batch": 1, "heads_q": 1, "heads_kv": 1, "head_dim": 16}
# four candidates, two of them timed (wrong and crash never are)
EXCLUDE = ["*:slow", "*:long"]


def _problems(n=3):
    return [problem(**SMALL, seqlen_q=16 * (i + 1), seqlen_k=16 * (i + 1)) for i in range(n)]


class CountingTimer(CostTimer):
    def __init__(self, hook=None):
        super().__init__(known_cost)
        self.hook = hook
        self.measured = []

    def measure(self, fn, *, candidate=None, problem):
        t = super().measure(fn, candidate=candidate, problem=problem)
        if candidate is not None and candidate.label != "sdpa:default":
            self.measured.append((problem_key(problem), candidate.label))
            if self.hook is not None:
                self.hook(problem, candidate, len(self.measured))
        return t


def _worker(store, *, timer=None, storage=True, **kw):
    tuner = Tuner(device=DEVICE, torch_device="cpu", timer=timer or CountingTimer(), backends=["knowncost"],
                  exclude=EXCLUDE, storage=store.url if storage else None, baseline=False)
    kw.setdefault("lease_s", 5.0)
    kw.setdefault("poll_s", 0.05)
    return Worker(tuner, store, say=kw.pop("say", None), **kw)


@pytest.fixture
def sqlite_store(tmp_path):
    s = Store(tmp_path / "cluster.sqlite3")
    with registered_plugin(s.url):
        yield s
    s.close()


@pytest.fixture
def pg_store(pg_url):  # noqa: F811
    s = Store(pg_url)
    with registered_plugin(s.url):
        yield s
    s.close()


@pytest.fixture
def server_clock():
    """The lease table's clock, moved only by the test (apart from the test's monkeypatch,
    which _dead_attempt undoes)."""
    with pytest.MonkeyPatch.context() as mp:
        yield ServerClock(mp)


def _per_candidate(store):
    counts = {}
    for r in store.records():
        k = (problem_key(r.problem), r.label)
        counts[k] = counts.get(k, 0) + 1
    return counts


def test_two_workers_divide_and_a_rerun_skips(sqlite_store):
    problems = _problems(3)
    a, b = _worker(sqlite_store, wait=False), _worker(sqlite_store, wait=False)
    # a takes the first problem; b, started meanwhile, must leave it to a
    first = a.board.claim(work_id("", work_label(problems[0], a.tuner, Tuner.space_id(a.tuner.plan(problems[0])[0]))),
                          "x")
    assert first is not None
    rb = b.run_problems(problems)
    assert [o.state for o in rb.outcomes] == ["running", "tuned", "tuned"]
    assert rb.outcomes[0].owner == a.owner
    a.board.release(first.work)  # (the hand-made claim had the wrong label: start clean)
    ra = a.run_problems(problems)
    assert [o.state for o in ra.outcomes] == ["tuned", "done", "done"]
    assert {o.owner for o in ra.outcomes[1:]} == {b.owner}
    counts = _per_candidate(sqlite_store)
    assert len(counts) == 3 * 4 and set(counts.values()) == {1}
    # a rerun (another worker, same run name) tunes nothing; a new run name tunes again
    c = _worker(sqlite_store)
    rc = c.run_problems(problems)
    assert [o.state for o in rc.outcomes] == ["done"] * 3 and c.tuner.timer.measured == []
    d = _worker(sqlite_store, run="again")
    assert [o.state for o in d.run_problems(problems).outcomes] == ["tuned"] * 3
    rows = LeaseBoard(sqlite_store).rows()
    assert sorted({r.run for r in rows}) == ["", "again"] and all(r.state == "done" for r in rows)
    assert all(r.records == 4 for r in rows)
    # dispatch sees the winners at once
    sel = dispatch.select(problems[1], DEVICE)
    assert (sel.candidate.label, sel.source) == ("knowncost:fast", "tuned")


def _dead_attempt(store, p, *, finish_trials, monkeypatch, clock):
    """What a worker killed mid-study leaves behind: its lease (expired, ``clock`` moved past
    it), its study with ``finish_trials`` finished trials and one still running."""
    dead = _worker(store, lease_s=0.05)
    tuner = dead.tuner
    order, _, _ = tuner.plan(p)
    label = work_label(p, tuner, Tuner.space_id(order))
    claim = dead.board.claim(work_id("", label), label)
    assert claim is not None
    seen = []

    def stop(problem, candidate, n):
        seen.append(candidate.label)
        if len(seen) > finish_trials:
            # nothing after this point reaches the database, as with SIGKILL
            monkeypatch.setattr(optuna.study.Study, "tell", lambda *a, **k: None)
            raise SystemExit("killed")

    tuner.timer = CountingTimer(stop)
    with pytest.raises(SystemExit):
        tuner.tune(p, resume=True)
    monkeypatch.undo()
    clock.advance(0.1)  # no heartbeat comes: the lease expires
    return dead, seen


def test_takeover_resumes_the_dead_workers_study(sqlite_store, monkeypatch, server_clock):
    p = _problems(1)[0]
    dead, seen = _dead_attempt(sqlite_store, p, finish_trials=1, monkeypatch=monkeypatch, clock=server_clock)
    # the trial that was running when it died is RUNNING in the study, and nothing is committed
    assert sqlite_store.records(problem=p) == []
    storage = optuna.storages.RDBStorage(sqlite_store.url.render_as_string(hide_password=False))
    (summary,) = [s for s in optuna.get_all_study_summaries(storage) if problem_key(p) in s.study_name]
    states = [t.state for t in optuna.load_study(study_name=summary.study_name, storage=storage).trials]
    assert TrialState.RUNNING in states

    taker = _worker(sqlite_store)
    report = taker.run_problems([p])
    (o,) = report.outcomes
    assert (o.state, o.attempt, o.taken_over_from) == ("tuned", 2, dead.owner)
    assert o.resumed == 1  # the one trial the dead worker finished
    # the candidate finished before the crash is not measured again; the one in flight is
    assert (problem_key(p), seen[0]) not in taker.tuner.timer.measured
    assert (problem_key(p), seen[1]) in taker.tuner.timer.measured
    counts = _per_candidate(sqlite_store)
    assert len(counts) == 4 and set(counts.values()) == {1}
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    assert TrialState.RUNNING not in [t.state for t in study.trials]
    assert sum(t.state == TrialState.FAIL and "sparktune" not in t.user_attrs for t in study.trials) == 1
    lease = LeaseBoard(sqlite_store).rows()[0]
    assert (lease.state, lease.owner, lease.attempts, lease.records) == ("done", taker.owner, 2, 4)


def test_a_worker_that_lost_its_lease_cannot_commit(sqlite_store, server_clock):
    p = _problems(1)[0]
    clock = server_clock
    slow = _worker(sqlite_store, lease_s=0.3)
    other = _worker(sqlite_store)

    def stall(problem, candidate, n):
        if n == 1:  # the heartbeat is late (a stalled process): the lease is taken over meanwhile
            slow_hb_lost = other.board.claim(*_work(slow, p))
            assert slow_hb_lost is None  # not yet: the lease is still alive
            clock.advance(0.4)
            taken = other.board.claim(*_work(slow, p))
            assert taken is not None and taken.previous_owner == slow.owner

    # the heartbeat would renew the lease; silence it to play a stalled process
    slow.board.renew = lambda work: True
    slow.tuner.timer = CountingTimer(stall)
    (o,) = slow.run_problems([p]).outcomes
    assert o.state == "lost" and "discarded" in o.message
    assert sqlite_store.records(problem=p) == []
    assert other.board.finish(_work(slow, p)[0], []) is True


def _work(worker, p):
    order, _, _ = worker.tuner.plan(p)
    label = work_label(p, worker.tuner, Tuner.space_id(order))
    return work_id(worker.run, label), label


def test_failed_problem_is_committed_and_stops_the_worker(sqlite_store, monkeypatch):
    problems = _problems(2)
    w = _worker(sqlite_store)
    monkeypatch.setattr(Tuner, "_cuda_alive", lambda self: "CUDA error: an illegal memory access")
    report = w.run_problems(problems)
    assert [o.state for o in report.outcomes] == ["failed", "pending"]
    assert "illegal memory access" in report.stopped
    lease = LeaseBoard(sqlite_store).get(_work(w, problems[0])[0])
    assert lease.state == "failed" and "illegal memory access" in lease.message
    # what was measured before the failure is kept, the crashed candidate included
    assert {r.config for r in sqlite_store.records(problem=problems[0])} >= {"crash"}
    # other workers leave a failed problem alone unless asked
    monkeypatch.undo()
    again = _worker(sqlite_store, wait=False)
    assert [o.state for o in again.run_problems(problems).outcomes] == ["failed", "tuned"]
    retry = _worker(sqlite_store, retry_failed=True)
    assert [o.state for o in retry.run_problems(problems).outcomes] == ["tuned", "done"]


def test_cli_recipe_uses_leases(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: c\nbackends: [knowncost]\nshapes:\n  - {seqlen: [16, 32], heads: 1, head_dim: 16, ops: fwd}\n")
    db = tmp_path / "c.sqlite3"

    def run(*extra):
        args = build_parser().parse_args(["tune", "--recipe", str(recipe), "--db", str(db), "--no-progress",
                                          "--exclude", "*:slow", "--exclude", "*:long", *extra])
        problems, ex = tune_cli.problems_from_args(args)
        with registered_plugin(db):
            code = tune_cli.run(args, problems, ex, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))
        return code, capsys.readouterr()

    code, cap = run()
    assert code == 0 and "2 tuned here" in cap.out and cap.err.count(": tuning") == 2
    code, cap = run("--json")
    data = json.loads(cap.out)
    assert code == 0 and data["results"] == []
    assert [p["state"] for p in data["cluster"]["problems"]] == ["done", "done"]
    code, cap = run("--run", "second", "--json")
    assert [p["state"] for p in json.loads(cap.out)["cluster"]["problems"]] == ["tuned", "tuned"]
    code, cap = run("--no-leases")
    assert code == 0 and "2 problem(s) tuned" in cap.out and "tuned here" not in cap.out


# --------------------------------------------------------------------------- PostgreSQL


def _outage(dbname, seconds):
    """What a server restart does to its clients: every connection ends, and for a moment no
    new one is accepted."""
    import threading

    from tests._pg import _connect

    with _connect() as conn:
        conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
    terminate_connections(dbname)

    def back():
        with _connect() as conn:
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')

    t = threading.Timer(seconds, back)
    t.start()
    return t


def test_database_away_mid_study_is_waited_for(pg_store, pg_url):  # noqa: F811
    """Twice mid-study, every connection of the worker ends and the database refuses new ones
    for a second: the worker reconnects, resumes the study and commits each problem exactly
    once."""
    dbname = sa.engine.make_url(pg_url).database
    said = []
    outages = []

    def drop(problem, candidate, n):
        if n in (1, 4):
            outages.append(_outage(dbname, 1.0))

    w = _worker(pg_store, timer=CountingTimer(drop), say=said.append, reconnect_s=20)
    try:
        report = w.run_problems(_problems(3))
    finally:
        for t in outages:
            t.join()
    assert [o.state for o in report.outcomes] == ["tuned"] * 3
    counts = _per_candidate(pg_store)
    assert len(counts) == 12 and set(counts.values()) == {1}
    assert any("went away mid-study" in s or "lost the tuning database" in s for s in said), said
    assert any("reconnected" in s for s in said), said
    assert all(r.state == "done" and r.attempts == 1 for r in LeaseBoard(pg_store).rows())


def test_database_gone_for_good_stops_with_a_clear_message(pg_store, pg_url, capsys):  # noqa: F811
    dbname = sa.engine.make_url(pg_url).database
    from tests._pg import _connect

    def cut(problem, candidate, n):
        _outage(dbname, 3600).cancel()  # away for good

    secret_url = with_password(pg_url, "s3cr3t-pw")
    store = Store(secret_url)
    try:
        w = _worker(store, timer=CountingTimer(cut), reconnect_s=1.0)
        with pytest.raises(DatabaseUnavailable) as info:
            w.run_problems(_problems(1))
    finally:
        with _connect() as conn:
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
        store.close()
    msg = str(info.value)
    assert "did not answer for 1 s" in msg and "s3cr3t-pw" not in msg and "***" in msg
    assert pg_store.records() == []  # nothing half-committed
