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
directory, see :mod:`sparktune.dispatch._snapshot`). When the server does not answer, the
snapshot is used (or the defaults when there is none), with one warning. With
``$SPARKTUNE_SNAPSHOT_TTL`` (seconds), a snapshot younger than that is used without asking the
server at all, so that the many processes of a node read the server once between them.

``explain(...)`` tells which kernel a call would use and why; ``counters()`` counts the
selections made by source.

This module keeps dispatch's state in this process (the memo, the records read per device,
the counters, the generation) and its entry points. The records a device and build see are
read by :func:`load_records` (``_load``: the database, its snapshot, the shipped files) and
ranked by ``_ranking``; ``_resolve`` turns them into a selection and ``_explain`` words why.
The record loader needs the database driver and is imported on first use, so that importing
dispatch stays light.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from .. import registry
from ..problem import DeviceInfo, Problem
from ._explain import AUTO, Explanation, problem_and_device
from ._resolve import (
    DEFAULT_ORDER,
    SOURCES,
    NoKernelError,
    Selection,
    Table,
    forced,
    heuristic_default,
    resolve,
    table_of,
)

if TYPE_CHECKING:
    import torch

    from ._load import ENV_SNAPSHOT_TTL, LoadedRecords, load_records
    from ._ranking import (
        ENV_SHIPPED,
        layered,
        load_shipped,
        rank,
        shipped_dir,
        shipped_files,
        verified,
    )
    from ._snapshot import ENV_SNAPSHOT_DIR, Snapshot, read_snapshot, snapshot_path, write_snapshot

__all__ = [
    "DEFAULT_ORDER",
    "ENV_SHIPPED",
    "ENV_SNAPSHOT_DIR",
    "ENV_SNAPSHOT_TTL",
    "SOURCES",
    "Explanation",
    "LoadedRecords",
    "NoKernelError",
    "Selection",
    "Snapshot",
    "build_id",
    "configure",
    "counters",
    "explain",
    "heuristic_default",
    "invalidate_selections",
    "layered",
    "load_records",
    "load_shipped",
    "rank",
    "read_snapshot",
    "reload",
    "reset_counters",
    "select",
    "shipped_dir",
    "shipped_files",
    "snapshot_path",
    "verified",
    "write_snapshot",
]

