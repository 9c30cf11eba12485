"""JSON Lines export and validated import of tuning records."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ._records import Record, RecordError, record_from_json, record_to_json
from ._store import Store

__all__ = [
    "ImportReport",
    "LineError",
    "dumps_record",
    "import_jsonl",
    "parse_jsonl",
    "read_jsonl_file",
    "write_jsonl",
]

#: a check of a record beyond its format (e.g. that its kernel exists here): the reason it is
#: refused, or None (see :func:`sparktune.registry.kernel_check`)
KernelCheck = Callable[[Record], "str | None"]


@dataclass(frozen=True)
class LineError:
    source: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.message}"


@dataclass
class ImportReport:
    read: int = 0
    added: int = 0
    duplicates: int = 0
    skipped: int = 0
    refused: bool = False
    errors: list[LineError] = field(default_factory=list)


def dumps_record(r: Record) -> str:
    return json.dumps(record_to_json(r), separators=(", ", ": "), allow_nan=False)


def write_jsonl(records: Iterable[Record], fp: IO[str]) -> int:
    n = 0
    for r in records:
        fp.write(dumps_record(r) + "\n")
        n += 1
    return n


def parse_jsonl(
    lines: Iterable[str | bytes], *, source: str, check: KernelCheck | None = None
) -> tuple[list[tuple[int, Record]], list[LineError]]:
    """Validate every line (text, or bytes in UTF-8); blank lines are allowed. Returns (line
    number, record) pairs and the errors, each with its line number."""
    good: list[tuple[int, Record]] = []
    errors: list[LineError] = []
    for lineno, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(LineError(source, lineno, f"not UTF-8 text: byte {raw[e.start]:#04x} at column {e.start + 1}"))
                continue
        else:
            text = raw
        if lineno == 1 and text.startswith("\ufeff"):
            text = text[1:]
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append(LineError(source, lineno, f"not valid JSON: {e.msg} (column {e.colno})"))
            continue
        except RecursionError:
            errors.append(LineError(source, lineno, "not valid JSON: nested too deeply"))
            continue
        try:
            rec = record_from_json(obj, source=source)
        except RecordError as e:
            errors.append(LineError(source, lineno, str(e)))
            continue
        problem = check(rec) if check is not None else None
        if problem:
            errors.append(LineError(source, lineno, problem))
            continue
        good.append((lineno, rec))
    return good, errors


def read_jsonl_file(path: str | Path, *, check: KernelCheck | None = None) -> tuple[list[tuple[int, Record]], list[LineError]]:
    path = Path(path)
    with path.open("rb") as fp:
        return parse_jsonl(fp, source=str(path), check=check)


def import_jsonl(
    store: Store,
    path: str | Path,
    *,
    skip_invalid: bool = False,
    check: KernelCheck | None = None,
) -> ImportReport:
    """Import a JSON Lines file. Every line is validated before anything is written; with
    errors, the whole file is refused unless ``skip_invalid`` (then the valid lines are
    imported). Records already in the store (same uid) are counted as duplicates."""
    good, errors = read_jsonl_file(path, check=check)
    report = ImportReport(read=len(good) + len(errors), errors=errors)
    if errors and not skip_invalid:
        report.refused = True
        return report
    report.skipped = len(errors)
    records = [r for _, r in good]
    report.added = store.add(records)
    report.duplicates = len(records) - report.added
    return report
