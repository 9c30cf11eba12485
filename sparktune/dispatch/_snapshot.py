"""Dispatch's local snapshot of a shared database.

When dispatch reads a database server, it writes what it read (the records of one device model
and kernel build) to a JSON file in the user's cache directory. When the server does not
answer, dispatch uses that file instead. The file is plain JSON holding records in the JSON
Lines record format (tuning_db/README.md) and is validated the same way when read; a damaged
snapshot is ignored, never trusted. Nothing in it is executable.

The file name is a hash of the database URL without its password, the device model and the
build id; the URL inside is shown with the password hidden.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..db import Record, RecordError, cache_dir, now_utc, record_from_json, record_to_json, safe_url
from ..problem import DeviceInfo

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = ["ENV_SNAPSHOT_DIR", "SNAPSHOT_FORMAT", "Snapshot", "read_snapshot", "snapshot_path", "write_snapshot"]

#: directory of the snapshots (default: ``snapshots/`` in sparktune's user cache directory)
ENV_SNAPSHOT_DIR = "SPARKTUNE_SNAPSHOT_DIR"
SNAPSHOT_FORMAT = 1


@dataclass(frozen=True)
class Snapshot:
    path: Path
    database: str
    taken_at: datetime
    records: list[Record]


def snapshot_dir() -> Path:
    env = os.environ.get(ENV_SNAPSHOT_DIR)
    return Path(env) if env else cache_dir() / "snapshots"


def snapshot_path(url: URL, device: DeviceInfo, build_id: str) -> Path:
    ident = "\n".join([
        safe_url(url),
        device.name, f"{device.capability[0]}.{device.capability[1]}", str(device.sm_count), build_id,
    ])
    digest = hashlib.sha1(ident.encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in (url.host or url.get_backend_name()))[:40]
    return snapshot_dir() / f"{host}-{digest}.json"


def write_snapshot(path: Path, records: Sequence[Record], *, database: str, device: DeviceInfo, build_id: str) -> bool:
    """Write the snapshot atomically (a reader sees the old file or the new one, never half of
    one). An unchanged snapshot is left alone. Returns whether the file was written."""
    body: dict[str, Any] = {
        "snapshot": SNAPSHOT_FORMAT,
        "database": database,
        "device": {"name": device.name, "capability": list(device.capability), "sm_count": device.sm_count},
        "build_id": build_id,
        "records": sorted((record_to_json(r) for r in records), key=lambda j: j["uid"]),
    }
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(old, dict) and {**old, "taken_at": None} == {**body, "taken_at": None}:
            return False
    except (OSError, ValueError):
        pass
    body["taken_at"] = now_utc().isoformat().replace("+00:00", "Z")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            json.dump(body, fp, separators=(",", ":"), allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def read_snapshot(path: Path) -> Snapshot:
    """Read and validate a snapshot; raises OSError or ValueError (naming the problem)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("snapshot") != SNAPSHOT_FORMAT:
        raise ValueError(f"{path}: not a sparktune snapshot of format {SNAPSHOT_FORMAT}")
    recs = data.get("records")
    if not isinstance(recs, list):
        raise ValueError(f"{path}: no record list")
    try:
        when = datetime.fromisoformat(str(data.get("taken_at", "")).replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{path}: taken_at is not a time") from None
    source = f"snapshot {path.name}"
    records = []
    for i, obj in enumerate(recs):
        try:
            records.append(record_from_json(obj, source=source))
        except RecordError as e:
            raise ValueError(f"{path}: record {i}: {e}") from None
    return Snapshot(path, str(data.get("database", "")), when, records)
