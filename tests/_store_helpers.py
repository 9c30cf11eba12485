"""Helpers shared by the store, tuner and dispatch tests."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from sparktune.db import Record
from sparktune.problem import DeviceInfo, Problem

DEVICE = DeviceInfo("Test GPU", (9, 0), 132, driver="580.1", cuda="13.0")
OTHER_DEVICE = DeviceInfo("Other GPU", (8, 0), 108, driver="580.1", cuda="13.0")
BUILD = "build-test"

_clock = itertools.count()
_T0 = datetime(2026, 1, 1, tzinfo=UTC)


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
