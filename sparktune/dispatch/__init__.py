"""Problem -> (backend, config).

The order: a forced choice (``backend=``/``config=``), then the tuning store's best record for
this exact problem on this device and kernel build, then the best record of the nearest tuned
shape of the same kind, then the heuristic default. The store (the user's or shared database
over the shipped ``tuning_db/`` files) is read once per process and device into a dictionary;
every resolved problem is memoised, so a repeated call costs one dictionary lookup (the memo
is bounded: past :data:`_MEMO_MAX` selections it starts afresh).

A missing, locked, corrupted or unreachable database never raises into the caller: it is
logged once and the defaults are used. Nothing here ever tunes.

A shared database server (PostgreSQL) is read with a connect timeout of a few seconds and a
statement timeout; what was read is kept as a local snapshot (a JSON file in the user's cache
directory, see :mod:`sparktune.db._snapshot`). When the server does not answer, the snapshot
is used (or the defaults when there is none), with one warning. With
``$SPARKTUNE_SNAPSHOT_TTL`` (seconds), a snapshot younger than that is used without asking the
server at all, so that the many processes of a node read the server once between them.

``explain(...)`` tells which kernel a call would use and why; ``counters()`` counts the
selections made by source.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend, Candidate
from ..problem import DeviceInfo, Problem

if TYPE_CHECKING:
    import torch

    from ..db import Record

__all__ = [
    "DEFAULT_ORDER",
    "SOURCES",
    "Explanation",
    "NoKernelError",
    "Selection",
    "build_id",
    "configure",
    "counters",
    "explain",
    "heuristic_default",
    "invalidate_selections",
    "reload",
    "reset_counters",
    "select",
]

log = logging.getLogger(__name__)

#: heuristic preference when nothing was tuned: our kernels first, the oracle last
DEFAULT_ORDER = ("spark", "triton", "torch", "reference")
#: where a selection came from, in the order they are tried
SOURCES = ("forced", "tuned", "nearest", "default")
#: seconds dispatch waits for a locked or unreachable database before using the defaults
READ_TIMEOUT_S = 2.0
#: seconds a statement (or a lock wait) of dispatch's read of a database server may take
STATEMENT_TIMEOUT_S = 5.0
#: environment: use a snapshot younger than this many seconds without asking the server
ENV_SNAPSHOT_TTL = "SPARKTUNE_SNAPSHOT_TTL"


class NoKernelError(ValueError):
    """No backend can run the problem; the message lists every backend's reasons."""


@dataclass(frozen=True)
class Selection:
    candidate: Candidate
    #: "forced", "tuned", "nearest" or "default"
    source: str
    detail: str = ""
    #: the tuning record behind a "tuned" or "nearest" selection
    record: Record | None = field(default=None, compare=False, repr=False)


# --------------------------------------------------------------------------- process state

_lock = threading.RLock()
#: (problem, device, backend, config) -> the selection made for it
_memo: dict[tuple[Problem, DeviceInfo | None, str | None, str | None], Selection] = {}
#: more selections than this (e.g. a decode length that keeps growing) start the memo afresh;
#: the size is looked at only when a selection is made, never on a hit
_MEMO_MAX = 4096
#: (GPU model, build id) -> what the store says about that device
_tables: dict[tuple[str, tuple[int, int], int, str], _Table] = {}
_counts: dict[str, int] = dict.fromkeys(SOURCES, 0)
#: the database dispatch reads: set by configure(); None means $SPARKTUNE_DB or the default
_db_url: Any = None
#: bumped whenever the selections made so far are forgotten (configure, reload, a backend
#: registered or removed): what a caller cached from a selection is valid while it is unchanged
generation = 0
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def configure(db: Any = None) -> None:
    """Read the tuning records from ``db`` (a SQLAlchemy URL or a SQLite path; None:
    ``$SPARKTUNE_DB`` or the default file) from now on, and forget what was read."""
    global _db_url
    with _lock:
        _db_url = os.fspath(db) if isinstance(db, os.PathLike) else db
        _reset_state()


def reload() -> None:
    """Forget the records and selections read so far; the next call reads the store again
    (call it after tuning in the same process, or after registering a backend)."""
    with _lock:
        _reset_state()


def invalidate_selections() -> None:
    """Forget the selections made so far, not the records read: the registry calls this when
    a backend is registered or removed, since which tuned records can run depends on it."""
    global generation
    with _lock:
        _memo.clear()
        generation += 1


