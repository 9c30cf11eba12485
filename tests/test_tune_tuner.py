"""The tuner on the CPU with the known-cost plugin: it picks the fastest correct kernel, prunes
wrong ones, records failures and keeps going, stores every measurement."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.trial import TrialState

from sparktune import dispatch
from sparktune.backends.base import Candidate
from sparktune.db import Store
from sparktune.tune import CostTimer, Timing, Tuner
from tests._store_helpers import DEVICE, known_cost, problem, registered_plugin

# small shapes: the reference check runs on the CPU
SMALL = {"batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 64, "seqlen_k": 64, "head_dim": 64}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "tune.sqlite3")
    with registered_plugin(s.url) as backend:
        s.backend = backend
        yield s
    s.close()


def _tuner(store, **kw):
    kw.setdefault("backends", ["knowncost"])
    kw.setdefault("timer", CostTimer(known_cost))
    return Tuner(device=DEVICE, torch_device="cpu", store=store, **kw)


def test_picks_fastest_correct_and_records_everything(store):
    p = problem(**SMALL)
    result = _tuner(store).tune(p)
    assert result.mode == "exhaustive"
    assert result.best.candidate == Candidate("knowncost", "d64only")
    by = {m.candidate.config: m for m in result.measurements}
    # the cheapest kernel is wrong: pruned with its error, never the winner
    assert by["wrong"].status == "wrong"
    assert by["wrong"].error > by["wrong"].error_limit
    assert "exceeds the bound" in by["wrong"].message
    # the crashing kernel is a failure with its message; the study went on
    assert by["crash"].status == "failed"
    assert "crashed, as designed" in by["crash"].message
    assert {m.status for m in result.measurements} == {"ok", "wrong", "failed"}
    assert len(result.measurements) == 7
    ranked = [m.candidate.config for m in result.ranked()]
    assert ranked == ["d64only", "fast", "medium", "slow", "long"]
    assert result.speedup(result.best) == pytest.approx(6.0)
    assert result.best.tflops == pytest.approx(p.flops() / (result.best.median_ms * 1e-3) / 1e12)
    json.dumps(result.to_json())  # serialisable
    stored = store.records(problem=p)
    assert sorted(r.config for r in stored) == sorted(by)
    assert {r.config: r.status for r in stored} == {c: m.status for c, m in by.items()}
    ok = next(r for r in stored if r.config == "fast")
    assert ok.runs == 5 and ok.q1_ms < ok.median_ms < ok.q3_ms and ok.error_limit > ok.error
    # dispatch sees the winner at once (the tuner reloads it)
    sel = dispatch.select(p, DEVICE)
    assert (sel.candidate, sel.source) == (Candidate("knowncost", "d64only"), "tuned")


def test_unsupported_candidates_are_filtered_before_optuna(store):
    p = problem(**{**SMALL, "head_dim": 32})
    tuner = _tuner(store)
    order, mode, planned = tuner.plan(p)
    assert "knowncost:d64only" not in {c.label for c in order}
    result = tuner.tune(p)
    assert "d64only" not in {m.candidate.config for m in result.measurements}
    assert result.best.candidate.config == "fast"


def test_default_is_enqueued_first_and_tpe_when_over_budget(store):
    p = problem(**SMALL)
    tuner = _tuner(store, backends=None, trials=4)
    default = dispatch.heuristic_default(p, DEVICE).candidate
    order, mode, planned = tuner.plan(p)
    assert order[0] == default and mode == "tpe" and planned == 4
    result = tuner.tune(p)
    assert len(result.measurements) == 4 and 4 <= result.trials <= 12
    first = min(result.measurements, key=lambda m: m.trial)
    assert first.candidate == default and first.trial == 0


def test_exhaustive_covers_every_backend(store):
    p = problem(**SMALL)
    result = _tuner(store, backends=None).tune(p)
    labels = {m.candidate.label for m in result.measurements}
    assert "torch:math" in labels and "knowncost:fast" in labels
    assert "reference" in result.excluded or not any(lb.startswith("reference:") for lb in labels)
    assert result.best.candidate.config == "d64only"


def test_long_sequences_pick_the_other_kernel(store):
    p = problem(**{**SMALL, "seqlen_q": 32, "seqlen_k": 1024, "head_dim": 32})
    assert _tuner(store).tune(p).best.candidate.config == "long"


def test_backward_candidates_have_a_backward(store):
    p = problem(**{**SMALL, "op": "bwd"})
    result = _tuner(store).tune(p)
    assert {m.candidate.config for m in result.measurements} == {"bwd_fast", "bwd_slow", "bwd_wrong"}
    assert result.best.candidate.config == "bwd_fast"
    wrong = next(m for m in result.measurements if m.candidate.config == "bwd_wrong")
    assert wrong.status == "wrong" and wrong.message.startswith("dq:")


def test_optuna_study_lives_in_the_same_database(store):
    p = problem(**SMALL)
    result = _tuner(store, storage=store.url).tune(p)
    storage = optuna.storages.RDBStorage(str(store.url.render_as_string(hide_password=False)))
    study = optuna.load_study(study_name=result.study_name, storage=storage)
    states = {t.params["candidate"]: t.state for t in study.trials}
    assert states["knowncost:wrong"] == TrialState.PRUNED
    assert states["knowncost:crash"] == TrialState.FAIL
    assert states["knowncost:fast"] == TrialState.COMPLETE
    assert study.best_trial.params["candidate"] == "knowncost:d64only"
    crash = next(t for t in study.trials if t.params["candidate"] == "knowncost:crash")
    assert "crashed" in crash.user_attrs["sparktune"]["message"]
    assert crash.user_attrs["sparktune"]["status"] == "failed"
    # the records are in the same file
    assert len(store.records(problem=p)) == 7


def test_timeout_stops_the_study(store):
    result = _tuner(store, timeout=0).tune(problem(**SMALL))
    assert result.trials == 0 and "timeout" in result.stopped and result.best is None


def test_excluded_patterns_and_broken_backend(store, monkeypatch):
    p = problem(**SMALL)
    tuner = _tuner(store, exclude=["knowncost:d64*", "*:wrong"])
    labels = {c.label for c in tuner.plan(p)[0]}
    assert "knowncost:d64only" not in labels and "knowncost:wrong" not in labels

    def boom(*a, **k):
        raise RuntimeError("listing failed")

    monkeypatch.setattr(store.backend, "candidates", boom)
    cands, excluded = tuner.candidates(p)
    assert cands == [] and "listing failed" in excluded["knowncost"][0]
    result = tuner.tune(p)
    assert result.mode == "none" and result.best is None


def test_no_store_no_records(store):
    result = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), backends=["knowncost"]).tune(
        problem(**SMALL)
    )
    assert result.best is not None and store.count() == 0


def test_invalid_budget():
    with pytest.raises(ValueError, match="trials"):
        Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), trials=0)


def test_backends_that_compile_are_warmed_up_first(store, monkeypatch):
    seen = []
    monkeypatch.setattr(store.backend, "warmup", lambda p, configs, processes: seen.append((p, list(configs))), raising=False)
    p = problem(**SMALL)
    _tuner(store).tune(p)
    # every candidate, the backend's own default ("medium") first
    assert seen == [(p, ["medium", "fast", "slow", "long", "wrong", "crash", "d64only"])]


def test_interrupted_study_keeps_what_was_measured(store):
    p = problem(**SMALL)
    seen = []

    def cost(candidate, prob):
        seen.append(candidate.label)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return known_cost(candidate, prob)

    tuner = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(cost), store=store, backends=["knowncost"])
    with pytest.raises(KeyboardInterrupt):
        tuner.tune(p)
    assert sorted(r.config for r in store.records(problem=p)) == sorted(lb.split(":")[1] for lb in seen[:2])


def test_every_backends_default_is_measured_before_tpe_chooses(store):
    """With a budget smaller than the space, the first trials are the defaults of the backends
    (here the one test backend's), whatever TPE would propose."""
    p = problem(**SMALL)
    seen = []

    def cost(candidate, prob):
        seen.append(candidate.config)
        return known_cost(candidate, prob)

    tuner = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(cost), store=store,
                  backends=["knowncost"], trials=3)
    order, mode, _ = tuner.plan(p)
    assert mode == "tpe" and order[0].config == "medium"
    tuner.tune(p)
    assert seen[0] == "medium"


