"""What ``sparktune bench`` compares, and how each candidate runs one op on prepared inputs.

Candidates (keys as ``--candidates`` takes them):

- ``dispatch``: ``sparktune.attention()`` itself, whatever it selects (forward, and through
  autograd the backward it selects).
- ``own``: sparktune's own best kernel, the faster of the ``spark`` and ``triton`` backends,
  each with its best verified record in the tuning store for this device and build (the
  store's layers as dispatch reads them: the database, then the shipped files), else its
  default config.
- ``flash``, ``efficient``, ``cudnn``, ``math``: PyTorch's SDPA forced to one backend.
- ``plain``: matmul, softmax, matmul in PyTorch in the input precision (the softmax in
  float32, rounded back).

A candidate plans a case into one or more options (``own`` has one per available backend; the
faster one counts) or into the reasons it cannot run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..backends.base import Backend
from ..backends.reference import causal_visible

if TYPE_CHECKING:
    from ..db import Record
    from ..problem import DeviceInfo, Problem
    from ._check import Inputs

__all__ = [
    "CANDIDATES",
    "CPU_CANDIDATES",
    "OWN_BACKENDS",
    "QUADRATIC",
    "TITLES",
    "Context",
    "Option",
    "Plan",
    "TunedRecords",
    "pick_tuned",
    "plan_case",
    "score_bytes",
]

#: every candidate, in the order of tables and charts
CANDIDATES: tuple[str, ...] = ("dispatch", "own", "flash", "efficient", "cudnn", "math", "plain")
#: the candidates that can run on CPU tensors
CPU_CANDIDATES: tuple[str, ...] = ("dispatch", "math", "plain")
#: names shown in legends
TITLES: dict[str, str] = {
    "dispatch": "sparktune.attention",
    "own": "sparktune best kernel",
    "flash": "PyTorch flash",
    "efficient": "PyTorch mem-efficient",
    "cudnn": "PyTorch cuDNN",
    "math": "PyTorch math",
    "plain": "plain PyTorch",
}
#: our own backends, compared by ``own``
OWN_BACKENDS: tuple[str, ...] = ("spark", "triton")
#: candidates that materialise the N^2 score matrix
QUADRATIC: tuple[str, ...] = ("math", "plain")

_SDPA_MEMBERS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}

#: fn() runs the op once and returns its outputs by name (out, dq, dk, dv)
RunFn = Callable[[], dict[str, torch.Tensor]]


@dataclass
class Option:
    """One runnable choice of a candidate for a case."""

    #: what runs, e.g. "torch:flash", "triton:tfwd_m128n64_w8s3" or "plain"
    kernel: str
    #: prepare the op on the inputs (allocations, a backward's forward) and return fn
    make: Callable[[Inputs], RunFn]
    #: entered around the preparation, the check and the timing
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    #: where the choice came from ("tuned", "default", ...), for the label
    source: str = ""
    #: the backend behind a choice of ``own`` ("spark" or "triton")
    backend: str = ""
    #: (backend, problem, config) of the kernels it runs, for compiling ahead
    compile: list[tuple[str, Problem, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kernel} ({self.source})" if self.source else self.kernel


@dataclass
class Plan:
    options: list[Option] = field(default_factory=list)
    #: why the candidate (or one of its options) cannot run
    reasons: list[str] = field(default_factory=list)
    #: the candidate was left out by a size limit, not because it cannot run
    skipped: bool = False
    #: (name, reason) of the options that cannot run while others can (``own``'s backends)
    unavailable: list[tuple[str, str]] = field(default_factory=list)


def score_bytes(shape: Problem) -> int:
    """Bytes of one N^2 score matrix of the shape in its input precision."""
    itemsize = 2  # float16 and bfloat16
    return shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k * itemsize


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    if n == float("inf"):
        return "unlimited"
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------- the tuning store


class TunedRecords:
    """The verified records of this device and kernel build, per problem, fastest first: the
    tuning database (``db``: a URL or path; None: ``$SPARKTUNE_DB`` or the default file), then
    the shipped files. A database that is missing gives no records; one that cannot be read
    gives none and a note."""

    def __init__(self, device: DeviceInfo | None, db: Any = None) -> None:
        self.device = device
        self.ranked: dict[Problem, list[Record]] = {}
        self.note = ""
        self.where = ""
        if device is None:
            return
        from ..dispatch import build_id, load_records

        # the database opened as dispatch opens it (an older schema is brought up to date)
        loaded = load_records(device, build_id(), db=db, timeout=5.0)
        self.where = loaded.database
        if loaded.missing:
            self.where += " (no database)"
        elif loaded.error:
            self.note = (
                f"cannot read the tuning database {loaded.database}: {loaded.error}; own "
                "uses the shipped records and default configs"
            )
        elif loaded.invalid_rows:
            self.note = f"{len(loaded.invalid_rows)} invalid row(s) in the tuning database {self.where} were ignored"
        if loaded.shipped_error:
            self.note = (self.note + "; " if self.note else "") + f"cannot read the shipped tuning files: {loaded.shipped_error}"
        self.ranked = loaded.ranked()

    def get(self, problem: Problem) -> list[Record]:
        return self.ranked.get(problem, [])


def pick_tuned(
    records: Iterable[Record], backend: str, runnable: Callable[[str], bool]
) -> Record | None:
    """The first (fastest) record of ``backend`` whose config can run here."""
    for r in records:
        if r.backend == backend and runnable(r.config):
            return r
    return None


# --------------------------------------------------------------------------- context


@dataclass
class Context:
    """What planning needs to know: the device (None: CPU), the torch device, the size limit
    of the quadratic candidates and the tuning records."""

    device: DeviceInfo | None
    torch_device: str
    max_quadratic_bytes: float
    tuned: TunedRecords

    def registered(self) -> dict[str, Backend]:
        from ..registry import backends

        return backends()


def _backend_reasons(b: Backend, problem: Problem, config: str | None, device: DeviceInfo | None) -> list[str]:
    try:
        reasons = list(b.unavailable_reasons() or b.not_supported_reasons(problem, config, device))
    except Exception as exc:  # noqa: BLE001 - a backend that cannot answer cannot run
        reasons = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"]
    if not reasons and problem.op == "bwd" and type(b).backward is Backend.backward:
        reasons = ["no backward"]
    return reasons


def _problems(shape: Problem, op: str) -> list[Problem]:
    """The Problems (op fwd and/or bwd) that running ``op`` on ``shape`` involves."""
    if op == "fwd+bwd":
        return [shape, shape.replace(op="bwd")]
    return [shape.replace(op=op)]


# --------------------------------------------------------------------------- the ops


def _autograd_op(op: str, f: Callable[..., torch.Tensor]) -> Callable[[Inputs], RunFn]:
    """An op of a differentiable forward ``f(q, k, v) -> out``: the forward alone, the
    backward of one recorded forward (autograd.grad with the graph kept), or both."""

    def make(t: Inputs) -> RunFn:
        q, k, v, dout = t.q, t.k, t.v, t.dout
        if op == "fwd":
            return lambda: {"out": f(q, k, v)}
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        if op == "bwd":
            out = f(*leaves)

            def bwd() -> dict[str, torch.Tensor]:
                dq, dk, dv = torch.autograd.grad(out, leaves, dout, retain_graph=True)
                return {"dq": dq, "dk": dk, "dv": dv}

            return bwd

        def fwd_bwd() -> dict[str, torch.Tensor]:
            out = f(*leaves)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
            return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}

        return fwd_bwd

    return make


def _backend_op(op: str, b: Backend, fwd_config: str | None, bwd_config: str | None) -> Callable[[Inputs], RunFn]:
    """An op of a backend's own forward and backward kernels on preallocated outputs; the
    backward alone runs on the output and log-sum-exp of one forward of ``fwd_config``."""

    def make(t: Inputs) -> RunFn:
        q, k, v, dout = t.q, t.k, t.v, t.dout
        kw = {"causal": t.causal, "scale": t.scale}
        out = torch.empty_like(q)
        if op == "fwd":

            def fwd() -> dict[str, torch.Tensor]:
                b.forward(q, k, v, out, config=fwd_config, need_lse=False, **kw)
                return {"out": out}

            return fwd
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if op == "bwd":
            lse = b.forward(q, k, v, out, config=fwd_config, need_lse=True, **kw)

            def bwd() -> dict[str, torch.Tensor]:
                b.backward(dout, q, k, v, out, lse, dq, dk, dv, config=bwd_config, **kw)
                return {"dq": dq, "dk": dk, "dv": dv}

            return bwd

        def fwd_bwd() -> dict[str, torch.Tensor]:
            lse = b.forward(q, k, v, out, config=fwd_config, need_lse=True, **kw)
            b.backward(dout, q, k, v, out, lse, dq, dk, dv, config=bwd_config, **kw)
            return {"out": out, "dq": dq, "dk": dk, "dv": dv}

        return fwd_bwd

    return make


def _bottom_right_mask(nq: int, nk: int, device: torch.device) -> torch.Tensor:
    """True where query i sees key j (j <= i + nk - nq): sparktune's causal alignment."""
    return causal_visible(nq, nk, device)