def _reset_state() -> None:
    global generation
    _memo.clear()
    generation += 1
    _tables.clear()
    _warned.clear()


def counters() -> dict[str, int]:
    """How many selections each source made in this process (every call counts)."""
    return dict(_counts)


def reset_counters() -> None:
    for k in _counts:
        _counts[k] = 0


@functools.cache
def build_id() -> str:
    """The build id of our compiled kernel family, or "none" without the extension."""
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError:
        return "none"
    try:
        return str(_C.build_info()["build_id"])
    except Exception as exc:  # noqa: BLE001 - a broken extension is reported, not raised
        _warn_once("build_id", f"sparktune: cannot read the kernel build id ({exc}); using 'none'")
        return "none"


# --------------------------------------------------------------------------- the store, in memory


def _kind(p: Problem) -> tuple[Any, ...]:
    """Problems of one kind can share a kernel choice: everything but the sizes."""
    return (p.op, p.dtype, p.head_dim, p.causal, p.allow_fp16_accum, p.group_size, p.seqlen_q == p.seqlen_k)


def _distance(a: Problem, b: Problem) -> float:
    """How far two shapes of one kind are: octaves of seqlen_q and seqlen_k, and half-weight
    octaves of the number of (batch, head) rows."""
    return (
        abs(math.log2(a.seqlen_q / b.seqlen_q))
        + abs(math.log2(a.seqlen_k / b.seqlen_k))
        + 0.5 * abs(math.log2((a.batch * a.heads_q) / (b.batch * b.heads_q)))
    )


@dataclass
class _Table:
    """The usable records of one device model and build, fastest first per problem."""

    ranked: dict[Problem, list[Record]]
    by_kind: dict[tuple[Any, ...], list[Problem]]
    sources: list[str]
    error: str = ""


def _device_key(device: DeviceInfo) -> tuple[str, tuple[int, int], int, str]:
    return (device.name, device.capability, device.sm_count, build_id())


def _snapshot_ttl() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_SNAPSHOT_TTL) or 0))
    except ValueError:
        _warn_once("ttl", f"sparktune: ${ENV_SNAPSHOT_TTL} is not a number of seconds; ignored")
        return 0.0


def _snapshot_text(snap: Any) -> str:
    return f"snapshot taken {snap.taken_at:%Y-%m-%d %H:%M} UTC, {len(snap.records)} record(s), {snap.path}"


def _read_store(device: DeviceInfo, build: str) -> tuple[list[Record], str, str]:
    """Records of this device model and build from the database (or, for a server that does
    not answer, from its local snapshot): (records, where, error)."""
    import time

    from ..db import (
        Store,
        StoreMissingError,
        is_network,
        open_error_text,
        read_snapshot,
        resolve_url,
        safe_url,
        snapshot_path,
        write_snapshot,
    )

    explicit = _db_url is not None or bool(os.environ.get("SPARKTUNE_DB"))
    where = safe_url(_db_url)
    snap_path = None
    try:
        url = resolve_url(_db_url)
        if is_network(url):
            snap_path = snapshot_path(url, device, build)
            ttl = _snapshot_ttl()
            if ttl > 0:
                try:
                    if time.time() - snap_path.stat().st_mtime < ttl:
                        snap = read_snapshot(snap_path)
                        return snap.records, f"{where} ({_snapshot_text(snap)}, younger than ${ENV_SNAPSHOT_TTL})", ""
                except (OSError, ValueError):
                    pass  # no usable snapshot: ask the server
        invalid: list[Any] = []
        with Store(
            url, create=False, upgrade=True, timeout=READ_TIMEOUT_S, statement_timeout=STATEMENT_TIMEOUT_S
        ) as store:
            records, shown = store.records(device=device, build_id=build, errors=invalid), store.display_url
        if invalid:
            _warn_once(
                f"rows:{shown}",
                f"sparktune: {len(invalid)} invalid row(s) in the tuning database {shown} were ignored "
                f"(the other records are used), first: {invalid[0]}",
            )
    except StoreMissingError as exc:
        if explicit:
            msg = f"sparktune: {exc}; using the default kernels"
            _warn_once(f"db:{where}", msg)
            return [], where, str(exc)
        return [], f"{where} (not created yet)", ""
    except Exception as exc:  # noqa: BLE001 - a broken database must never reach the caller
        text = open_error_text(exc, _db_url)
        if snap_path is not None:
            try:
                snap = read_snapshot(snap_path)
            except FileNotFoundError:
                snap = None
            except (OSError, ValueError) as bad:
                snap = None
                _warn_once("snapshot-read", f"sparktune: ignoring a damaged snapshot: {bad}")
            if snap is not None:
                _warn_once(
                    f"db:{where}",
                    f"sparktune: cannot reach the tuning database {where}: {text}; using its local "
                    f"snapshot ({_snapshot_text(snap)})",
                )
                return snap.records, f"{where} unreachable: {_snapshot_text(snap)}", text
        _warn_once(
            f"db:{where}",
            f"sparktune: cannot read the tuning database {where}: {text}; using the default "
            "kernels (tuned choices are ignored until this is fixed)",
        )
        return [], where, text
    if snap_path is not None:
        try:
            write_snapshot(snap_path, records, database=shown, device=device, build_id=build)
        except (OSError, ValueError) as exc:  # a read-only cache costs only the fallback
            if "snapshot-write" not in _warned:
                _warned.add("snapshot-write")
                log.info("sparktune: cannot write the snapshot %s: %s", snap_path, exc)
    return records, shown, ""