def test_small_backends_are_measured_entirely_before_tpe(store):
    """A backend with at most SMALL_BACKEND candidates (PyTorch's SDPA has four) is measured
    entirely among the first trials, even when the budget is smaller than the space."""
    from sparktune.backends.base import Candidate
    from sparktune.tune._tuner import SMALL_BACKEND

    p = problem(**SMALL)
    tuner = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), store=store,
                  backends=["knowncost"], trials=3)
    order, _, _ = tuner.plan(p)
    small = [Candidate("tiny", f"c{i}") for i in range(SMALL_BACKEND)]
    big = [Candidate("big", f"c{i}") for i in range(SMALL_BACKEND + 1)]
    seeds = tuner.seeds(p, order + big + small)
    assert all(c in seeds for c in small)
    assert not any(c in seeds for c in big)


def test_screening_times_only_finalists_fully(store, monkeypatch):
    """A study over SCREEN_ABOVE candidates times each briefly, then fully only the finalists;
    a short timing that still reads faster than the best full one is timed fully too, so no
    stored timing beats the winner's."""
    from sparktune.tune import _tuner as tuner_mod

    monkeypatch.setattr(tuner_mod, "SCREEN_ABOVE", 2)
    monkeypatch.setattr(tuner_mod, "SCREEN_KEEP", 1)
    monkeypatch.setattr(tuner_mod, "SCREEN_FRACTION", 0.0)
    monkeypatch.setattr(tuner_mod, "SCREEN_MARGIN", 1.0)
    p = problem(**SMALL)
    # the short timing misreads "slow" as the fastest and "d64only" as slower than "fast"
    short = {"slow": 0.001, "fast": 0.002, "d64only": 0.003}

    def screen_cost(candidate, problem):
        return short.get(candidate.config, known_cost(candidate, problem))

    full = CostTimer(known_cost)
    result = _tuner(store, timer=full, screen_timer=CostTimer(screen_cost)).tune(p)
    by = {m.candidate.config: m for m in result.measurements}
    # "slow" was the screening's finalist; "d64only", "fast" and "medium" read faster (short)
    # than its full timing, so they were timed fully; "long" kept its short timing
    fully = {"slow", "fast", "medium", "d64only"}
    assert {c for c, m in by.items() if m.status == "ok" and not m.screened} == fully
    assert by["long"].screened and by["long"].status == "ok"
    assert sorted(full.calls[:-1]) == sorted(f"knowncost:{c}" for c in fully)  # then the baseline
    assert result.best.candidate.config == "d64only"
    assert result.best.median_ms == pytest.approx(known_cost(Candidate("knowncost", "d64only"), p), rel=0.02)
    ranked = result.ranked()
    assert [m.screened for m in ranked] == sorted(m.screened for m in ranked)
    assert all(m.median_ms >= result.best.median_ms for m in ranked)
    assert result.to_json()["best"]["screened"] is False


