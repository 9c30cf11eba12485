"""Inputs of one problem, the launch of a candidate on them, and the reference check.

The check is FlashAttention-2's rule: a candidate's max abs error against attention in float64
on the same inputs must be at most :data:`ERROR_FACTOR` times PyTorch's own error in the input
precision (the plain matmul-softmax-matmul, every intermediate rounded to the dtype), plus
:data:`ERROR_FLOOR`. Forward checks the output and the log-sum-exp; backward checks dq, dk
and dv. Outputs are filled with NaN before the launch, so a kernel that leaves part of them
unwritten fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._autograd import recorded_for_backward
from ..attention import attention, varlen_attention
from ..backends.reference import (
    causal_visible,
    reference_attention,
    reference_attention_backward,
)
from ..dtypes import TORCH_DTYPES

if TYPE_CHECKING:
    from ..backends.base import Backend, Candidate
    from ..problem import Problem

__all__ = [
    "TUNE_DROPOUT_P",
    "TUNE_SOFTCAP",
    "alibi_slopes",
    "feature_arguments",
    "varlen_lengths",
    "ERROR_FACTOR",
    "ERROR_FLOOR",
    "FP16_ACCUM_FACTOR",
    "CheckResult",
    "Workload",
    "lowp_attention",
]

#: a candidate may be this many times less accurate than PyTorch in the same precision
ERROR_FACTOR = 2.0
#: absolute slack for outputs PyTorch happens to compute (almost) exactly
ERROR_FLOOR = 1e-5
#: extra allowance where the caller allowed FP16 accumulation (allow_fp16_accum=True)
FP16_ACCUM_FACTOR = 4.0
#: elements of one score block of the low-precision baseline
_TILE_ELEMENTS = 1 << 24

#: the values a problem's on/off features are tuned and checked with (the key records only
#: that they are on; what they cost does not depend on the value)
TUNE_SOFTCAP = 2.0
TUNE_DROPOUT_P = 0.1
_TUNE_SEED, _TUNE_OFFSET = 1234, 0


def alibi_slopes(heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The geometric ALiBi slopes of ``heads`` heads (2**(-8 h / heads), h = 1..heads), float32."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)


def varlen_lengths(batch: int, longest: int, total: int) -> list[int]:
    """Sequence lengths for a varlen problem: ``batch`` lengths summing to ``total``, the first
    ``longest`` and none longer (the rest as equal as they can be)."""
    lengths = [longest]
    rest, left = total - longest, batch - 1
    for i in range(left):
        n = min(longest, -(-rest // (left - i)))
        lengths.append(n)
        rest -= n
    return lengths


def feature_arguments(problem: Problem, device: torch.device | str) -> dict[str, object]:
    """The backend's feature keyword arguments for a problem with features (docs/FEATURES.md),
    with the values the tuner uses (:data:`TUNE_SOFTCAP`, :func:`alibi_slopes`,
    :data:`TUNE_DROPOUT_P`, a fixed seed); packed problems get the boundaries of
    :func:`varlen_lengths`. Empty for a plain problem."""
    p = problem
    kw: dict[str, object] = {}
    if "window" in p.features:
        kw["window"] = p.window
    if p.softcap:
        kw["softcap"] = TUNE_SOFTCAP
    if p.alibi:
        kw["alibi_slopes"] = alibi_slopes(p.heads_q, device)
    if p.dropout:
        kw.update(dropout_p=TUNE_DROPOUT_P, seed=_TUNE_SEED, offset=_TUNE_OFFSET)
    if p.deterministic:
        kw["deterministic"] = True
    if p.varlen:
        for side, longest, total in (("q", p.seqlen_q, p.total_q), ("k", p.seqlen_k, p.total_k)):
            lengths = varlen_lengths(p.batch, longest, total)
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            kw[f"cu_seqlens_{side}"] = torch.tensor(cu, dtype=torch.int32, device=device)
            kw[f"max_seqlen_{side}"] = longest
    return kw



def _tiles(pairs: int, group: int, nq: int, nk: int) -> list[tuple[slice, slice]]:
    per_pair = group * nq * nk
    if per_pair <= _TILE_ELEMENTS:
        step = max(1, _TILE_ELEMENTS // per_pair)
        return [(slice(p, p + step), slice(0, nq)) for p in range(0, pairs, step)]
    rows = max(1, _TILE_ELEMENTS // (group * nk))
    return [(slice(p, p + 1), slice(r, r + rows)) for p in range(pairs) for r in range(0, nq, rows)]


def lowp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dout: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """PyTorch attention in the inputs' precision (scores, probabilities and output rounded to
    the dtype; softmax computed in float32), tile by tile. Returns (out, lse) with the
    float32 log-sum-exp of the rounded scores or, with ``dout``, (dq, dk, dv)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    qp = q.unflatten(1, (hkv, g)).flatten(0, 1)  # (pairs, g, nq, d)
    kp, vp = k.flatten(0, 1), v.flatten(0, 1)  # (pairs, nk, d)
    dop = dout.unflatten(1, (hkv, g)).flatten(0, 1) if dout is not None else None
    out = torch.empty_like(qp)
    lse = torch.empty(qp.shape[:-1], dtype=torch.float32, device=q.device)
    if dop is not None:
        dq = torch.empty_like(qp)
        dk = torch.zeros(kp.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(vp.shape, dtype=torch.float32, device=k.device)
    for ps, rs in _tiles(qp.shape[0], g, nq, nk):
        leaves = [qp[ps, :, rs], kp[ps], vp[ps]]
        if dop is not None:
            leaves = [t.detach().requires_grad_() for t in leaves]
        with torch.set_grad_enabled(dop is not None):
            qt, kt, vt = leaves
            s = torch.matmul(qt, kt.unsqueeze(1).transpose(-1, -2)) * scale
            sf = s.float()
            if causal:
                visible = causal_visible(nq, nk, q.device, rs.start, qt.shape[2])
                sf = sf.masked_fill(~visible, -math.inf)
            m = sf.detach().amax(-1, keepdim=True)
            m = torch.where(m == -math.inf, 0.0, m)
            e = torch.exp(sf - m)
            den = e.sum(-1, keepdim=True)
            p = (e / torch.where(den == 0, 1.0, den)).to(q.dtype)
            o = torch.matmul(p, vt.unsqueeze(1))
            if dop is None:
                out[ps, :, rs] = o
                lse[ps, :, rs] = (torch.log(den) + m).squeeze(-1)
                continue
            gq, gk, gv = torch.autograd.grad(o, leaves, dop[ps, :, rs])
        dq[ps, :, rs] = gq
        dk[ps] += gk.float()
        dv[ps] += gv.float()
    if dop is None:
        return out.unflatten(0, (b, hkv)).flatten(1, 2), lse.unflatten(0, (b, hkv)).flatten(1, 2)
    return (
        dq.unflatten(0, (b, hkv)).flatten(1, 2),
        dk.to(k.dtype).unflatten(0, (b, hkv)),
        dv.to(v.dtype).unflatten(0, (b, hkv)),
    )


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    #: max abs error of the worst output (relative to its bound)
    error: float
    #: the bound of that output
    limit: float
    #: which output
    what: str
    message: str = ""


def _max_abs_err(a: torch.Tensor, ref: torch.Tensor, finite_mask: torch.Tensor | None = None) -> float:
    diff = a.double() - ref
    if finite_mask is not None:
        diff = diff[finite_mask]
    if diff.numel() == 0:
        return 0.0
    err = diff.abs().max().item()
    return math.inf if math.isnan(err) else err


def reference_bounds(
    t: dict[str, torch.Tensor], *, op: str, causal: bool, scale: float, factor: float, lse: bool = True,
    features: dict[str, object] | None = None,
) -> dict[str, tuple[torch.Tensor, float, torch.Tensor | None]]:
    """output name -> (float64 reference, bound, mask of entries to compare or None) for the
    inputs ``t`` (q, k, v, and dout for "bwd"): "fwd" gives out (and lse, compared where it is
    finite, when ``lse``), "bwd" gives dq, dk and dv. Each bound is ``factor`` times PyTorch's
    own error in the input precision plus ERROR_FLOOR. With ``features`` (the backend's
    feature arguments) the float64 reference has them too, and PyTorch's own error is that of
    the same reference math run in the input dtype."""
    refs: dict[str, tuple[torch.Tensor, float, torch.Tensor | None]] = {}
    if features:
        return _feature_bounds(t, op=op, causal=causal, scale=scale, factor=factor, lse=lse, features=features)
    with torch.no_grad():
        if op == "fwd":
            out64, lse64 = reference_attention(t["q"], t["k"], t["v"], causal, scale, torch.float64)
            low, lse_low = lowp_attention(t["q"], t["k"], t["v"], causal=causal, scale=scale)
            refs["out"] = (out64, factor * _max_abs_err(low, out64) + ERROR_FLOOR, None)
            if lse:
                finite = torch.isfinite(lse64)
                refs["lse"] = (lse64, factor * _max_abs_err(lse_low, lse64, finite) + ERROR_FLOOR, finite)
        else:
            grads64 = reference_attention_backward(t["dout"], t["q"], t["k"], t["v"], causal, scale, torch.float64)
            lows = lowp_attention(t["q"], t["k"], t["v"], causal=causal, scale=scale, dout=t["dout"])
            for name, ref, low in zip(("dq", "dk", "dv"), grads64, lows, strict=True):
                refs[name] = (ref, factor * _max_abs_err(low, ref) + ERROR_FLOOR, None)
    return refs


def _feature_bounds(
    t: dict[str, torch.Tensor], *, op: str, causal: bool, scale: float, factor: float, lse: bool,
    features: dict[str, object],
) -> dict[str, tuple[torch.Tensor, float, torch.Tensor | None]]:
    kw = {k: v for k, v in features.items() if k != "deterministic"}
    refs: dict[str, tuple[torch.Tensor, float, torch.Tensor | None]] = {}
    low_dtype = t["q"].dtype
    with torch.no_grad():
        if op == "fwd":
            out64, lse64 = reference_attention(t["q"], t["k"], t["v"], causal, scale, torch.float64, **kw)
            low, lse_low = reference_attention(t["q"], t["k"], t["v"], causal, scale, low_dtype, **kw)
            refs["out"] = (out64, factor * _max_abs_err(low, out64) + ERROR_FLOOR, None)
            if lse:
                finite = torch.isfinite(lse64)
                refs["lse"] = (lse64, factor * _max_abs_err(lse_low, lse64, finite) + ERROR_FLOOR, finite)
        else:
            grads64 = reference_attention_backward(t["dout"], t["q"], t["k"], t["v"], causal, scale, torch.float64, **kw)
            lows = reference_attention_backward(t["dout"], t["q"], t["k"], t["v"], causal, scale, low_dtype, **kw)
            for name, ref, low in zip(("dq", "dk", "dv"), grads64, lows, strict=True):
                refs[name] = (ref, factor * _max_abs_err(low, ref) + ERROR_FLOOR, None)
    return refs


def check_outputs(
    refs: dict[str, tuple[torch.Tensor, float, torch.Tensor | None]],
    outputs: dict[str, torch.Tensor],
    *,
    factor: float,
    dtype: str,
) -> CheckResult:
    """Compare ``outputs`` with :func:`reference_bounds`' ``refs``: the worst output relative to
    its bound decides."""
    worst: CheckResult | None = None
    for name, (ref, bound, mask) in refs.items():
        got = outputs.get(name)
        if got is None:
            return CheckResult(False, math.inf, bound, name, f"no {name} produced")
        if tuple(got.shape) != tuple(ref.shape):
            return CheckResult(False, math.inf, bound, name, f"{name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        if mask is not None and not torch.equal(torch.isfinite(got), mask):
            return CheckResult(False, math.inf, bound, name, f"{name}: rows with no visible key must be -inf, others finite")
        err = _max_abs_err(got, ref, mask)
        r = CheckResult(err <= bound, err, bound, name)
        if worst is None or (err / bound if bound else math.inf) > (worst.error / worst.limit if worst.limit else math.inf):
            worst = r
    assert worst is not None
    if not worst.ok:
        return CheckResult(
            False, worst.error, worst.limit, worst.what,
            f"{worst.what}: max abs error {worst.error:.3g} exceeds the bound {worst.limit:.3g} "
            f"({factor:g}x PyTorch's own {dtype} error + {ERROR_FLOOR:g})",
        )
    return worst


class Workload:
    """Random inputs of one problem on one torch device, candidate launches on them, and
    (lazily) the reference check."""

    def __init__(self, problem: Problem, device: torch.device | str, *, seed: int = 0) -> None:
        self.problem = problem
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[problem.dtype]
        self.scale = 1.0 / math.sqrt(problem.head_dim)
        self.seed = seed
        self._check_inputs: dict[str, torch.Tensor] | None = None
        self._refs: dict[str, tuple[torch.Tensor, float, torch.Tensor | None]] | None = None
        #: the backend's feature arguments (empty for a plain problem)
        self.features = feature_arguments(problem, self.device)

    # ------------------------------------------------------------------ inputs

    def inputs(self, seed: int) -> dict[str, torch.Tensor]:
        """Fresh q, k, v (and dout, out, lse for backward), (B, H, N, D) contiguous."""
        p = self.problem
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)

        if p.varlen:  # packed (total, H, D)
            t = {
                "q": randn(p.total_q, p.heads_q, p.head_dim),
                "k": randn(p.total_k, p.heads_kv, p.head_dim),
                "v": randn(p.total_k, p.heads_kv, p.head_dim),
            }
        else:
            t = {
                "q": randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim),
                "k": randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim),
                "v": randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim),
            }
        if p.op == "bwd":
            t["dout"] = randn(*t["q"].shape)
            fkw = {k: v for k, v in self.features.items() if k != "deterministic"}
            out, lse = reference_attention(t["q"], t["k"], t["v"], p.causal, self.scale, torch.float32, **fkw)
            t["out"] = out.to(self.dtype)
            t["lse"] = lse.float()
        return t

    # ------------------------------------------------------------------ launches

    def launch(self, backend: Backend, cand: Candidate, t: dict[str, torch.Tensor], *, fill: float | None = None) -> tuple[Callable[[], object], dict[str, torch.Tensor]]:
        """(fn, outputs): ``fn()`` runs the candidate once on ``t`` writing into ``outputs``
        (pre-filled with ``fill`` when given); forward also stores the returned lse.

        For timing on CUDA, a candidate runs as ``sparktune.attention()`` runs it, so that
        its host cost counts as it will there: a forward as an inference call (a hit, forced
        to the candidate: the backend's ``forward_runner``, no log-sum-exp); a backward as a
        training call (the backward of the backend's own recorded forward for backends that
        record one, PyTorch's SDPA; else autograd's engine through sparktune's autograd
        function to the backend's backward). The check, and other devices, call the
        backend's ``forward`` (with the log-sum-exp, which is checked too) or ``backward``
        directly."""
        p = self.problem

        def alloc(like: torch.Tensor) -> torch.Tensor:
            return torch.full_like(like, fill) if fill is not None else torch.empty_like(like)

        if self.features:
            return self._launch_features(backend, cand, t, alloc, fill)
        if p.op == "fwd":
            outs = {"out": alloc(t["q"])}
            if fill is None and self.device.type == "cuda":
                # what an inference call runs: sparktune.attention() on a hit, through the
                # backend's forward_runner where it has one (no log-sum-exp, no copy)
                q, k, v = t["q"], t["k"], t["v"]
                kw = {
                    "causal": p.causal, "scale": self.scale, "backend": backend.name,
                    "config": cand.config, "allow_fp16_accum": p.allow_fp16_accum,
                }  # fmt: skip

                def fwd_call() -> object:
                    return attention(q, k, v, **kw)

                return fwd_call, outs

            def fwd() -> object:
                lse = backend.forward(
                    t["q"], t["k"], t["v"], outs["out"], config=cand.config, causal=p.causal, scale=self.scale, need_lse=True
                )
                if lse is None:
                    raise RuntimeError(f"{cand.label} returned no log-sum-exp with need_lse=True")
                outs["lse"] = lse
                return lse

            return fwd, outs
        outs = {"dq": alloc(t["q"]), "dk": alloc(t["k"]), "dv": alloc(t["v"])}
        native = type(backend).forward_autograd
        if native is not None:
            # what sparktune.attention() runs when the backward is on this backend: the
            # backward of its own recorded forward (one forward, outside the timing)
            leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
            with torch.enable_grad():
                out = native(backend, *leaves, config=cand.config, causal=p.causal, scale=self.scale)
            graph: tuple[torch.Tensor, list[torch.Tensor]] | None = (out, leaves)
        else:
            # what a training call runs when dispatch gives the backward to this candidate:
            # autograd's engine, sparktune's autograd function, the backend's backward. The
            # check (outputs pre-filled) calls the backward directly, so that an entry it
            # leaves unwritten shows.
            graph = self._recorded(backend, cand, t) if fill is None else None
        if graph is not None:
            out, leaves = graph

            def bwd_graph() -> object:
                dq, dk, dv = torch.autograd.grad(out, leaves, t["dout"], retain_graph=True)
                outs.update(dq=dq, dk=dk, dv=dv)
                return None

            return bwd_graph, outs

        def bwd() -> object:
            backend.backward(
                t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], outs["dq"], outs["dk"], outs["dv"],
                config=cand.config, causal=p.causal, scale=self.scale,
            )
            return None

        return bwd, outs

    def _launch_features(
        self, backend: Backend, cand: Candidate, t: dict[str, torch.Tensor], alloc: Callable[[torch.Tensor], torch.Tensor],
        fill: float | None,
    ) -> tuple[Callable[[], object], dict[str, torch.Tensor]]:
        """:meth:`launch` for a problem with features: the forward as a call with them runs it
        on CUDA when timed (``attention``/``varlen_attention`` forced to the candidate; with
        dropout each call draws its own mask, as a training step does), else the backend's
        ``forward``/``backward`` with the feature arguments."""
        p = self.problem
        fkw = self.features
        if p.op == "fwd":
            outs = {"out": alloc(t["q"])}
            if fill is None and self.device.type == "cuda":
                call = {
                    "causal": p.causal, "scale": self.scale, "backend": backend.name, "config": cand.config,
                    "allow_fp16_accum": p.allow_fp16_accum,
                    **{k: v for k, v in fkw.items() if k in ("window", "softcap", "alibi_slopes", "dropout_p")},
                }  # fmt: skip
                q, k, v = t["q"], t["k"], t["v"]
                if p.varlen:
                    args = (fkw["cu_seqlens_q"], fkw["cu_seqlens_k"], fkw["max_seqlen_q"], fkw["max_seqlen_k"])
                    return (lambda: varlen_attention(q, k, v, *args, **call)), outs
                return (lambda: attention(q, k, v, **call)), outs
            fwd_kw = {k: v for k, v in fkw.items() if k != "deterministic"}

            def fwd() -> object:
                lse = backend.forward(
                    t["q"], t["k"], t["v"], outs["out"], config=cand.config, causal=p.causal, scale=self.scale,
                    need_lse=True, **fwd_kw,
                )
                if lse is None:
                    raise RuntimeError(f"{cand.label} returned no log-sum-exp with need_lse=True")
                outs["lse"] = lse
                return lse

            return fwd, outs
        outs = {"dq": alloc(t["q"]), "dk": alloc(t["k"]), "dv": alloc(t["v"])}

        def bwd() -> object:
            backend.backward(
                t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], outs["dq"], outs["dk"], outs["dv"],
                config=cand.config, causal=p.causal, scale=self.scale, **fkw,
            )
            return None

        return bwd, outs

    def _recorded(self, backend: Backend, cand: Candidate, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(out, leaves) with the training call's backward recorded, on CUDA tensors; None
        elsewhere (the backend's backward is then called directly)."""
        if self.device.type != "cuda":
            return None
        leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
        with torch.enable_grad():
            out = recorded_for_backward(
                backend, cand.config, *leaves, t["out"], t["lse"], causal=self.problem.causal, scale=self.scale,
                allow_fp16_accum=self.problem.allow_fp16_accum,
            )
        return out, leaves

    def sdpa_baseline(self, t: dict[str, torch.Tensor]) -> Callable[[], object]:
        """PyTorch's default SDPA (its own backend choice) on the same inputs. Its causal mask
        is aligned top-left; for seqlen_q != seqlen_k that is a timing figure only."""
        import torch.nn.functional as F

        p = self.problem
        if p.varlen:  # the packed inputs as one sequence: a timing figure only
            t = {n: x.transpose(0, 1).unsqueeze(0) for n, x in t.items() if n in ("q", "k", "v", "dout")}
        kw = {"is_causal": p.causal, "scale": self.scale}
        if p.group_size > 1:
            kw["enable_gqa"] = True
        if p.op == "fwd":
            return lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], **kw)
        leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
        out = F.scaled_dot_product_attention(*leaves, **kw)
        return lambda: torch.autograd.grad(out, leaves, t["dout"], retain_graph=True)

    # ------------------------------------------------------------------ the check

    def check_inputs(self) -> dict[str, torch.Tensor]:
        if self._check_inputs is None:
            self._check_inputs = self.inputs(self.seed)
        return self._check_inputs

    def _factor(self) -> float:
        return ERROR_FACTOR * (FP16_ACCUM_FACTOR if self.problem.allow_fp16_accum else 1.0)

    def _references(self) -> dict[str, tuple[torch.Tensor, float, torch.Tensor | None]]:
        """output name -> (float64 reference, bound, mask of entries to compare or None)."""
        if self._refs is None:
            p = self.problem
            self._refs = reference_bounds(
                self.check_inputs(), op=p.op, causal=p.causal, scale=self.scale, factor=self._factor(),
                features=self.features,
            )
        return self._refs

    def check(self, outputs: dict[str, torch.Tensor]) -> CheckResult:
        """Compare a candidate's outputs (from :meth:`launch` on :meth:`check_inputs`)."""
        return check_outputs(self._references(), outputs, factor=self._factor(), dtype=self.problem.dtype)
