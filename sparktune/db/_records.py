"""A tuning record (one measured candidate) and its JSON Lines form.

The JSON form is documented in ``tuning_db/README.md``; the validation here is the one
``sparktune db import`` and the shipped layer use, so an error always names the field.
"""

from __future__ import annotations

import math
import re
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..problem import DTYPES, OPS, DeviceInfo, Problem

__all__ = [
    "FORMAT_VERSION",
    "STATUSES",
    "Record",
    "RecordError",
    "device_label",
    "now_utc",
    "parse_problem_key",
    "problem_key",
    "record_from_json",
    "record_to_json",
    "validate_record",
]

#: version of the JSON Lines record format (independent of the SQL schema version)
FORMAT_VERSION = 1

#: ok: checked against the reference and timed; wrong: failed the reference check (never
#: dispatched); failed: raised or crashed while running
STATUSES = ("ok", "wrong", "failed")


class RecordError(ValueError):
    """A record that does not follow the schema. ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}" if field_name else message)
        self.field = field_name
        self.message = message


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def _default_host() -> str:
    try:
        return socket.gethostname()
    except OSError:  # pragma: no cover - exotic platforms
        return ""


@dataclass
class Record:
    """One measurement of one candidate for one problem on one device and build."""

    problem: Problem
    device: DeviceInfo
    build_id: str
    backend: str
    config: str
    status: str = "ok"
    #: the time candidates are ranked by: the runs' median, or, when the burst floor exceeds
    #: it, the median of the runs each counted at least the floor
    median_ms: float | None = None
    #: the runs as measured (each alone, L2 flushed before it); None where not known
    min_ms: float | None = None
    max_ms: float | None = None
    q1_ms: float | None = None
    q3_ms: float | None = None
    #: the burst floor: time per call of a burst of back-to-back calls (None: not measured)
    floor_ms: float | None = None
    runs: int = 0
    tflops: float | None = None
    #: max abs error against the float64 reference (worst output for bwd)
    error: float | None = None
    #: the bound ``error`` was checked against (twice PyTorch's own error, plus rounding)
    error_limit: float | None = None
    message: str = ""
    host: str = field(default_factory=_default_host)
    measured_at: datetime = field(default_factory=now_utc)
    version: str = ""
    torch_version: str = ""
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: where the record was read from ("" when it was just made); not stored
    source: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.config}"

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise RecordError("status", f"must be one of {STATUSES}, got {self.status!r}")


# --------------------------------------------------------------------------- key text

#: the problem's feature fields in a record's JSON, with their "off" value (written only when
#: on; absent means off)
_FEATURE_FIELDS: dict[str, Any] = {
    "window_left": -1,
    "window_right": -1,
    "softcap": False,
    "alibi": False,
    "dropout": False,
    "deterministic": False,
    "varlen": False,
    "total_q": 0,
    "total_k": 0,
    # decode problems (docs/DECODING.md)
    "page_size": 0,
    "appends": 0,
}


def problem_key(p: Problem) -> str:
    """Compact, parseable text of a problem key, e.g.
    ``fwd:float16:b1:h12/12:n8192/8192:d128:full:acc32`` (``causal`` instead of ``full`` for
    a causal mask, ``acc16`` when FP16 accumulation is allowed), followed by the features that
    are on, in this order: ``:w<left>/<right>`` (a window, -1 unlimited), ``:softcap``,
    ``:alibi``, ``:dropout``, ``:det`` (deterministic), ``:varlen<total_q>/<total_k>``, and for
    a decode problem (op ``decode``: ``n<Nq>/<cache-length bucket>``) ``:page<size>`` (a paged
    cache) and ``:new<appends>``; a problem without features keeps the key it always had."""
    key = (
        f"{p.op}:{p.dtype}:b{p.batch}:h{p.heads_q}/{p.heads_kv}:n{p.seqlen_q}/{p.seqlen_k}"
        f":d{p.head_dim}:{'causal' if p.causal else 'full'}"
        f":{'acc16' if p.allow_fp16_accum else 'acc32'}"
    )
    if p.features:
        if "window" in p.features:
            key += f":w{p.window_left}/{p.window_right}"
        for flag, text in ((p.softcap, "softcap"), (p.alibi, "alibi"), (p.dropout, "dropout"),
                           (p.deterministic, "det")):
            if flag:
                key += f":{text}"
        if p.varlen:
            key += f":varlen{p.total_q}/{p.total_k}"
        if p.page_size:
            key += f":page{p.page_size}"
        if p.appends:
            key += f":new{p.appends}"
    return key


_KEY_RE = re.compile(
    r"^(?P<op>\w+):(?P<dtype>\w+):b(?P<batch>\d+):h(?P<hq>\d+)/(?P<hkv>\d+)"
    r":n(?P<sq>\d+)/(?P<sk>\d+):d(?P<hd>\d+):(?P<mask>causal|full):(?P<acc>acc16|acc32)"
    r"(?::w(?P<wl>-?\d+)/(?P<wr>-?\d+))?(?P<softcap>:softcap)?(?P<alibi>:alibi)?"
    r"(?P<dropout>:dropout)?(?P<det>:det)?(?::varlen(?P<tq>\d+)/(?P<tk>\d+))?"
    r"(?::page(?P<page>\d+))?(?::new(?P<new>\d+))?$"
)


def parse_problem_key(text: str) -> Problem:
    m = _KEY_RE.match(text.strip())
    if not m:
        raise ValueError(
            f"not a problem key: {text!r} (expected e.g. fwd:float16:b1:h12/12:n8192/8192:d128:full:acc32)"
        )
    return Problem(
        op=m["op"],
        dtype=m["dtype"],
        batch=int(m["batch"]),
        heads_q=int(m["hq"]),
        heads_kv=int(m["hkv"]),
        seqlen_q=int(m["sq"]),
        seqlen_k=int(m["sk"]),
        head_dim=int(m["hd"]),
        causal=m["mask"] == "causal",
        allow_fp16_accum=m["acc"] == "acc16",
        window_left=int(m["wl"]) if m["wl"] is not None else -1,
        window_right=int(m["wr"]) if m["wr"] is not None else -1,
        softcap=m["softcap"] is not None,
        alibi=m["alibi"] is not None,
        dropout=m["dropout"] is not None,
        deterministic=m["det"] is not None,
        varlen=m["tq"] is not None,
        total_q=int(m["tq"]) if m["tq"] is not None else 0,
        total_k=int(m["tk"]) if m["tk"] is not None else 0,
        page_size=int(m["page"]) if m["page"] is not None else 0,
        appends=int(m["new"]) if m["new"] is not None else 0,
    )


def device_label(d: DeviceInfo) -> str:
    return f"{d.name} sm_{d.arch} {d.sm_count}SM"


# --------------------------------------------------------------------------- JSON


def _iso(t: datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def record_to_json(r: Record) -> dict[str, Any]:
    """The JSON object of one record (see tuning_db/README.md)."""
    p = r.problem
    problem: dict[str, Any] = {
        "op": p.op,
        "dtype": p.dtype,
        "batch": p.batch,
        "heads_q": p.heads_q,
        "heads_kv": p.heads_kv,
        "seqlen_q": p.seqlen_q,
        "seqlen_k": p.seqlen_k,
        "head_dim": p.head_dim,
        "causal": p.causal,
        "allow_fp16_accum": p.allow_fp16_accum,
    }
    if p.features:  # only the features that are on: a plain record's line is unchanged
        for name, off in _FEATURE_FIELDS.items():
            value = getattr(p, name)
            if value != off:
                problem[name] = value
    return {
        "format": FORMAT_VERSION,
        "uid": r.uid,
        "problem": problem,
        "device": {
            "name": r.device.name,
            "capability": list(r.device.capability),
            "sm_count": r.device.sm_count,
            "driver": r.device.driver,
            "cuda": r.device.cuda,
        },
        "build_id": r.build_id,
        "backend": r.backend,
        "config": r.config,
        "status": r.status,
        "time_ms": {
            "median": r.median_ms,
            "min": r.min_ms,
            "max": r.max_ms,
            "q1": r.q1_ms,
            "q3": r.q3_ms,
            "floor": r.floor_ms,
        },
        "runs": r.runs,
        "tflops": r.tflops,
        "error": r.error,
        "error_limit": r.error_limit,
        "message": r.message,
        "host": r.host,
        "measured_at": _iso(r.measured_at),
        "version": r.version,
        "torch": r.torch_version,
    }


class _Fields:
    """Typed access to a JSON object that names the full path of a bad field."""

    def __init__(self, obj: Any, path: str) -> None:
        if not isinstance(obj, dict):
            raise RecordError(path, f"must be an object, got {type(obj).__name__}")
        self.obj = obj
        self.path = path
        self.seen: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, required: bool = True) -> Any:
        self.seen.add(key)
        if key not in self.obj:
            if required:
                raise RecordError(self._name(key), "missing")
            return None
        return self.obj[key]

    def str_(self, key: str, required: bool = True, allow_empty: bool = True) -> str:
        v = self.get(key, required)
        if v is None and not required:
            return ""
        if not isinstance(v, str):
            raise RecordError(self._name(key), f"must be a string, got {v!r}")
        if not allow_empty and not v:
            raise RecordError(self._name(key), "must not be empty")
        return v

    def int_(self, key: str, required: bool = True, minimum: int = 1) -> int:
        v = self.get(key, required)
        if v is None and not required:
            return 0
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise RecordError(self._name(key), f"must be an integer >= {minimum}, got {v!r}")
        return v

    def bool_(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise RecordError(self._name(key), f"must be true or false, got {v!r}")
        return v

    def float_(self, key: str, required: bool = True) -> float | None:
        v = self.get(key, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise RecordError(self._name(key), f"must be a finite number >= 0 or null, got {v!r}")
        return float(v)

    def done(self) -> None:
        extra = sorted(set(self.obj) - self.seen)
        if extra:
            raise RecordError(self._name(extra[0]), "unknown field")


def record_from_json(obj: Any, *, source: str = "") -> Record:
    """Validate and convert one JSON object; raises RecordError naming the field."""
    top = _Fields(obj, "")
    fmt = top.get("format")
    if fmt != FORMAT_VERSION:
        raise RecordError("format", f"unsupported record format {fmt!r} (this version reads {FORMAT_VERSION})")
    uid = top.str_("uid", allow_empty=False)
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", uid):
        raise RecordError("uid", f"must be 1-64 letters, digits, '-' or '_', got {uid!r}")

    pf = _Fields(top.get("problem"), "problem")
    op = pf.str_("op")
    if op not in OPS:
        raise RecordError("problem.op", f"must be one of {OPS}, got {op!r}")
    dtype = pf.str_("dtype")
    if dtype not in DTYPES:
        raise RecordError("problem.dtype", f"must be one of {DTYPES}, got {dtype!r}")
    ints = {k: pf.int_(k) for k in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim")}
    causal = pf.bool_("causal")
    acc = pf.bool_("allow_fp16_accum")
    feats: dict[str, Any] = {}
    for name, off in _FEATURE_FIELDS.items():
        if name in pf.obj:
            if isinstance(off, bool):
                feats[name] = pf.bool_(name)
            else:
                feats[name] = pf.int_(name, minimum=off)
    pf.done()
    try:
        problem = Problem(op=op, dtype=dtype, causal=causal, allow_fp16_accum=acc, **ints, **feats)
    except ValueError as e:
        raise RecordError("problem", str(e)) from None

    df = _Fields(top.get("device"), "device")
    name = df.str_("name", allow_empty=False)
    cap = df.get("capability")
    if (
        not isinstance(cap, list)
        or len(cap) != 2
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cap)
    ):
        raise RecordError("device.capability", f"must be [major, minor], got {cap!r}")
    sms = df.int_("sm_count")
    driver = df.str_("driver")
    cuda = df.str_("cuda")
    df.done()
    device = DeviceInfo(name=name, capability=(cap[0], cap[1]), sm_count=sms, driver=driver, cuda=cuda)

    build_id = top.str_("build_id", allow_empty=False)
    backend = top.str_("backend", allow_empty=False)
    config = top.str_("config", allow_empty=False)
    status = top.str_("status")
    if status not in STATUSES:
        raise RecordError("status", f"must be one of {STATUSES}, got {status!r}")

    tf = _Fields(top.get("time_ms"), "time_ms")
    median = tf.float_("median")
    tmin = tf.float_("min")
    tmax = tf.float_("max")
    q1 = tf.float_("q1", required=False)
    q3 = tf.float_("q3", required=False)
    floor = tf.float_("floor", required=False)
    tf.done()
    if status == "ok" and (median is None or median <= 0):
        raise RecordError("time_ms.median", "an ok record needs a median time > 0")
    runs = top.int_("runs", minimum=0)
    tflops = top.float_("tflops")
    error = top.float_("error")
    error_limit = top.float_("error_limit", required=False)
    if status == "ok" and error is not None and error_limit is not None and error > error_limit:
        raise RecordError("error", f"an ok record must be within its error_limit ({error!r} > {error_limit!r})")
    message = top.str_("message")
    host = top.str_("host")
    when_text = top.str_("measured_at", allow_empty=False)
    try:
        when = datetime.fromisoformat(when_text.replace("Z", "+00:00"))  # "Z" needs 3.11
    except ValueError:
        raise RecordError("measured_at", f"must be an ISO 8601 time, got {when_text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    version = top.str_("version")
    torch_version = top.str_("torch", required=False)
    top.done()
    return Record(
        problem=problem,
        device=device,
        build_id=build_id,
        backend=backend,
        config=config,
        status=status,
        median_ms=median,
        min_ms=tmin,
        max_ms=tmax,
        q1_ms=q1,
        q3_ms=q3,
        floor_ms=floor,
        runs=runs,
        tflops=tflops,
        error=error,
        error_limit=error_limit,
        message=message,
        host=host,
        measured_at=when,
        version=version,
        torch_version=torch_version,
        uid=uid,
        source=source,
    )


def validate_record(r: Record) -> Record:
    """``r`` checked exactly as a line of ``db import`` is (raises RecordError naming the
    field): for records that arrive from another database rather than from a file."""
    return record_from_json(record_to_json(r), source=r.source)
