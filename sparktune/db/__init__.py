"""The tuning store: SQLAlchemy models, schema versions, JSON Lines import/export, the
read-only shipped layer, merging, the lease table of distributed tuning and dispatch's
snapshot of a shared database."""

from __future__ import annotations

from ._engine import (
    ENV_DB,
    default_path,
    is_network,
    is_transient_error,
    resolve_url,
    safe_url,
    scrub,
)
from ._jsonl import (
    ImportReport,
    LineError,
    dumps_record,
    import_jsonl,
    parse_jsonl,
    read_jsonl_file,
    registry_kernel_check,
    write_jsonl,
)
from ._layers import (
    ENV_SHIPPED,
    layered,
    load_shipped,
    rank,
    shipped_dir,
    shipped_files,
    verified,
)
from ._leases import Claim, LeaseBoard, LeaseInfo, LeaseLost, new_owner_id, work_id
from ._merge import MergeReport, SourceReport, WinnerChange, merge, read_source
from ._records import (
    FORMAT_VERSION,
    STATUSES,
    Record,
    RecordError,
    device_label,
    now_utc,
    parse_problem_key,
    problem_key,
    record_from_json,
    record_to_json,
    validate_record,
)
from ._schema import SCHEMA_VERSION, SchemaError, SchemaOutdatedError, SchemaTooNewError
from ._snapshot import ENV_SNAPSHOT_DIR, Snapshot, read_snapshot, snapshot_path, write_snapshot
from ._store import RowError, Store, StoreMissingError, open_error_text

__all__ = [
    "ENV_DB",
    "ENV_SHIPPED",
    "ENV_SNAPSHOT_DIR",
    "FORMAT_VERSION",
    "SCHEMA_VERSION",
    "STATUSES",
    "Claim",
    "ImportReport",
    "LeaseBoard",
    "LeaseInfo",
    "LeaseLost",
    "LineError",
    "MergeReport",
    "Record",
    "RecordError",
    "RowError",
    "SchemaError",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "Snapshot",
    "SourceReport",
    "Store",
    "StoreMissingError",
    "WinnerChange",
    "default_path",
    "device_label",
    "dumps_record",
    "import_jsonl",
    "is_network",
    "is_transient_error",
    "layered",
    "load_shipped",
    "merge",
    "new_owner_id",
    "now_utc",
    "open_error_text",
    "parse_jsonl",
    "parse_problem_key",
    "problem_key",
    "rank",
    "read_jsonl_file",
    "read_snapshot",
    "read_source",
    "record_from_json",
    "record_to_json",
    "registry_kernel_check",
    "resolve_url",
    "safe_url",
    "scrub",
    "shipped_dir",
    "shipped_files",
    "snapshot_path",
    "validate_record",
    "verified",
    "work_id",
    "write_jsonl",
    "write_snapshot",
]