def _sdpa_forward(shape: Problem, mask_device: str) -> Callable[[], Callable[..., torch.Tensor]]:
    """A factory of PyTorch's public SDPA call for the shape (the causal mask, when one is
    needed, is made once per preparation)."""
    import torch.nn.functional as F

    def factory() -> Callable[..., torch.Tensor]:
        kw: dict[str, Any] = {"scale": 1.0 / shape.head_dim**0.5}
        if shape.causal and shape.seqlen_q == shape.seqlen_k:
            kw["is_causal"] = True
        elif shape.causal:
            kw["attn_mask"] = _bottom_right_mask(shape.seqlen_q, shape.seqlen_k, torch.device(mask_device))
        if shape.group_size > 1:
            kw["enable_gqa"] = True
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)

    return factory


def _plain_forward(shape: Problem, mask_device: str) -> Callable[[], Callable[..., torch.Tensor]]:
    """Scores by one batched GEMM with the scale folded in, the causal mask filled in place,
    softmax in float32 rounded back to the input precision (as eager attention in Hugging Face
    transformers does), and a second GEMM (grouped k and v are repeated first)."""

    def factory() -> Callable[..., torch.Tensor]:
        scale = 1.0 / shape.head_dim**0.5
        group = shape.group_size
        mask = (
            ~_bottom_right_mask(shape.seqlen_q, shape.seqlen_k, torch.device(mask_device))
            if shape.causal
            else None
        )

        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            b, h, nq, d = q.shape
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            nk = k.shape[2]
            q3, k3, v3 = q.reshape(b * h, nq, d), k.reshape(b * h, nk, d), v.reshape(b * h, nk, d)
            s = torch.baddbmm(q3.new_empty(b * h, nq, nk), q3, k3.transpose(1, 2), beta=0.0, alpha=scale)
            if mask is not None:
                s = s.masked_fill_(mask, float("-inf"))
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(p, v3).view(b, h, nq, d)

        return f

    return factory


