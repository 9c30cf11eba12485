"""Helpers shared by the store, tuner and dispatch tests."""

from __future__ import annotations

import contextlib
import itertools
from datetime import datetime, timedelta, timezone

from sparktune.db import Record
from sparktune.problem import DeviceInfo, Problem

DEVICE = DeviceInfo("Test GPU", (9, 0), 132, driver="580.1", cuda="13.0")
OTHER_DEVICE = DeviceInfo("Other GPU", (8, 0), 108, driver="580.1", cuda="13.0")
BUILD = "build-test"

_clock = itertools.count()
_T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def problem(**changes) -> Problem:
    base = {"op": "fwd", "dtype": "float16", "batch": 1, "heads_q": 4, "heads_kv": 4, "seqlen_q": 256,
                "seqlen_k": 256, "head_dim": 64, "causal": False}
    base.update(changes)
    return Problem(**base)


def record(p: Problem | None = None, *, backend="knowncost", config="fast", median=1.0,
           status="ok", device=DEVICE, build=BUILD, **kw) -> Record:
    """A record measured a little after the previous one (deterministic order)."""
    kw.setdefault("measured_at", _T0 + timedelta(seconds=next(_clock)))
    ok = status == "ok"
    values = {
        "median_ms": median if ok else None,
        "min_ms": median * 0.98 if ok else None,
        "max_ms": median * 1.05 if ok else None,
        "q1_ms": median * 0.99 if ok else None,
        "q3_ms": median * 1.01 if ok else None,
        "runs": 20 if ok else 0,
        "tflops": 1.0 if ok else None,
        "error": 1e-3,
        "error_limit": 2e-3,
        "host": "testhost",
        "version": "0.0.test",
    }
    values.update(kw)
    return Record(
        problem=p or problem(),
        device=device,
        build_id=build,
        backend=backend,
        config=config,
        status=status,
        **values,
    )


@contextlib.contextmanager
def connection_attempts():
    """The connections that engines try to open while active, each as its connect parameters
    plus ``dialect``: how often a code path asks a database, counted rather than timed."""
    import sqlalchemy as sa
    from sqlalchemy.engine import Engine

    seen: list[dict] = []

    def on_connect(dialect, conn_rec, cargs, cparams):
        seen.append({**cparams, "dialect": dialect.name})

    sa.event.listen(Engine, "do_connect", on_connect)
    try:
        yield seen
    finally:
        sa.event.remove(Engine, "do_connect", on_connect)


class ServerClock:
    """The database server's clock as the lease table reads it, driven by the test instead of
    by time: it stands still until :meth:`advance`, so that a lease of a fraction of a second
    expires exactly when the test says, however slow the machine."""

    def __init__(self, monkeypatch, start: float = 1_000_000.0) -> None:
        import sys

        from sparktune.tune import LeaseBoard

        self.now = start
        monkeypatch.setattr(sys.modules[LeaseBoard.__module__], "server_time", lambda conn: self.now)

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --------------------------------------------------------------------------- the known-cost plugin

PLUGIN_DIR = __import__("pathlib").Path(__file__).resolve().parent / "plugin_pkg"


def plugin_module():
    """The test plugin's module, importable without installing it."""
    import sys

    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
    import sparktune_testplugin

    return sparktune_testplugin


def known_cost(candidate, problem):
    """Cost function for ``CostTimer``: the plugin's known costs; torch's math backend is
    slower than every plugin config that works."""
    tp = plugin_module()
    if candidate is None or candidate.label == "sdpa:default":
        return tp.cost_ms("sdpa:default", problem)
    if candidate.backend == "torch":
        return 10.0 * problem.flops() / 1e9
    return tp.cost_ms(candidate.config, problem)


class registered_plugin:
    """Context manager: the known-cost backend registered in this process, a fresh dispatch
    state reading ``db`` and no shipped layer."""

    def __init__(self, db=None):
        self.db = db

    def __enter__(self):
        import os

        from sparktune import dispatch, registry

        self._env = os.environ.get("SPARKTUNE_SHIPPED_DB")
        os.environ["SPARKTUNE_SHIPPED_DB"] = ""
        self.backend = plugin_module().KnownCostBackend()
        registry.register_backend(self.backend, replace=True)
        dispatch.configure(self.db)
        dispatch.reset_counters()
        return self.backend

    def __exit__(self, *exc):
        import os

        from sparktune import dispatch, registry

        registry.unregister_backend("knowncost")
        dispatch.configure(None)
        dispatch.reset_counters()
        if self._env is None:
            os.environ.pop("SPARKTUNE_SHIPPED_DB", None)
        else:
            os.environ["SPARKTUNE_SHIPPED_DB"] = self._env
