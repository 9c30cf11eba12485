"""Schema version of the store, creation and step-by-step upgrades.

The version lives in ``sparktune_meta`` under ``schema_version``. A store written by a newer
sparktune (a version this code does not know) is refused, never modified.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ._engine import lock_for_schema_change, write_connection
from ._models import Base, Lease, Measurement, Meta

__all__ = [
    "SCHEMA_VERSION",
    "SchemaError",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "DECODE_COLUMNS",
    "FEATURE_COLUMNS",
    "KEY_COLUMNS",
    "ensure_schema",
    "record_columns",
    "stored_version",
]

#: the schema version this code writes
SCHEMA_VERSION = 6

#: the problem-key columns of the attention features (schema 5), with the value of "off"
FEATURE_COLUMNS = {
    "window_left": -1,
    "window_right": -1,
    "softcap": False,
    "alibi": False,
    "dropout": False,
    "deterministic": False,
    "varlen": False,
    "total_q": 0,
    "total_k": 0,
}

#: the problem-key columns of decode problems (schema 6), with the value of a dense problem
DECODE_COLUMNS = {
    "page_size": 0,
    "appends": 0,
}

#: every problem-key column added after schema 4, with the value the rows stored before read as
KEY_COLUMNS = {**FEATURE_COLUMNS, **DECODE_COLUMNS}

#: columns of the records table added by a later schema version than 2 (the oldest version a
#: store opened read-only is read at), with that version
_ADDED_COLUMNS = {
    "floor_ms": 4,
    **{name: 5 for name in FEATURE_COLUMNS},
    **{name: 6 for name in DECODE_COLUMNS},
}


def _add_column(conn: Connection, table: sa.Table, name: str) -> None:
    """ALTER TABLE ... ADD COLUMN for a column of the current model (portable DDL)."""
    col = table.c[name]
    ddl = f"ALTER TABLE {table.name} ADD COLUMN {name} {col.type.compile(dialect=conn.dialect)}"
    if col.server_default is not None:
        default = col.server_default.arg
        ddl += f" DEFAULT '{default}'" if isinstance(default, str) else ""
    if not col.nullable:
        ddl += " NOT NULL"
    conn.execute(sa.text(ddl))


def _v1_to_v2(conn: Connection) -> None:
    """Quartiles of the timing, the error bound and PyTorch's version."""
    for name in ("q1_ms", "q3_ms", "error_limit", "torch_version"):
        _add_column(conn, Measurement.__table__, name)


def _v2_to_v3(conn: Connection) -> None:
    """The lease table of distributed tuning."""
    Lease.__table__.create(conn)


def _v3_to_v4(conn: Connection) -> None:
    """The burst floor as its own column. The rows already stored keep their times as they
    are, with no floor (not recorded)."""
    _add_column(conn, Measurement.__table__, "floor_ms")


def _v4_to_v5(conn: Connection) -> None:
    """The attention features in the problem key (docs/FEATURES.md). The rows already
    stored get the values of "off" (no window, softcap, ALiBi, dropout, deterministic or
    varlen): their keys are what they were."""
    for name in FEATURE_COLUMNS:
        _add_column(conn, Measurement.__table__, name)


def _v5_to_v6(conn: Connection) -> None:
    """Decode problems in the problem key (docs/DECODING.md): op "decode", and the cache's page
    size and the appended tokens as columns. The rows already stored are dense problems: page
    size 0 and no appends, their keys are what they were."""
    for name in DECODE_COLUMNS:
        _add_column(conn, Measurement.__table__, name)


#: MIGRATIONS[n] upgrades a store at version n to n + 1, inside one transaction
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
    4: _v4_to_v5,
    5: _v5_to_v6,
}


def record_columns(version: int) -> list[sa.Column]:
    """The columns of the records table in a store at schema ``version`` (a store opened
    read-only is read as it is, without the columns of later versions)."""
    return [c for c in Measurement.__table__.c if _ADDED_COLUMNS.get(c.name, 0) <= version]


class SchemaError(RuntimeError):
    """The store's schema cannot be used."""


class SchemaTooNewError(SchemaError):
    """The store was written by a newer sparktune."""


class SchemaOutdatedError(SchemaError):
    """The store has an older schema and upgrading was not allowed."""


def stored_version(conn: Connection) -> int | None:
    """The store's schema version, or None for a database without sparktune tables."""
    insp = sa.inspect(conn)
    # the records table first: all tables appear at once when another process commits their
    # creation, so records seen before that commit imply the version table after it (reading
    # them the other way round can see the records table alone, in between)
    has_records = insp.has_table(Measurement.__tablename__)
    if not insp.has_table(Meta.__tablename__):
        if has_records:
            raise SchemaError(
                f"the database has a {Measurement.__tablename__} table but no "
                f"{Meta.__tablename__} table: it was not written by sparktune, or is damaged"
            )
        return None
    value = conn.execute(sa.select(Meta.value).where(Meta.key == "schema_version")).scalar()
    if value is None or not str(value).isdigit():
        raise SchemaError(f"the database has no valid schema_version (found {value!r})")
    return int(value)


def _check_not_newer(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise SchemaTooNewError(
            f"{where} has tuning-store schema version {version}, but this sparktune knows "
            f"versions up to {SCHEMA_VERSION}; upgrade sparktune, or use another database "
            "(--db or SPARKTUNE_DB). The database was left untouched."
        )


def _set_version(conn: Connection, version: int) -> None:
    updated = conn.execute(
        sa.update(Meta).where(Meta.key == "schema_version").values(value=str(version))
    ).rowcount
    if not updated:
        conn.execute(sa.insert(Meta).values(key="schema_version", value=str(version)))


def ensure_schema(engine: Engine, *, where: str, create: bool = True, upgrade: bool = True) -> int | None:
    """Make the store usable by this code and return its schema version (None when it has no
    tables and ``create`` is False). Creates missing tables and upgrades an older schema
    (when allowed); refuses a newer one."""
    with engine.connect() as conn, conn.begin():
        version = stored_version(conn)
    _check_not_newer(version, where)
    if version == SCHEMA_VERSION:
        return version
    if version is None and not create:
        return None
    if version is not None and not upgrade:
        raise SchemaOutdatedError(
            f"{where} has tuning-store schema version {version}; this sparktune needs "
            f"{SCHEMA_VERSION}: run `sparktune db upgrade`"
        )
    with write_connection(engine) as conn, conn.begin():
        lock_for_schema_change(conn)
        # another process may have created or upgraded it meanwhile: look again under the lock
        version = stored_version(conn)
        _check_not_newer(version, where)
        if version is None:
            Base.metadata.create_all(conn)
            _set_version(conn, SCHEMA_VERSION)
            return SCHEMA_VERSION
        while version < SCHEMA_VERSION:
            step = MIGRATIONS.get(version)
            if step is None:
                raise SchemaError(f"{where}: no upgrade from schema version {version}")
            step(conn)
            version += 1
            _set_version(conn, version)
    return version