def _with_factory(op: str, factory: Callable[[], Callable[..., torch.Tensor]]) -> Callable[[Inputs], RunFn]:
    def make(t: Inputs) -> RunFn:
        return _autograd_op(op, factory())(t)

    return make


# --------------------------------------------------------------------------- planning


def _plan_dispatch(shape: Problem, op: str, ctx: Context) -> Plan:
    import sparktune

    from ..dispatch import explain

    labels = []
    kernels = []
    for p in _problems(shape, op):
        e = explain(p, ctx.device)
        if e.selection is None:
            return Plan(reasons=[e.error.splitlines()[0] if e.error else "no kernel"])
        c = e.selection.candidate
        labels.append(f"{c.label} ({e.selection.source})")
        kernels.append((c.backend, p, c.config))
    scale = 1.0 / shape.head_dim**0.5

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sparktune.attention(
            q, k, v, causal=shape.causal, scale=scale, allow_fp16_accum=shape.allow_fp16_accum
        )

    return Plan([Option(" + ".join(labels), _autograd_op(op, f), compile=kernels)])


def _own_config(b: Backend, name: str, p: Problem, ctx: Context) -> tuple[str | None, str, str]:
    """(config, source, reason): the backend's best tuned record for ``p`` that can run
    here, else its default config; reason when it has none."""
    reasons = _backend_reasons(b, p, None, ctx.device)
    if reasons:
        return None, "", "; ".join(reasons)
    record = pick_tuned(ctx.tuned.get(p), name, lambda c: not _backend_reasons(b, p, c, ctx.device))
    if record is not None:
        return record.config, "tuned", ""
    try:
        config = b.default_config(p, ctx.device)
    except Exception as exc:  # noqa: BLE001
        return None, "", f"default_config raised {type(exc).__name__}: {exc}"
    if config is None:
        return None, "", f"no configuration supports the {p.op} problem"
    return config, "default", ""


