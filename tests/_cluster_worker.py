"""Worker processes of the distributed-tuning tests.

``python tests/_cluster_worker.py CONFIG.json`` imports torch, sparktune and the known-cost
plugin once, then forks N workers (importing torch eight times over would take longer on a
small CI machine than the test itself). Each worker runs ``sparktune tune --recipe ...`` through
the same function the command line uses, with the known-cost backend and a CostTimer that
logs every measurement to ``w<i>.measured`` and then sleeps ``delay_s`` (so that a test can
kill or disturb a worker mid-problem, with that measurement in flight). Files in ``out``:
``pids.json`` (worker index -> pid), ``w<i>.out``/``.err`` (its stdout and stderr),
``w<i>.code`` (its exit status), ``w<i>.measured`` (``problem key<TAB>candidate`` lines).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "plugin_pkg"))
os.environ["SPARKTUNE_SHIPPED_DB"] = ""

import optuna  # noqa: E402,F401 - imported before the fork, once
import sparktune_testplugin  # noqa: E402
import sqlalchemy  # noqa: E402,F401
import torch  # noqa: E402

from sparktune import registry  # noqa: E402
from sparktune.cli import build_parser  # noqa: E402
from sparktune.cli import tune as tune_cli  # noqa: E402
from sparktune.db import problem_key  # noqa: E402
from sparktune.tune import CostTimer  # noqa: E402
from tests._store_helpers import DEVICE, known_cost  # noqa: E402

try:
    import psycopg  # noqa: F401
except ImportError:
    pass


class LoggedCostTimer(CostTimer):
    def __init__(self, log: Path, delay_s: float) -> None:
        super().__init__(known_cost)
        self.log = log.open("a", buffering=1)
        self.delay_s = delay_s

    def measure(self, fn, *, candidate=None, problem):
        timing = super().measure(fn, candidate=candidate, problem=problem)
        if candidate is not None and candidate.label != "sdpa:default":
            # logged first: a worker killed during the sleep has this measurement in flight
            self.log.write(f"{problem_key(problem)}\t{candidate.label}\n")
            time.sleep(self.delay_s)
        return timing


def worker(i: int, cfg: dict, out: Path) -> int:
    torch.set_num_threads(1)
    fd_out = os.open(out / f"w{i}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    fd_err = os.open(out / f"w{i}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    registry.register_backend(sparktune_testplugin.KnownCostBackend(), replace=True)
    argv = ["tune", "--recipe", cfg["recipe"], "--db", cfg["db"], "--json", "--no-progress", *cfg.get("args", [])]
    args = build_parser().parse_args(argv)
    problems, extra = tune_cli.problems_from_args(args)
    timer = LoggedCostTimer(out / f"w{i}.measured", cfg.get("delay_s", 0.0))
    return tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=timer)


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    pids = {}
    for i in range(cfg["workers"]):
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                code = worker(i, cfg, out)
            except BaseException as exc:  # noqa: BLE001 - reported through the files
                import traceback

                traceback.print_exc()
                code = 98 if not isinstance(exc, SystemExit) else int(exc.code or 0)
            finally:
                (out / f"w{i}.code").write_text(str(code))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[i] = pid
    (out / "pids.json.partial").write_text(json.dumps(pids))
    os.replace(out / "pids.json.partial", out / "pids.json")
    for pid in pids.values():
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