def test_no_screening_for_small_studies_or_when_asked(store):
    p = problem(**SMALL)
    screen = CostTimer(known_cost)
    _tuner(store, screen_timer=screen).tune(p)  # 7 candidates: under SCREEN_ABOVE
    assert screen.calls == []
    assert _tuner(store, screen_timer=False).screen_timer is None


class _FlooredTimer(CostTimer):
    """Known costs, with a burst floor 1.5x the cost for the fast kernel (its launch costs more
    than its GPU time) and 0.5x for the others."""

    def measure(self, fn, *, candidate=None, problem):
        t = super().measure(fn, candidate=candidate, problem=problem)
        factor = 1.5 if candidate is not None and candidate.config == "fast" else 0.5
        return Timing.of(t.times_ms, floor_ms=factor * t.runs_median_ms)


def test_the_burst_floor_is_stored_apart_from_the_runs(store):
    p = problem(**SMALL)
    result = Tuner(device=DEVICE, torch_device="cpu", timer=_FlooredTimer(known_cost), store=store,
                   backends=["knowncost"], storage=store.url).tune(p)
    by = {r.config: r for r in store.records(problem=p)}
    fast, medium = by["fast"], by["medium"]
    # the runs as measured: a spread around the cost, not copies of the median
    assert fast.min_ms < fast.q1_ms < fast.q3_ms < fast.max_ms < fast.median_ms
    assert fast.floor_ms == pytest.approx(1.5 * known_cost(Candidate("knowncost", "fast"), p))
    assert fast.median_ms == pytest.approx(fast.floor_ms)  # ranked at the floor
    assert medium.floor_ms < medium.min_ms and medium.q1_ms < medium.median_ms < medium.q3_ms
    assert by["wrong"].floor_ms is None and by["crash"].floor_ms is None
    # a study taken over keeps the floor (it is in the trials' attributes)
    again = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(lambda c, q: None), store=None,
                  backends=["knowncost"], storage=store.url).tune(p, resume=True)
    resumed = {m.candidate.config: m for m in again.measurements}
    assert resumed["fast"].timing == next(m for m in result.measurements if m.candidate.config == "fast").timing
    assert resumed["fast"].timing.floor_ms == pytest.approx(fast.floor_ms)


def test_a_study_says_where_its_time_went(store):
    result = _tuner(store).tune(problem(**SMALL))
    phases = result.phases_s
    assert {"check", "inputs", "timing", "baseline", "warmup"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= result.wall_s + 1e-6
    assert result.to_json()["phases_s"].keys() == phases.keys()
