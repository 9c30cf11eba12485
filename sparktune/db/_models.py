"""SQLAlchemy 2.0 models of the tuning store (the current schema version)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "Lease", "Measurement", "Meta"]


class Base(DeclarativeBase):
    pass


class Meta(Base):
    """Key/value facts about the store itself; ``schema_version`` is the one that matters."""

    __tablename__ = "sparktune_meta"

    key: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    value: Mapped[str] = mapped_column(sa.String(255))


class Measurement(Base):
    """One measured candidate: the problem key, the device fingerprint and build id, and what
    was measured. Every candidate of every tuning run is kept, not only the winner."""

    __tablename__ = "sparktune_records"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(sa.String(64), unique=True)

    # problem
    op: Mapped[str] = mapped_column(sa.String(8))
    dtype: Mapped[str] = mapped_column(sa.String(16))
    batch: Mapped[int] = mapped_column(sa.Integer)
    heads_q: Mapped[int] = mapped_column(sa.Integer)
    heads_kv: Mapped[int] = mapped_column(sa.Integer)
    seqlen_q: Mapped[int] = mapped_column(sa.Integer)
    seqlen_k: Mapped[int] = mapped_column(sa.Integer)
    head_dim: Mapped[int] = mapped_column(sa.Integer)
    causal: Mapped[bool] = mapped_column(sa.Boolean)
    allow_fp16_accum: Mapped[bool] = mapped_column(sa.Boolean)
    # the attention features (schema 5; the rows stored before read as "off")
    window_left: Mapped[int] = mapped_column(sa.Integer, default=-1, server_default="-1")
    window_right: Mapped[int] = mapped_column(sa.Integer, default=-1, server_default="-1")
    softcap: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default="0")
    alibi: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default="0")
    dropout: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default="0")
    deterministic: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default="0")
    varlen: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default="0")
    total_q: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    total_k: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    # decode problems (schema 6; the rows stored before are dense: 0)
    page_size: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    appends: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")

    # device fingerprint and kernel-family build
    device_name: Mapped[str] = mapped_column(sa.String(128))
    cc_major: Mapped[int] = mapped_column(sa.Integer)
    cc_minor: Mapped[int] = mapped_column(sa.Integer)
    sm_count: Mapped[int] = mapped_column(sa.Integer)
    driver: Mapped[str] = mapped_column(sa.String(64), default="")
    cuda: Mapped[str] = mapped_column(sa.String(32), default="")
    build_id: Mapped[str] = mapped_column(sa.String(64))

    # value
    backend: Mapped[str] = mapped_column(sa.String(64))
    config: Mapped[str] = mapped_column(sa.String(255))
    status: Mapped[str] = mapped_column(sa.String(16))
    median_ms: Mapped[float | None] = mapped_column(sa.Float)
    min_ms: Mapped[float | None] = mapped_column(sa.Float)
    max_ms: Mapped[float | None] = mapped_column(sa.Float)
    # quartiles (schema 2): the spread that a shared GPU's noise leaves least affected
    q1_ms: Mapped[float | None] = mapped_column(sa.Float)
    q3_ms: Mapped[float | None] = mapped_column(sa.Float)
    # the burst floor, apart from the runs (schema 4): per-call time of back-to-back calls
    floor_ms: Mapped[float | None] = mapped_column(sa.Float)
    runs: Mapped[int] = mapped_column(sa.Integer, default=0)
    tflops: Mapped[float | None] = mapped_column(sa.Float)
    error: Mapped[float | None] = mapped_column(sa.Float)
    # the bound the error was checked against (schema 2)
    error_limit: Mapped[float | None] = mapped_column(sa.Float)
    message: Mapped[str] = mapped_column(sa.Text, default="")

    # provenance
    host: Mapped[str] = mapped_column(sa.String(255), default="")
    measured_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    version: Mapped[str] = mapped_column(sa.String(32), default="")
    # PyTorch's version matters for its SDPA candidates (schema 2)
    torch_version: Mapped[str] = mapped_column(sa.String(32), default="", server_default="")

    __table_args__ = (
        sa.Index("ix_sparktune_records_device", "device_name", "cc_major", "cc_minor", "sm_count", "build_id"),
        sa.Index(
            "ix_sparktune_records_problem",
            "op", "dtype", "head_dim", "seqlen_q", "seqlen_k", "batch", "heads_q",
        ),
    )


class Lease(Base):
    """A claim on one unit of distributed tuning work (schema 3): one problem on one device
    fingerprint and kernel build, within a named run. A worker holds the lease while it tunes
    and renews it by heartbeat; an expired lease may be taken over by another worker; a
    finished one (``done``) is never tuned again in that run. Times are the database server's
    clock, in seconds since the epoch, so that the worker hosts' clocks do not matter."""

    __tablename__ = "sparktune_leases"

    #: sha1 of the run name and the label
    work: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    run: Mapped[str] = mapped_column(sa.String(128), default="")
    #: problem key, device fingerprint and build id, readable
    label: Mapped[str] = mapped_column(sa.Text)
    #: the worker holding (or that last held) the lease: host:pid:token
    owner: Mapped[str] = mapped_column(sa.String(255))
    #: "running", "done" or "failed"
    state: Mapped[str] = mapped_column(sa.String(16))
    #: how many times the work was claimed (a takeover counts)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=1)
    claimed_at: Mapped[float] = mapped_column(sa.Float)
    heartbeat_at: Mapped[float] = mapped_column(sa.Float)
    expires_at: Mapped[float] = mapped_column(sa.Float)
    finished_at: Mapped[float | None] = mapped_column(sa.Float)
    #: records committed with the finish
    records: Mapped[int] = mapped_column(sa.Integer, default=0)
    message: Mapped[str] = mapped_column(sa.Text, default="")

    __table_args__ = (sa.Index("ix_sparktune_leases_run", "run", "state"),)