def _load_table(device: DeviceInfo) -> _Table:
    from ..db import layered, load_shipped

    build = build_id()
    stored, where, error = _read_store(device, build)
    sources = [where]
    try:
        shipped, bad = load_shipped()
    except Exception as exc:  # noqa: BLE001
        shipped, bad = [], []
        _warn_once("shipped", f"sparktune: cannot read the shipped tuning files: {exc}")
    if bad:
        _warn_once(
            "shipped-lines",
            f"sparktune: {len(bad)} invalid line(s) in the shipped tuning files were ignored, "
            f"first: {bad[0]}",
        )
    mine = [
        r
        for r in shipped
        if r.build_id == build
        and (r.device.name, r.device.capability, r.device.sm_count) == (device.name, device.capability, device.sm_count)
    ]
    if shipped:
        sources.append(f"{len({r.source for r in shipped})} shipped file(s)")
    ranked = layered([stored, mine], device)
    by_kind: dict[tuple[Any, ...], list[Problem]] = {}
    for p in ranked:
        by_kind.setdefault(_kind(p), []).append(p)
    return _Table(ranked, by_kind, sources, error)


def _table(device: DeviceInfo) -> _Table:
    key = _device_key(device)
    table = _tables.get(key)
    if table is None:
        with _lock:
            table = _tables.get(key)
            if table is None:
                try:
                    table = _load_table(device)
                except Exception as exc:  # noqa: BLE001 - last line of defence
                    _warn_once("table", f"sparktune: cannot load tuning records ({exc}); using the default kernels")
                    table = _Table({}, {}, [], str(exc))
                _tables[key] = table
    return table


# --------------------------------------------------------------------------- resolution


def _registered() -> dict[str, Backend]:
    from ..registry import backends

    return backends()


def _runnable_reasons(
    registered: dict[str, Backend], cand: Candidate, problem: Problem, device: DeviceInfo | None
) -> list[str]:
    b = registered.get(cand.backend)
    if b is None:
        return [f"backend {cand.backend!r} is not registered"]
    try:
        reasons = b.unavailable_reasons() or b.not_supported_reasons(problem, cand.config, device)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot answer cannot run
        reasons = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"]
    if not reasons and problem.op == "bwd" and type(b).backward is Backend.backward:
        reasons = [f"backend {cand.backend!r} has no backward"]
    return list(reasons)


def _reasons_text(reasons: dict[str, list[str]]) -> str:
    lines = []
    for name, rs in reasons.items():
        lines.append(f"  {name}: " + ("; ".join(rs) if rs else "(no reason given)"))
    return "\n".join(lines)


def _forced(problem: Problem, device: DeviceInfo | None, backend: str, config: str | None) -> Selection:
    from ..registry import get_backend

    b = get_backend(backend)
    reasons = b.unavailable_reasons() or b.not_supported_reasons(problem, config, device)
    if reasons:
        what = f"backend {backend!r}" + (f" config {config!r}" if config else "")
        raise NoKernelError(f"{what} cannot run {problem}:\n" + _reasons_text({backend: reasons}))
    cfg = config or b.default_config(problem, device)
    if cfg is None:
        raise NoKernelError(f"backend {backend!r} has no configuration for {problem}")
    return Selection(Candidate(backend, cfg), "forced", "asked for by the caller")


