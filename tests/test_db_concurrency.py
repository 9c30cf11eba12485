"""Eight processes writing one SQLite file at once: no record lost, no lock error shown."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sparktune.db import Store

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 8
BATCHES = 25
PER_BATCH = 4

WORKER = r"""
import sys, time, types
from pathlib import Path
# load the store without the package's __init__ (which imports torch): eight torch imports on
# a small CI machine would take longer than the test itself
pkg = types.ModuleType("sparktune")
pkg.__path__ = [str(Path.cwd() / "sparktune")]
sys.modules["sparktune"] = pkg
from tests._store_helpers import problem, record
from sparktune.db import Store

worker, db, sync = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
batches, per_batch = int(sys.argv[4]), int(sys.argv[5])
(sync / f"ready{worker}").touch()
while not (sync / "go").exists():
    time.sleep(0.005)
store = Store(db)  # every worker races to create the file and its tables
for b in range(batches):
    p = problem(batch=worker + 1, seqlen_q=64 * (b + 1), seqlen_k=64 * (b + 1))
    store.add([record(p, config=f"w{worker}b{b}c{c}") for c in range(per_batch)])
    store.records(problem=p)  # reads interleaved with the other writers
store.close()
print("done", worker)
"""


def test_eight_processes_write_one_file(tmp_path):
    db = tmp_path / "shared.sqlite3"
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), str(db), str(sync), str(BATCHES), str(PER_BATCH)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(WORKERS)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(sync.glob("ready*"))) < WORKERS:
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.05)
        (sync / "go").touch()
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, err
        assert out.strip() == f"done {i}"
        assert "locked" not in err.lower() and "Traceback" not in err, err
    with Store(db) as s:
        recs = s.records()
    assert len(recs) == WORKERS * BATCHES * PER_BATCH
    assert len({r.config for r in recs}) == len(recs)
