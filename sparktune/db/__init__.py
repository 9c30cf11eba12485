"""The tuning store: storage only. SQLAlchemy models and schema versions, the store's records
in and out (JSON Lines import and export, merging other stores and files), where the store
lives and how to connect to it, the Optuna storage of the tuner's studies in the same database,
and the building blocks of the tables other layers keep there (the tuner's leases).

What records a device sees, their ranking and the local snapshot of a shared server are
dispatch's (:mod:`sparktune.dispatch`); the leases of distributed tuning are the tuner's."""

from __future__ import annotations

from ._engine import (
    ENV_DB,
    cache_dir,
    default_path,
    insert_ignore,
    is_network,
    is_transient_error,
    resolve_url,
    safe_url,
    scrub,
    server_time,
    write_connection,
)
from ._jsonl import (
    ImportReport,
    LineError,
    dumps_record,
    import_jsonl,
    parse_jsonl,
    read_jsonl_file,
    write_jsonl,
)
from ._merge import MergeReport, SourceReport, WinnerChange, merge
from ._models import Lease
from ._optuna import optuna_storage
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
)
from ._schema import SCHEMA_VERSION, SchemaError, SchemaOutdatedError, SchemaTooNewError
from ._store import RowError, Store, StoreMissingError, open_error_text, with_retry

__all__ = [
    # the store and its records
    "FORMAT_VERSION",
    "SCHEMA_VERSION",
    "STATUSES",
    "Record",
    "RecordError",
    "RowError",
    "SchemaError",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "Store",
    "StoreMissingError",
    "device_label",
    "now_utc",
    "open_error_text",
    "parse_problem_key",
    "problem_key",
    "record_from_json",
    "record_to_json",
    # where it lives
    "ENV_DB",
    "cache_dir",
    "default_path",
    "is_network",
    "is_transient_error",
    "resolve_url",
    "safe_url",
    "scrub",
    # import, export, merge
    "ImportReport",
    "LineError",
    "MergeReport",
    "SourceReport",
    "WinnerChange",
    "dumps_record",
    "import_jsonl",
    "merge",
    "parse_jsonl",
    "read_jsonl_file",
    "write_jsonl",
    # the tuner's Optuna studies, stored in the same database
    "optuna_storage",
    # for the tables other layers keep in the store (the tuner's leases)
    "Lease",
    "insert_ignore",
    "server_time",
    "with_retry",
    "write_connection",
]