def heuristic_default(
    problem: Problem, device: DeviceInfo | None, *, registered: dict[str, Backend] | None = None
) -> Selection:
    """The choice for an untuned problem: the first backend in :data:`DEFAULT_ORDER` (then any
    plugin) that can run it, with that backend's default config."""
    all_reasons: dict[str, list[str]] = {}
    registered = _registered() if registered is None else registered
    order = [n for n in DEFAULT_ORDER if n in registered] + [n for n in registered if n not in DEFAULT_ORDER]
    for name in order:
        b = registered[name]
        try:
            reasons = b.unavailable_reasons() or b.not_supported_reasons(problem, None, device)
            if not reasons and problem.op == "bwd" and type(b).backward is Backend.backward:
                reasons = ["no backward"]
            cfg = None if reasons else b.default_config(problem, device)
        except Exception as exc:  # noqa: BLE001
            reasons, cfg = [f"raised {type(exc).__name__}: {exc}"], None
        if reasons:
            all_reasons[name] = reasons
            continue
        if cfg is None:
            all_reasons[name] = ["no configuration supports this problem"]
            continue
        return Selection(Candidate(name, cfg), "default", f"heuristic default ({name} first in preference order)")
    raise NoKernelError(f"no backend can run {problem}:\n" + _reasons_text(all_reasons))


def _shape_text(p: Problem) -> str:
    return f"batch {p.batch}, heads {p.heads_q}/{p.heads_kv}, seqlen {p.seqlen_q}/{p.seqlen_k}"


def _from_records(
    records: Iterable[Record],
    problem: Problem,
    device: DeviceInfo,
    registered: dict[str, Backend],
    rejected: list[str] | None,
) -> Record | None:
    for r in records:
        reasons = _runnable_reasons(registered, Candidate(r.backend, r.config), problem, device)
        if not reasons:
            return r
        if rejected is not None:
            rejected.append(f"{r.label} ({r.median_ms:.4g} ms): " + "; ".join(reasons))
    return None


def _resolve(
    problem: Problem, device: DeviceInfo | None, rejected: list[str] | None = None
) -> Selection:
    registered = _registered()
    if device is not None:
        table = _table(device)
        exact = table.ranked.get(problem)
        if exact:
            r = _from_records(exact, problem, device, registered, rejected)
            if r is not None:
                return Selection(
                    Candidate(r.backend, r.config),
                    "tuned",
                    f"fastest tuned record for this problem ({r.median_ms:.4g} ms, {r.source})",
                    r,
                )
        near = sorted(
            (p for p in table.by_kind.get(_kind(problem), ()) if p != problem),
            key=lambda p: (_distance(p, problem), p.seqlen_q, p.seqlen_k, p.batch, p.heads_q),
        )
        for p in near:
            r = _from_records(table.ranked[p], problem, device, registered, rejected)
            if r is not None:
                return Selection(
                    Candidate(r.backend, r.config),
                    "nearest",
                    f"nearest tuned shape: {_shape_text(p)} (distance {_distance(p, problem):.2g}; "
                    f"{r.median_ms:.4g} ms there, {r.source})",
                    r,
                )
    return heuristic_default(problem, device, registered=registered)


def select(
    problem: Problem,
    device: DeviceInfo | None,
    *,
    backend: str | None = None,
    config: str | None = None,
) -> Selection:
    """Choose the kernel for ``problem`` on ``device`` (None: no GPU, CPU tensors)."""
    key = (problem, device, backend, config)
    sel = _memo.get(key)
    if sel is None:
        if backend is None and config is not None:
            raise ValueError("config= needs backend= too (a config name belongs to one backend)")
        sel = _forced(problem, device, backend, config) if backend is not None else _resolve(problem, device)
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[key] = sel
    _counts[sel.source] += 1
    return sel


# --------------------------------------------------------------------------- explain


