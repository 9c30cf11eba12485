"""Distributed tuning: workers on many processes and hosts divide a list of problems through the
tuning database.

Every worker runs the same loop over the same problems. A problem is claimed with a lease
(:class:`sparktune.tune.LeaseBoard`) before it is tuned; a heartbeat thread renews the lease
while the study runs; the problem's records are committed together with the lease's ``done``
mark, only while the lease is still the worker's. A worker that dies stops renewing: once the
lease has expired, another worker claims the problem and resumes its Optuna study (the trials
finished before the crash are kept; the one that was running is marked failed). Problems done
in an earlier run of the same name are skipped. A worker that finds nothing to claim but
problems still held by others waits for them, so that it can take over a lease that expires.

The database may go away for a moment (a server restart, a dropped connection): each step is
retried with the connection renewed for up to ``reconnect_s`` seconds, and a study interrupted
by it is resumed; after that the worker stops with :class:`DatabaseUnavailable`, its lease
left to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..problem import Problem
from ._tuner import TuneAborted, Tuner, TuneResult

if TYPE_CHECKING:
    from ..db import Store
    from ._leases import Claim, LeaseBoard

__all__ = ["ClusterReport", "DatabaseUnavailable", "Outcome", "Worker", "work_label"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class DatabaseUnavailable(RuntimeError):
    """The tuning database did not answer for longer than the worker waits."""


def work_label(problem: Problem, tuner: Tuner, space: str) -> str:
    """What a lease is for: the problem, the full device fingerprint (a new driver or CUDA
    version is new work), the kernel build and the candidate space."""
    from ..db import problem_key
    from ..dispatch import build_id

    d = tuner.device
    return (
        f"{problem_key(problem)} | {d.name} sm_{d.arch} {d.sm_count}SM driver {d.driver or '?'} "
        f"CUDA {d.cuda or '?'} | build {build_id()} | space {space}"
    )


@dataclass
class Outcome:
    """What became of one problem in this worker's run.

    ``state``: ``tuned`` (by this worker), ``done`` (finished by another worker, or before this
    run), ``failed`` (tuning could not go on, here or elsewhere), ``lost`` (this worker's lease
    was taken over: the other worker finishes it), ``running`` (held by another worker when
    this one stopped waiting), ``none`` (no candidate can run it), ``pending`` (not attempted:
    this worker stopped first)."""

    problem: Problem
    state: str
    label: str = ""
    work: str = ""
    owner: str = ""
    attempt: int = 0
    taken_over_from: str = ""
    resumed: int = 0
    result: TuneResult | None = None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        from ..db import problem_key

        return {
            "key": problem_key(self.problem),
            "state": self.state,
            "owner": self.owner,
            "attempt": self.attempt,
            "taken_over_from": self.taken_over_from,
            "resumed_trials": self.resumed,
            "message": self.message,
        }


@dataclass
class ClusterReport:
    run: str
    worker: str
    outcomes: list[Outcome] = field(default_factory=list)
    #: why the worker stopped before the end ("" when it did not): tuning could not go on here
    stopped: str = ""

    @property
    def results(self) -> list[TuneResult]:
        return [o.result for o in self.outcomes if o.result is not None and o.state == "tuned"]

    def count(self, state: str) -> int:
        return sum(1 for o in self.outcomes if o.state == state)

    def summary(self) -> str:
        parts = [f"{self.count('tuned')} tuned here"]
        for state, text in (("done", "done elsewhere or before"), ("failed", "failed"), ("lost", "lost to another worker"),
                            ("running", "still running elsewhere"), ("none", "without candidates"),
                            ("pending", "not attempted")):
            if self.count(state):
                parts.append(f"{self.count(state)} {text}")
        return f"worker {self.worker}, run {self.run or '(default)'!r}: {len(self.outcomes)} problem(s): " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "worker": self.worker, "problems": [o.to_json() for o in self.outcomes]}


class _Heartbeat:
    """Renews a lease every ``interval`` seconds in a daemon thread. ``lost`` is set when the
    lease is found to be another worker's; failures to reach the database are retried (if the
    lease expires meanwhile, the final commit finds out)."""

    def __init__(self, board: LeaseBoard, work: str, interval: float) -> None:
        self.board = board
        self.work = work
        self.interval = interval
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"sparktune-lease-{work[:8]}", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=max(5.0, self.interval))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.board.renew(self.work):
                    self.lost.set()
                    return
            except Exception as exc:  # noqa: BLE001 - the database is away: try again
                from ..db import open_error_text

                log.debug("sparktune: lease heartbeat failed: %s", open_error_text(exc, self.board.store.url))


class Worker:
    """One worker of a distributed run.

    ``tuner``: tunes on this worker's device (its ``store`` should be None: the worker commits
    the records with the lease). ``run``: the run's name; a rerun of the same name skips what
    is done, a new name tunes everything again. ``lease_s``: how long a lease lasts without a
    heartbeat (a crashed worker's problem is taken over after that). ``wait``: keep polling
    problems that other workers hold until they finish (to take over one that is abandoned).
    ``retry_failed``: claim problems that failed before. ``reconnect_s``: how long the
    database may be away before the worker stops. ``say``: one-line progress messages.
    """

    def __init__(
        self,
        tuner: Tuner,
        store: Store,
        *,
        run: str = "",
        lease_s: float = 60.0,
        wait: bool = True,
        retry_failed: bool = False,
        reconnect_s: float = 60.0,
        poll_s: float | None = None,
        owner: str | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        from ._leases import LeaseBoard

        if tuner.store is not None:
            raise ValueError("the worker commits the records: give it a Tuner without a store")
        self.tuner = tuner
        self.store = store
        self.run = run
        self.tuner.run = run
        # another worker takes a study over from the database: trials are stored as they end
        self.tuner.live_storage = True
        self.board = LeaseBoard(store, owner=owner, lease_s=lease_s)
        self.wait = wait
        self.retry_failed = retry_failed
        self.reconnect_s = reconnect_s
        self.poll_s = poll_s if poll_s is not None else min(10.0, max(0.2, lease_s / 4))
        self.say = say or (lambda text: log.info("%s", text))

    @property
    def owner(self) -> str:
        return self.board.owner

    # ------------------------------------------------------------------ the database, patiently

    def _db(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while the database is away, for up to ``reconnect_s``."""
        from ..db import is_transient_error, open_error_text

        deadline: float | None = None
        delay = 0.2
        while True:
            try:
                value = fn()
            except Exception as exc:
                if not is_transient_error(exc):
                    raise
                text = open_error_text(exc, self.store.url)
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.reconnect_s
                    self.say(f"lost the tuning database while {what} ({text}); reconnecting for up to {self.reconnect_s:g} s")
                if now >= deadline:
                    raise DatabaseUnavailable(
                        f"the tuning database {self.store.display_url} did not answer for {self.reconnect_s:g} s "
                        f"while {what} ({text})"
                    ) from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 2.0)
                continue
            if deadline is not None:
                self.say(f"reconnected to the tuning database ({what})")
            return value

    def _probe(self) -> None:
        import sqlalchemy as sa

        with self.store.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    # ------------------------------------------------------------------ the loop

    def run_problems(self, problems: Sequence[Problem]) -> ClusterReport:
        from ._leases import work_id

        report = ClusterReport(self.run, self.owner)
        pending: list[Outcome] = []
        for p in problems:
            order, _, _ = self.tuner.plan(p)
            if not order:
                o = Outcome(p, "none", message="no candidate can run this problem")
                report.outcomes.append(o)
                continue
            label = work_label(p, self.tuner, Tuner.space_id(order))
            o = Outcome(p, "pending", label=label, work=work_id(self.run, label))
            report.outcomes.append(o)
            pending.append(o)
        while pending and not report.stopped:
            waiting: list[Outcome] = []
            worked = False
            for o in pending:
                if report.stopped:
                    waiting.append(o)
                    continue
                claim = self._db("claiming a problem", lambda o=o: self.board.claim(
                    o.work, o.label, run=self.run, retry_failed=self.retry_failed))
                if claim is None:
                    info = self._db("reading a lease", lambda o=o: self.board.get(o.work))
                    if info is None:
                        waiting.append(o)
                    elif info.state in ("done", "failed"):
                        o.state, o.owner, o.attempt, o.message = info.state, info.owner, info.attempts, info.message
                    else:
                        o.owner = info.owner
                        waiting.append(o)
                    continue
                worked = True
                self._tune(o, claim)
                if o.state == "failed":
                    report.stopped = o.message
            pending = [o for o in waiting if o.state not in ("done", "failed")]
            if report.stopped:
                for o in pending:
                    o.message = "not attempted: this worker stopped"
                break
            if pending and not self.wait:
                for o in pending:
                    o.state = "running"
                    o.message = f"held by {o.owner}"
                break
            if pending and not worked:
                time.sleep(self.poll_s)
        return report

    def _tune(self, o: Outcome, claim: Claim) -> None:
        from .. import dispatch
        from ..db import is_transient_error, problem_key

        o.owner, o.attempt, o.taken_over_from = self.owner, claim.attempt, claim.previous_owner
        key = problem_key(o.problem)
        if claim.previous_owner:
            self.say(f"{key}: taking over from {claim.previous_owner} (its lease "
                     + ("expired" if claim.previous_state == "running" else f"was {claim.previous_state}") + ")")
        else:
            self.say(f"{key}: tuning (attempt {claim.attempt})" if claim.attempt > 1 else f"{key}: tuning")
        start = time.monotonic()
        with _Heartbeat(self.board, o.work, interval=max(0.05, self.board.lease_s / 4)) as hb:
            outer = self.tuner.progress

            def check(*args: Any) -> None:
                if hb.lost.is_set():
                    from ._leases import LeaseLost

                    raise LeaseLost(f"{key}: the lease was taken over by another worker")
                if outer is not None:
                    outer(*args)

            self.tuner.progress = check
            try:
                while True:
                    try:
                        result = self.tuner.tune(o.problem, resume=True)
                        break
                    except TuneAborted as exc:
                        # this worker's GPU cannot go on: the measurements so far are committed
                        # with the failure, and the worker stops
                        partial = exc.result
                        records = self.tuner.records(partial) if partial is not None else []
                        self._db("recording a failure", lambda exc=exc, records=records: self.board.finish(
                            o.work, records, failed=True, message=str(exc)))
                        o.state, o.result, o.message = "failed", partial, str(exc)
                        return
                    except Exception as exc:
                        from ._leases import LeaseLost

                        if isinstance(exc, LeaseLost):
                            o.state, o.message = "lost", str(exc)
                            self.say(str(exc))
                            return
                        if not is_transient_error(exc):
                            raise
                        # the database went away mid-study: once it is back, and if the lease is
                        # still ours, resume the study where it stopped
                        from ..db import open_error_text

                        self.say(f"{key}: the tuning database went away mid-study "
                                 f"({open_error_text(exc, self.store.url)}); resuming once it answers")
                        self._db("waiting to resume " + key, self._probe)
                        again = self._db("renewing a lease", lambda: self.board.claim(o.work, o.label, run=self.run))
                        if again is None or hb.lost.is_set():
                            o.state, o.message = "lost", f"{key}: the lease was taken over while the database was away"
                            self.say(o.message)
                            return
            except KeyboardInterrupt:
                try:
                    self.board.release(o.work, "released: the worker was interrupted")
                except Exception:  # noqa: BLE001 - the lease expires anyway
                    pass
                raise
            finally:
                self.tuner.progress = outer
        o.resumed = sum(1 for m in result.measurements if m.resumed)
        o.result = result
        committed = self._db("committing results", lambda: self.board.finish(o.work, self.tuner.records(result)))
        if committed:
            o.state = "tuned"
            best = result.best
            self.say(
                f"{key}: done in {time.monotonic() - start:.1f} s"
                + (f", {o.resumed} measurement(s) taken over" if o.resumed else "")
                + (f"; best {best.candidate.label} {best.median_ms:.4g} ms" if best else "; no candidate passed")
            )
            dispatch.reload()
        else:
            o.state, o.message = "lost", f"{key}: the lease was taken over before the results were committed; discarded"
            self.say(o.message)
