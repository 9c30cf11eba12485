"""The tuning store: SQLAlchemy models, schema versions, JSON Lines import/export, merging and
the lease table of distributed tuning."""

from __future__ import annotations

from ._engine import (
    ENV_DB,
    cache_dir,
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
from ._store import RowError, Store, StoreMissingError, open_error_text

__all__ = [
    "ENV_DB",
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
    "SourceReport",
    "Store",
    "StoreMissingError",
    "WinnerChange",
    "cache_dir",
    "default_path",
    "device_label",
    "dumps_record",
    "import_jsonl",
    "is_network",
    "is_transient_error",
    "merge",
    "new_owner_id",
    "now_utc",
    "open_error_text",
    "parse_jsonl",
    "parse_problem_key",
    "problem_key",
    "read_jsonl_file",
    "read_source",
    "record_from_json",
    "record_to_json",
    "registry_kernel_check",
    "resolve_url",
    "safe_url",
    "scrub",
    "validate_record",
    "work_id",
    "write_jsonl",
]
