"""``db merge``: records of other databases and files into this one.

Every record of every source is validated as ``db import`` validates a line (the record
format, then the kernel check) before anything is written; with errors, nothing is merged
unless the caller skips the invalid records. Records keep their provenance (uid, host, GPU,
time, library version) and are never rewritten: a record already here (same uid) is left as it
is. Records of other GPU models and kernel builds are kept too; dispatch never uses them on a
machine they do not match. Which record wins for a problem is the caller's ranking rule (``rank``;
dispatch's, :func:`sparktune.dispatch.rank`: of the verified figures of a candidate, the
fastest, so that for the same key the faster verified record wins); the report lists the
problems whose winner changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url

from ..problem import Problem
from ._jsonl import LineError, read_jsonl_file
from ._records import Record, RecordError, device_label, problem_key, validate_record
from ._store import RowError, Store, open_error_text

__all__ = ["MergeReport", "SourceReport", "WinnerChange", "merge", "read_source"]

KernelCheck = Callable[[Record], "str | None"]
#: records -> the usable ones per problem, best first
Ranking = Callable[[Iterable[Record]], "dict[Problem, list[Record]]"]

_SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass
class SourceReport:
    source: str
    read: int = 0
    added: int = 0
    duplicates: int = 0
    errors: list[LineError] = field(default_factory=list)
    #: why the source could not be read at all ("" when it was)
    failed: str = ""


@dataclass(frozen=True)
class WinnerChange:
    """A problem whose best record on a device model and build changed with the merge."""

    key: str
    device: str
    build_id: str
    before: Record | None
    after: Record


@dataclass
class MergeReport:
    into: str
    sources: list[SourceReport] = field(default_factory=list)
    added: int = 0
    refused: bool = False
    dry_run: bool = False
    changes: list[WinnerChange] = field(default_factory=list)
    #: (device, build id) -> records added
    added_by_device: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def errors(self) -> list[LineError]:
        return [e for s in self.sources for e in s.errors]


def _validated(records: Iterable[Record], source: str, check: KernelCheck | None) -> tuple[list[Record], list[LineError]]:
    good: list[Record] = []
    errors: list[LineError] = []
    for i, r in enumerate(records, start=1):
        try:
            v = validate_record(r)
        except RecordError as e:
            errors.append(LineError(source, i, f"record {r.uid}: {e}"))
            continue
        problem = check(v) if check is not None else None
        if problem:
            errors.append(LineError(source, i, f"record {r.uid}: {problem}"))
            continue
        v.source = source
        good.append(v)
    return good, errors


def read_source(src: str, *, check: KernelCheck | None = None) -> tuple[list[Record], SourceReport]:
    """The valid records of one source -- a database URL, a SQLite file or a JSON Lines file
    (as ``db export`` writes it) -- and its report (invalid records with their position).
    A database source is opened read-only and never changed."""
    path = Path(src).expanduser()
    if "://" not in src and path.is_file():
        with path.open("rb") as fp:
            magic = fp.read(len(_SQLITE_MAGIC))
        if magic != _SQLITE_MAGIC:
            rep = SourceReport(str(path))
            try:
                good, errors = read_jsonl_file(path, check=check)
            except OSError as e:
                rep.failed = f"cannot read: {e.strerror or e}"
                return [], rep
            rep.read = len(good) + len(errors)
            rep.errors = errors
            records = [r for _, r in good]
            for r in records:
                r.source = str(path)
            return records, rep
        url = make_url(f"sqlite:///file:{path.resolve()}?mode=ro&uri=true")
        display = str(path)
    elif "://" not in src:
        return [], SourceReport(src, failed="no such file")
    else:
        url = None
        display = ""
    invalid: list[RowError] = []
    try:
        if url is None:
            url = make_url(src)
        with Store(url, create=False, readonly=True) as store:
            display = display or store.display_url
            raw = store.records(errors=invalid)
    except Exception as exc:  # noqa: BLE001 - one line, no password
        from ._engine import safe_url

        return [], SourceReport(display or safe_url(src), failed=open_error_text(exc, src))
    good, errors = _validated(raw, display, check)
    # rows that are not records at all are invalid records of the source, like a bad line
    errors = [LineError(display, e.row, f"record {e.uid} (row id {e.row}): {e.message}") for e in invalid] + errors
    return good, SourceReport(display, read=len(raw) + len(invalid), errors=errors)


def _group(r: Record) -> tuple[str, tuple[int, int], int, str]:
    return (r.device.name, r.device.capability, r.device.sm_count, r.build_id)


def _winners(records: Sequence[Record], groups: set[tuple], rank: Ranking) -> dict[tuple, Record]:
    by_group: dict[tuple, list[Record]] = {}
    for r in records:
        g = _group(r)
        if g in groups:
            by_group.setdefault(g, []).append(r)
    out: dict[tuple, Record] = {}
    for g, recs in by_group.items():
        for problem, ranked in rank(recs).items():
            out[(*g, problem)] = ranked[0]
    return out


def merge(
    store: Store,
    sources: Sequence[str],
    *,
    skip_invalid: bool = False,
    check: KernelCheck | None = None,
    dry_run: bool = False,
    rank: Ranking | None = None,
) -> MergeReport:
    """Merge ``sources`` into ``store`` in one transaction (see the module docstring). With
    ``rank``, the report lists the problems whose best record changed."""
    report = MergeReport(store.display_url, dry_run=dry_run)
    incoming: list[Record] = []
    for src in sources:
        records, rep = read_source(src, check=check)
        report.sources.append(rep)
        incoming.extend(records)
    if any(s.failed for s in report.sources) or (report.errors and not skip_invalid):
        report.refused = True
        return report
    existing = store.records(errors=[])  # a damaged row here is not a candidate to win
    have = {r.uid for r in existing}
    fresh: list[Record] = []
    for r in incoming:
        if r.uid in have:
            continue
        have.add(r.uid)
        fresh.append(r)
    per_source: dict[str, int] = {}
    for r in fresh:
        per_source[r.source] = per_source.get(r.source, 0) + 1
    for rep in report.sources:
        rep.added = per_source.get(rep.source, 0)
        rep.duplicates = rep.read - len(rep.errors) - rep.added
    for r in fresh:
        k = (device_label(r.device), r.build_id)
        report.added_by_device[k] = report.added_by_device.get(k, 0) + 1
    if rank is not None:
        groups = {_group(r) for r in fresh}
        before = _winners(existing, groups, rank)
        after = _winners([*existing, *fresh], groups, rank)
        for k, rec in sorted(after.items(), key=lambda kv: (problem_key(kv[0][4]), kv[0][0], kv[0][3])):
            old = before.get(k)
            if old is None or old.uid != rec.uid:
                report.changes.append(WinnerChange(problem_key(k[4]), device_label(rec.device), rec.build_id, old, rec))
    if not dry_run and fresh:
        report.added = store.add(fresh)
    elif dry_run:
        report.added = len(fresh)
    return report
