"""``explain``'s answer, and the problem of an ``attention()`` call's tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._checks import check_inputs
from ..dtypes import DTYPE_NAMES
from ..problem import DeviceInfo, Problem
from ._resolve import Selection, Table

if TYPE_CHECKING:
    import torch

__all__ = ["AUTO", "Explanation", "problem_and_device"]

#: ``explain``'s device when none is given: the current CUDA device, or the tensors' device
AUTO: Any = object()


@dataclass(frozen=True)
class Explanation:
    """Which kernel a call would use and why (``str()`` gives the text)."""

    problem: Problem
    device: DeviceInfo | None
    build_id: str
    selection: Selection | None
    #: the error text when no kernel can run the problem
    error: str
    #: where the records were read from
    sources: tuple[str, ...]
    #: tuned candidates of the problem, fastest first ("label: time ...")
    tuned: tuple[str, ...]
    #: tuned candidates passed over, with the reason
    rejected: tuple[str, ...]

    @classmethod
    def of(
        cls,
        problem: Problem,
        device: DeviceInfo | None,
        build_id: str,
        selection: Selection | None,
        error: str,
        table: Table | None,
        rejected: list[str],
    ) -> Explanation:
        """The explanation of a selection made from ``table`` (None: no device, no records)."""
        tuned: tuple[str, ...] = ()
        sources: tuple[str, ...] = ()
        if table is not None:
            sources = tuple(table.sources)
            tuned = tuple(
                f"{r.label}: {r.median_ms:.4g} ms" + _rate(r)
                for r in table.ranked.get(problem, ())
            )
        return cls(problem, device, build_id, selection, error, sources, tuned, tuple(rejected))

    def __str__(self) -> str:
        from ..db import problem_key

        dev = (
            f"{self.device.name} (sm_{self.device.arch}, {self.device.sm_count} SMs, driver "
            f"{self.device.driver or '?'}, CUDA {self.device.cuda or '?'})"
            if self.device is not None
            else "none (CPU tensors: no tuned records apply)"
        )
        lines = [
            f"problem:  {problem_key(self.problem)}",
            f"device:   {dev}",
            f"build:    {self.build_id}",
            f"records:  {', '.join(self.sources) or '(not read)'}",
        ]
        if self.selection is None:
            lines.append(f"choice:   none\n{self.error}")
        else:
            s = self.selection
            lines.append(f"choice:   {s.candidate.label} ({s.source})")
            lines.append(f"why:      {s.detail}")
            r = s.record
            if r is not None:
                # only what was measured: quartiles and burst floor where the record has them
                spread = (
                    f", quartiles {r.q1_ms:.4g}-{r.q3_ms:.4g}" if r.q1_ms is not None and r.q3_ms is not None else ""
                )
                floor = f", burst floor {r.floor_ms:.4g} ms" if r.floor_ms is not None else ""
                tf = _rate(r)
                lines.append(
                    f"measured: {r.median_ms:.4g} ms median{spread}{floor}, {r.runs} runs{tf}, on {r.host or '?'} "
                    f"at {r.measured_at:%Y-%m-%d %H:%M} UTC (sparktune {r.version or '?'})"
                )
        for t in self.tuned:
            lines.append(f"tuned:    {t}")
        for t in self.rejected:
            lines.append(f"skipped:  {t}")
        return "\n".join(lines)


@functools.cache
def _cuda_device_info(index: int) -> DeviceInfo:
    return DeviceInfo.from_torch(f"cuda:{index}")


def _problem_from_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    layout: str,
    allow_fp16_accum: bool,
    op: str,
    features: dict[str, Any] | None = None,
) -> tuple[Problem, DeviceInfo | None]:
    qb, kb, _ = check_inputs(q, k, k, layout)  # the call's own checks, which say what is wrong
    extra: dict[str, Any] = {}
    if features:
        from .._checks import check_features, trim_window

        f = check_features(
            features.get("window", (-1, -1)), features.get("softcap", 0.0),
            features.get("alibi_slopes"), features.get("dropout_p", 0.0), None,
            features.get("deterministic", False), causal=bool(causal), batch=qb.shape[0],
            heads_q=qb.shape[1], device=q.device,
        )  # fmt: skip
        wl, wr = trim_window(f.window, qb.shape[2], kb.shape[2])
        extra = dict(
            window_left=wl,
            window_right=wr,
            softcap=bool(f.softcap),
            alibi=f.alibi_slopes is not None,
            dropout=bool(f.dropout_p),
            deterministic=f.deterministic and op == "bwd",
        )
    problem = Problem(
        op=op,
        dtype=DTYPE_NAMES[q.dtype],
        batch=qb.shape[0],
        heads_q=qb.shape[1],
        heads_kv=kb.shape[1],
        seqlen_q=qb.shape[2],
        seqlen_k=kb.shape[2],
        head_dim=qb.shape[3],
        causal=bool(causal),
        allow_fp16_accum=bool(allow_fp16_accum),
        **extra,
    )
    dev = q.device
    device = None
    if dev.type == "cuda":
        import torch.cuda

        device = _cuda_device_info(dev.index if dev.index is not None else torch.cuda.current_device())
    return problem, device


def problem_and_device(
    problem: Problem | torch.Tensor,
    device: DeviceInfo | None | Any,
    *,
    k: torch.Tensor | None,
    causal: bool,
    layout: str,
    allow_fp16_accum: bool,
    op: str,
    features: dict[str, Any] | None = None,
) -> tuple[Problem, DeviceInfo | None]:
    """The problem ``explain`` is asked about and the device (:data:`AUTO`: the tensors' device,
    or for a :class:`~sparktune.problem.Problem` the current CUDA device if there is one)."""
    if not isinstance(problem, Problem):
        if k is None:
            raise TypeError("explain(q, k=k, ...) needs k with tensors, or a Problem")
        problem, found = _problem_from_tensors(
            problem, k, causal=causal, layout=layout, allow_fp16_accum=allow_fp16_accum, op=op,
            features=features,
        )
        if device is AUTO:
            device = found
    elif device is AUTO:
        device = None
        try:
            import torch

            if torch.cuda.is_available():
                device = _cuda_device_info(torch.cuda.current_device())
        except Exception:  # noqa: BLE001
            device = None
    return problem, device


def _rate(r: Any) -> str:
    """A record's throughput: TFLOP/s, and for a decode problem the K/V bandwidth too (its
    measure: docs/DECODING.md)."""
    text = f", {r.tflops:.1f} TFLOP/s" if r.tflops else ""
    if r.problem.op == "decode" and r.median_ms:
        text += f", {r.problem.bytes_read() / (r.median_ms * 1e-3) / 1e9:.0f} GB/s of K/V"
    return text
