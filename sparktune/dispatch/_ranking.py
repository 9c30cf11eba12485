"""Layers of records and how the best candidate of a problem is chosen from them.

Layers, most specific first: the user's (or shared) database -- or, when a shared server is
unreachable, dispatch's local snapshot of it -- then the read-only files shipped in
``tuning_db/`` (one JSON Lines file per GPU model). For a problem, the first layer that has a
usable record decides. Within a layer: each host's latest measurement of a candidate counts (a
re-tune replaces that host's figure, and a later failure hides that host's earlier success);
of several hosts' figures for one candidate the faster verified one counts (records merged
from other machines compete on speed); records measured with this exact driver and CUDA
version are preferred over records of the same GPU model with another driver; candidates are
ranked by median time. Verified: status ``ok`` (checked against the reference, then timed)
and, where both are known, an error within the bound it was checked against.
:func:`~sparktune.dispatch.load_records` reads the layers of a device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..db import LineError, Record, read_jsonl_file
from ..problem import DeviceInfo, Problem

__all__ = [
    "ENV_SHIPPED", "layered", "load_shipped", "packaged_dir", "rank", "shipped_dir", "shipped_files", "verified",
]

#: directory of shipped records (overrides the packaged one; empty: no shipped layer)
ENV_SHIPPED = "SPARKTUNE_SHIPPED_DB"


def shipped_dir() -> Path | None:
    """The directory of the shipped records: ``$SPARKTUNE_SHIPPED_DB`` when set (empty: none),
    else the one that comes with this package (see :func:`packaged_dir`)."""
    env = os.environ.get(ENV_SHIPPED)
    if env is not None:
        return Path(env) if env else None
    return packaged_dir(Path(__file__).resolve().parent.parent)


def packaged_dir(package: Path) -> Path | None:
    """The shipped records of the sparktune package at ``package``: ``tuning_db/`` inside it
    (an installed wheel carries them there), else ``tuning_db/`` beside it when the package
    sits in a source checkout (next to ``pyproject.toml``); None otherwise. A ``tuning_db``
    directory beside an installed package (another project's, in site-packages) is not ours."""
    inside = package / "tuning_db"
    if inside.is_dir():
        return inside
    root = package.parent
    beside = root / "tuning_db"
    if beside.is_dir() and (root / "pyproject.toml").is_file():
        return beside
    return None


def shipped_files(directory: Path | None = None) -> list[Path]:
    d = directory if directory is not None else shipped_dir()
    if d is None or not d.is_dir():
        return []
    return sorted(d.glob("*.jsonl"))


def load_shipped(directory: Path | None = None) -> tuple[list[Record], list[LineError]]:
    """Every valid record of the shipped files, and the errors of the invalid lines."""
    records: list[Record] = []
    errors: list[LineError] = []
    for path in shipped_files(directory):
        try:
            good, bad = read_jsonl_file(path)
        except OSError as e:
            errors.append(LineError(str(path), 0, f"cannot read: {e}"))
            continue
        for _, r in good:
            r.source = f"shipped:{path.name}"
            records.append(r)
        errors.extend(bad)
    return records, errors


def _same_fingerprint(r: Record, device: DeviceInfo | None) -> bool:
    return device is not None and r.device.driver == device.driver and r.device.cuda == device.cuda


def verified(r: Record) -> bool:
    """An ``ok`` record with a time, within its error bound where both are known."""
    if r.status != "ok" or r.median_ms is None:
        return False
    return r.error is None or r.error_limit is None or r.error <= r.error_limit


def rank(records: Iterable[Record], device: DeviceInfo | None = None) -> dict[Problem, list[Record]]:
    """Usable records per problem, fastest first: each host's latest measurement of each
    candidate (a later failure or wrong result on a host removes that host's figure), verified
    ones only; a candidate measured on several hosts counts with its fastest figure."""
    latest: dict[tuple, Record] = {}
    for r in records:
        key = (r.problem, r.device.driver, r.device.cuda, r.backend, r.config, r.host)
        old = latest.get(key)
        if old is None or r.measured_at >= old.measured_at:
            latest[key] = r
    per_problem: dict[Problem, list[Record]] = {}
    for r in latest.values():
        if verified(r):
            per_problem.setdefault(r.problem, []).append(r)
    out: dict[Problem, list[Record]] = {}
    for problem, recs in per_problem.items():
        exact = [r for r in recs if _same_fingerprint(r, device)]
        chosen = exact or recs
        chosen.sort(key=lambda r: (r.median_ms, r.backend, r.config, r.measured_at, r.uid))
        # one entry per candidate (records of other drivers may repeat it)
        seen: set[tuple[str, str]] = set()
        out[problem] = [r for r in chosen if not ((r.backend, r.config) in seen or seen.add((r.backend, r.config)))]
    return out


def layered(layers: Sequence[Iterable[Record]], device: DeviceInfo | None = None) -> dict[Problem, list[Record]]:
    """Merge ranked layers, most specific first: a problem takes the first layer that has it."""
    out: dict[Problem, list[Record]] = {}
    for layer in layers:
        for problem, recs in rank(layer, device).items():
            out.setdefault(problem, recs)
    return out