def _own_option(name: str, b: Backend, shape: Problem, op: str, ctx: Context) -> tuple[Option | None, str]:
    configs: dict[str, str] = {}
    sources: list[str] = []
    for p in _problems(shape, op):
        config, source, reason = _own_config(b, name, p, ctx)
        if config is None:
            return None, reason
        configs[p.op] = config
        sources.append(f"{p.op} {source}" if op == "fwd+bwd" else source)
    fwd_config = configs.get("fwd")
    if fwd_config is None:  # the backward alone runs on a forward of the same backend
        fwd_config, _, reason = _own_config(b, name, shape, ctx)
        if fwd_config is None:
            return None, f"its forward cannot run the shape, and the backward needs one ({reason})"
    if len(set(s.split()[-1] for s in sources)) == 1:
        sources = [sources[0].split()[-1]]
    kernels = [(name, shape.replace(op=o), c) for o, c in configs.items()]
    if "fwd" not in configs:
        kernels.append((name, shape, fwd_config))
    return (
        Option(
            " + ".join(f"{name}:{configs[o]}" for o in ("fwd", "bwd") if o in configs),
            _backend_op(op, b, fwd_config, configs.get("bwd")),
            source=", ".join(sources),
            backend=name,
            compile=kernels,
        ),
        "",
    )


def _plan_own(shape: Problem, op: str, ctx: Context) -> Plan:
    registered = ctx.registered()
    plan = Plan()
    for name in OWN_BACKENDS:
        b = registered.get(name)
        option, reason = (None, "not registered") if b is None else _own_option(name, b, shape, op, ctx)
        if option is not None:
            plan.options.append(option)
        else:
            plan.unavailable.append((name, reason))
    if not plan.options:
        plan.reasons = [f"{n}: {r}" for n, r in plan.unavailable]
    return plan


def _plan_sdpa(config: str, shape: Problem, op: str, ctx: Context) -> Plan:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = ctx.registered().get("torch")
    if b is None:
        return Plan(reasons=["the torch backend is not registered"])
    reasons: list[str] = []
    for p in _problems(shape, op):
        for r in _backend_reasons(b, p, config, ctx.device):
            if r not in reasons:
                reasons.append(r)
    member = getattr(SDPBackend, _SDPA_MEMBERS[config], None)
    if member is None and not reasons:
        reasons.append(f"this torch ({torch.__version__}) has no SDPBackend.{_SDPA_MEMBERS[config]}")
    if reasons:
        return Plan(reasons=reasons)
    return Plan([
        Option(
            f"torch:{config}",
            _with_factory(op, _sdpa_forward(shape, ctx.torch_device)),
            scope=lambda: sdpa_kernel(member),
        )
    ])


def _quadratic_skip(shape: Problem, ctx: Context) -> Plan | None:
    need = score_bytes(shape)
    if need > ctx.max_quadratic_bytes:
        return Plan(
            reasons=[
                f"the N^2 score matrix needs {size_text(need)}, above --max-quadratic-bytes "
                f"{size_text(ctx.max_quadratic_bytes)}"
            ],
            skipped=True,
        )
    return None


def plan_case(candidate: str, shape: Problem, op: str, ctx: Context) -> Plan:
    """How ``candidate`` runs ``op`` on ``shape`` (a forward Problem) here, or why not."""
    if shape.dtype == "bfloat16" and ctx.device is not None and ctx.device.arch < 80:
        return Plan(reasons=[f"bfloat16 needs sm_80 or later (this GPU is sm_{ctx.device.arch})"])
    if candidate in QUADRATIC:
        skip = _quadratic_skip(shape, ctx)
        if skip is not None:
            return skip
    if candidate == "dispatch":
        return _plan_dispatch(shape, op, ctx)
    if candidate == "own":
        return _plan_own(shape, op, ctx)
    if candidate in _SDPA_MEMBERS:
        return _plan_sdpa(candidate, shape, op, ctx)
    if candidate == "plain":
        return Plan([Option("plain", _with_factory(op, _plain_forward(shape, ctx.torch_device)))])
    raise ValueError(f"unknown candidate {candidate!r}; candidates: {', '.join(CANDIDATES)}")