@dataclass(frozen=True)
class Explanation:
    """Which kernel a call would use and why (``str()`` gives the text)."""

    problem: Problem
    device: DeviceInfo | None
    build_id: str
    selection: Selection | None
    #: the error text when no kernel can run the problem
    error: str
    #: where the records were read from
    sources: tuple[str, ...]
    #: tuned candidates of the problem, fastest first ("label: time ...")
    tuned: tuple[str, ...]
    #: tuned candidates passed over, with the reason
    rejected: tuple[str, ...]

    def __str__(self) -> str:
        from ..db import problem_key

        dev = (
            f"{self.device.name} (sm_{self.device.arch}, {self.device.sm_count} SMs, driver "
            f"{self.device.driver or '?'}, CUDA {self.device.cuda or '?'})"
            if self.device is not None
            else "none (CPU tensors: no tuned records apply)"
        )
        lines = [
            f"problem:  {problem_key(self.problem)}",
            f"device:   {dev}",
            f"build:    {self.build_id}",
            f"records:  {', '.join(self.sources) or '(not read)'}",
        ]
        if self.selection is None:
            lines.append(f"choice:   none\n{self.error}")
        else:
            s = self.selection
            lines.append(f"choice:   {s.candidate.label} ({s.source})")
            lines.append(f"why:      {s.detail}")
            r = s.record
            if r is not None:
                spread = (
                    f", quartiles {r.q1_ms:.4g}-{r.q3_ms:.4g}" if r.q1_ms is not None and r.q3_ms is not None else ""
                )
                tf = f", {r.tflops:.1f} TFLOP/s" if r.tflops else ""
                lines.append(
                    f"measured: {r.median_ms:.4g} ms median{spread}, {r.runs} runs{tf}, on {r.host or '?'} "
                    f"at {r.measured_at:%Y-%m-%d %H:%M} UTC (sparktune {r.version or '?'})"
                )
        for t in self.tuned:
            lines.append(f"tuned:    {t}")
        for t in self.rejected:
            lines.append(f"skipped:  {t}")
        return "\n".join(lines)


@functools.cache
def _cuda_device_info(index: int) -> DeviceInfo:
    return DeviceInfo.from_torch(f"cuda:{index}")


def _problem_from_tensors(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool, layout: str, allow_fp16_accum: bool, op: str
) -> tuple[Problem, DeviceInfo | None]:
    import torch

    dtypes = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if q.dtype not in dtypes:
        raise TypeError(f"dtype {q.dtype} is not supported (float16 or bfloat16)")
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"unknown layout {layout!r}")
    qb, kb = (t if layout == "bhnd" else t.transpose(1, 2) for t in (q, k))
    problem = Problem(
        op=op,
        dtype=dtypes[q.dtype],
        batch=qb.shape[0],
        heads_q=qb.shape[1],
        heads_kv=kb.shape[1],
        seqlen_q=qb.shape[2],
        seqlen_k=kb.shape[2],
        head_dim=qb.shape[3],
        causal=bool(causal),
        allow_fp16_accum=bool(allow_fp16_accum),
    )
    dev = q.device
    device = None
    if dev.type == "cuda":
        import torch.cuda

        device = _cuda_device_info(dev.index if dev.index is not None else torch.cuda.current_device())
    return problem, device


_AUTO: Any = object()


def explain(
    problem: Problem | torch.Tensor,
    device: DeviceInfo | None | Any = _AUTO,
    *,
    k: torch.Tensor | None = None,
    causal: bool = False,
    layout: str = "bhnd",
    allow_fp16_accum: bool = False,
    op: str = "fwd",
    backend: str | None = None,
    config: str | None = None,
) -> Explanation:
    """Which kernel ``select`` would choose for a problem and why; counters are not touched.

    ``explain(problem, device)`` for a :class:`~sparktune.problem.Problem` (device None: CPU;
    left out: the current CUDA device if there is one), or ``explain(q, k=k, causal=...)``
    for the tensors of an ``attention()`` call.
    """
    if not isinstance(problem, Problem):
        if k is None:
            raise TypeError("explain(q, k=k, ...) needs k with tensors, or a Problem")
        problem, found = _problem_from_tensors(
            problem, k, causal=causal, layout=layout, allow_fp16_accum=allow_fp16_accum, op=op
        )
        if device is _AUTO:
            device = found
    elif device is _AUTO:
        device = None
        try:
            import torch

            if torch.cuda.is_available():
                device = _cuda_device_info(torch.cuda.current_device())
        except Exception:  # noqa: BLE001
            device = None
    rejected: list[str] = []
    selection: Selection | None = None
    error = ""
    try:
        if backend is not None or config is not None:
            if backend is None:
                raise ValueError("config= needs backend= too")
            selection = _forced(problem, device, backend, config)
        else:
            selection = _resolve(problem, device, rejected)
    except (NoKernelError, ValueError) as exc:
        error = str(exc)
    tuned: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    if device is not None:
        table = _table(device)
        sources = tuple(table.sources)
        tuned = tuple(
            f"{r.label}: {r.median_ms:.4g} ms" + (f", {r.tflops:.1f} TFLOP/s" if r.tflops else "")
            for r in table.ranked.get(problem, ())
        )
    return Explanation(problem, device, build_id(), selection, error, sources, tuned, tuple(rejected))