#: the names of the modules that need the database driver, imported on first use
_LAZY = {
    **dict.fromkeys(("ENV_SNAPSHOT_TTL", "LoadedRecords", "load_records"), "._load"),
    **dict.fromkeys(
        ("ENV_SHIPPED", "layered", "load_shipped", "rank", "shipped_dir", "shipped_files", "verified"), "._ranking"
    ),
    **dict.fromkeys(("ENV_SNAPSHOT_DIR", "Snapshot", "read_snapshot", "snapshot_path", "write_snapshot"), "._snapshot"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


log = logging.getLogger(__name__)

#: seconds dispatch waits for a locked or unreachable database before using the defaults
READ_TIMEOUT_S = 2.0
#: seconds a statement (or a lock wait) of dispatch's read of a database server may take
STATEMENT_TIMEOUT_S = 5.0


# --------------------------------------------------------------------------- process state

_lock = threading.RLock()
#: (problem, device, backend, config) -> the selection made for it
_memo: dict[tuple[Problem, DeviceInfo | None, str | None, str | None], Selection] = {}
#: more selections than this (e.g. a decode length that keeps growing) start the memo afresh;
#: the size is looked at only when a selection is made, never on a hit
_MEMO_MAX = 4096
#: (GPU model, build id) -> what the store says about that device
_tables: dict[tuple[str, tuple[int, int], int, str], Table] = {}
_counts: dict[str, int] = dict.fromkeys(SOURCES, 0)
#: the database dispatch reads: set by configure(); None means $SPARKTUNE_DB or the default
_db_url: Any = None
#: bumped whenever the selections made so far are forgotten (configure, reload, a backend
#: registered or removed): what a caller cached from a selection is valid while it is unchanged
generation = 0
_warned: set[str] = set()


def _warn_once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _warned:
        _warned.add(key)
        log.log(level, "%s", message)


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
    """Forget the selections made so far, not the records read: called when a backend is
    registered or removed (see :func:`sparktune.registry.on_change`), since which tuned
    records can run depends on it."""
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


# --------------------------------------------------------------------------- the records, in memory


def _device_key(device: DeviceInfo) -> tuple[str, tuple[int, int], int, str]:
    return (device.name, device.capability, device.sm_count, build_id())


def _load_table(device: DeviceInfo) -> Table:
    from ._load import load_records  # the database driver, on the first read

    loaded = load_records(
        device, build_id(), db=_db_url, snapshot=True, timeout=READ_TIMEOUT_S, statement_timeout=STATEMENT_TIMEOUT_S
    )
    for notice in loaded.notices:
        _warn_once(notice.key, notice.message, notice.level)
    return table_of(loaded.ranked(), loaded.sources)


def _table(device: DeviceInfo) -> Table:
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
                    table = Table({}, {}, [])
                _tables[key] = table
    return table


# --------------------------------------------------------------------------- selection


def _resolve(problem: Problem, device: DeviceInfo | None, rejected: list[str] | None = None) -> Selection:
    registered = registry.backends()
    return resolve(problem, device, registered, _table(device) if device is not None else None, rejected)


def check_config_has_backend(backend: str | None, config: str | None) -> None:
    """A config name belongs to one backend: ``config=`` without ``backend=`` is an error."""
    if backend is None and config is not None:
        raise ValueError("config= needs backend= too (a config name belongs to one backend)")


def select(
    problem: Problem,
    device: DeviceInfo | None,
    *,
    backend: str | None = None,
    config: str | None = None,
    count: bool = True,
) -> Selection:
    """Choose the kernel for ``problem`` on ``device`` (None: no GPU, CPU tensors).
    ``count``: add the selection to :func:`counters` (a caller that counts its own calls,
    as the decode path does on its repeated calls, passes False)."""
    key = (problem, device, backend, config)
    sel = _memo.get(key)
    if sel is None:
        check_config_has_backend(backend, config)
        sel = forced(problem, device, backend, config) if backend is not None else _resolve(problem, device)
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[key] = sel
    if count:
        _counts[sel.source] += 1
    return sel


def explain(
    problem: Problem | torch.Tensor,
    device: DeviceInfo | None | Any = AUTO,
    *,
    k: torch.Tensor | None = None,
    causal: bool = False,
    layout: str = "bhnd",
    allow_fp16_accum: bool = False,
    op: str = "fwd",
    backend: str | None = None,
    config: str | None = None,
    **features: Any,
) -> Explanation:
    """Which kernel ``select`` would choose for a problem and why; counters are not touched.

    ``explain(problem, device)`` for a :class:`~sparktune.problem.Problem` (device None: CPU;
    left out: the current CUDA device if there is one), or ``explain(q, k=k, causal=...)``
    for the tensors of an ``attention()`` call, with its features as keyword arguments
    (``window``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``deterministic``: checked as
    the call checks them, and shown in the problem's key).
    """
    unknown = set(features) - {"window", "softcap", "alibi_slopes", "dropout_p", "deterministic"}
    if unknown:
        raise TypeError(f"explain() got unknown keyword argument(s): {', '.join(sorted(unknown))}")
    problem, device = problem_and_device(
        problem, device, k=k, causal=causal, layout=layout, allow_fp16_accum=allow_fp16_accum, op=op,
        features=features,
    )
    rejected: list[str] = []
    selection: Selection | None = None
    error = ""
    try:
        if backend is not None or config is not None:
            if backend is None:
                raise ValueError("config= needs backend= too")
            selection = forced(problem, device, backend, config)
        else:
            selection = _resolve(problem, device, rejected)
    except (NoKernelError, ValueError) as exc:
        error = str(exc)
    table = _table(device) if device is not None else None
    return Explanation.of(problem, device, build_id(), selection, error, table, rejected)


registry.on_change(invalidate_selections)
