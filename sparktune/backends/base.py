"""The backend interface every kernel provider implements (built-in or plugin)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..problem import DeviceInfo, Problem

__all__ = ["Backend", "Candidate"]


@dataclass(frozen=True)
class Candidate:
    """One runnable (backend, config) pair. ``config`` is the backend's name for a kernel
    configuration, e.g. ``fwd_sm80_f16_d128_m128n64_w4x1_acc32``; backends without
    configurations use ``"default"``."""

    backend: str
    config: str
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.config}"


class Backend(ABC):
    """A provider of attention kernels.

    Tensors reach a backend as (B, H, N, D) views with any strides whose last dimension is
    contiguous; ``out`` is preallocated by the caller in the same view form.
    """

    #: registry name, e.g. "spark", "triton", "torch", "reference"
    name: str = ""
    #: False for backends that are only an oracle/fallback (never tuned against)
    tunable: bool = True

    def unavailable_reasons(self) -> list[str]:
        """Why this backend cannot run at all in this process (empty when it can)."""
        return []

    @abstractmethod
    def configs(self, op: str = "fwd") -> Sequence[str]:
        """Every configuration name this backend offers for ``op`` in this process."""

    @abstractmethod
    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        """Why ``config`` (or, with None, every config of this backend) cannot run ``problem``
        on ``device``; empty when it can."""

    def candidates(self, problem: Problem, device: DeviceInfo | None = None) -> list[Candidate]:
        if self.unavailable_reasons():
            return []
        return [
            Candidate(self.name, c)
            for c in self.configs(problem.op)
            if not self.not_supported_reasons(problem, c, device)
        ]

    def default_config(self, problem: Problem, device: DeviceInfo | None = None) -> str | None:
        """The heuristic choice for an untuned problem, or None when nothing supports it."""
        cands = self.candidates(problem, device)
        return cands[0].config if cands else None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
    ) -> torch.Tensor | None:
        """Write attention(q, k, v) into ``out`` and return the row log-sum-exp, float32 of
        shape (B, Hq, Nq), natural log, of the scaled scores (None is allowed when
        ``need_lse`` is False). Causal masks are aligned to the bottom-right corner: query i
        sees keys j <= i + seqlen_k - seqlen_q. Rows with no visible key get output 0 and
        log-sum-exp -inf."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
    ) -> None:
        raise NotImplementedError(f"backend {self.name!r} has no backward")
