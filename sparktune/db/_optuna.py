"""The Optuna RDB storage of the tuner's studies, in the tuning database."""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from ._engine import make_engine, postgres_connect_args, resolve_url

__all__ = ["optuna_storage"]


#: key of the PostgreSQL advisory lock taken while Optuna creates its tables ("SPOT")
_OPTUNA_INIT_LOCK = 0x53504F54


def optuna_storage(url: Any) -> Any:
    """None (in memory) or an RDB storage on ``url`` sharing the tuning database.

    Connections are tested before use (a restarted server is reconnected to) and, on
    PostgreSQL, have a connect timeout and TCP keepalives. Optuna creates its tables when they
    are missing; workers starting together on a fresh database take turns (an advisory lock
    on PostgreSQL, a retry on SQLite) instead of racing on CREATE TABLE."""
    if url is None:
        return None
    import optuna  # the tuner's optional dependency: only when a study is stored

    resolved = resolve_url(url)
    kwargs: dict[str, Any] = {"pool_pre_ping": False}
    backend = resolved.get_backend_name()
    if backend == "sqlite":
        kwargs["connect_args"] = {"timeout": 60}
    elif backend == "postgresql":
        kwargs["connect_args"] = postgres_connect_args(resolved, timeout=10)
    text = resolved.render_as_string(hide_password=False)
    if backend == "postgresql":
        engine = make_engine(resolved, timeout=10)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": _OPTUNA_INIT_LOCK})
                try:
                    return optuna.storages.RDBStorage(text, engine_kwargs=kwargs)
                finally:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": _OPTUNA_INIT_LOCK})
        finally:
            engine.dispose()
    for attempt in range(20):
        try:
            return optuna.storages.RDBStorage(text, engine_kwargs=kwargs)
        except sa.exc.OperationalError:  # another process is creating the same tables
            if attempt == 19:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")
