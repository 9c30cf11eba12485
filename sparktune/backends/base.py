"""The backend interface every kernel provider implements (built-in or plugin)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ..problem import DeviceInfo, Problem

__all__ = ["OPTIONAL_HOOKS", "Backend", "Candidate"]

#: methods a backend may define beyond :class:`Backend`'s required ones; :class:`Backend`
#: declares each as a class attribute that is None, so ``type(backend).<hook> is None`` means
#: "not offered"
OPTIONAL_HOOKS = ("backward_runner", "forward_alloc", "forward_autograd", "forward_runner", "warmup")


@dataclass(frozen=True)
class Candidate:
    """One runnable (backend, config) pair. ``config`` is the backend's name for a kernel
    configuration, e.g. ``fwd_sm80_f16_d128_m128n64_w4x1_acc32_preg``; backends without
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

    Required: :meth:`configs`, :meth:`not_supported_reasons` and :meth:`forward`;
    :meth:`backward` for backends that differentiate (which says so with
    :attr:`has_backward`; a subclass that overrides :meth:`backward` gets True unless it says
    otherwise). Optional hooks, declared here as None (a backend that has one defines it as a
    method on its class; see :data:`OPTIONAL_HOOKS`):

    ``forward_alloc(q, k, v, *, config, causal, scale, need_lse=True) -> (out, lse)``
        :meth:`forward` writing to an output the backend allocates itself, for kernels that
        make their own output anyway (PyTorch's SDPA): ``sparktune.attention()`` then uses
        ``out`` as it is instead of copying it into a buffer of its own. ``out`` has q's
        (B, Hq, Nq, D) shape and dtype with any strides (the caller makes it contiguous when
        it is not); ``lse`` is as :meth:`forward` returns it (None allowed when ``need_lse``
        is False). It must compute exactly what :meth:`forward` computes for the same config,
        and it is called with autograd enabled as well: it must not record a graph.
        Backends without it are called through :meth:`forward`.

    ``forward_autograd(q, k, v, *, config, causal, scale) -> out``
        The forward recorded by PyTorch's autograd, whose backward is the backend's own from
        what its forward saved (PyTorch's SDPA). ``sparktune.attention()`` uses it for a call
        that needs gradients when the backward would run on the same backend (forced, or
        chosen by dispatch for the backward problem) and no log-sum-exp is asked for; the
        backward then runs no second forward. ``out`` has q's (B, Hq, Nq, D) shape and dtype
        with any strides, and must equal :meth:`forward`'s.

    ``forward_runner(q, k, v, out, *, config, causal, scale, need_lse=True) -> run``
        A forward specialised to inputs like ``q``, ``k`` and ``v`` (their shapes, strides,
        dtype and device; ``out`` is an example output with the strides wanted), for a call
        that ``sparktune.attention()`` sees again: ``run(q, k, v) -> (out, lse)`` on such
        tensors, without autograd, returns a new ``out`` (q's shape and dtype, dense) and
        ``lse`` as :meth:`forward` does. What can be worked out once (argument lists,
        checks that depend only on shapes and strides) is done when it is made, so that a
        repeated call costs little more than the launch. ``sparktune.attention()`` runs it
        once on the tensors of the call that made it and uses it only when it reproduces
        :meth:`forward`'s output bit for bit (else :meth:`forward` stays). None: not for
        these inputs.

    ``backward_runner(q, k, v, *, config, causal, scale) -> run``
        The backward of ``config`` for inputs like ``q``, ``k`` and ``v`` (shapes, strides,
        dtype, device), taking the forward's output and log-sum-exp as given, whichever
        backend computed them: ``run(dout, q, k, v, out, lse) -> (dq, dk, dv)`` in the
        backend's own new tensors ((B, H, N, D) shapes; any strides), or None from ``run``
        for tensors it turns down after all (then :meth:`backward` runs). The hook returns
        None where the config cannot do that for such inputs. A training call whose backward
        dispatch gives to such a config, and whose forward dispatch gives to another backend,
        runs that faster forward and this backward (``forward_autograd`` is then not used).

    Attention features (docs/FEATURES.md): a backend that declares some in :attr:`features`
    receives them as keyword arguments of :meth:`forward` and :meth:`backward`, only those
    that are on (``window``, ``softcap``, ``alibi_slopes``, ``dropout_p`` with ``seed`` and
    ``offset``, ``deterministic`` for the backward, and for packed batches ``cu_seqlens_q``,
    ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` with (total, H, D) tensors and an
    (Hq, total_q) log-sum-exp). Problems with features are run through :meth:`forward` (the
    optional hooks below serve plain problems).

    ``warmup(problem, configs=None, *, processes=1)``
        Compile ``configs`` for ``problem`` ahead of time (backends that compile on first use);
        the tuner calls it before a study with the candidates it will measure, and ignores
        its result and its errors (a config that does not compile fails in its trial).
    """

    #: registry name, e.g. "spark", "triton", "torch", "reference"
    name: str = ""
    #: False for backends that are only an oracle/fallback (never tuned against)
    tunable: bool = True
    #: the backend runs "bwd" problems (:meth:`backward`); see the class docstring
    has_backward: ClassVar[bool] = False
    #: the attention features it takes (docs/FEATURES.md: "window", "softcap", "alibi",
    #: "dropout", "deterministic", "varlen"); a problem with any other never reaches it, and
    #: :meth:`forward`/:meth:`backward` receive the feature keyword arguments only when on
    features: ClassVar[frozenset[str]] = frozenset()

    # the optional hooks (documented above): None here means "not offered"
    backward_runner: ClassVar[Any] = None
    forward_alloc: ClassVar[Any] = None
    forward_autograd: ClassVar[Any] = None
    forward_runner: ClassVar[Any] = None
    warmup: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "has_backward" not in cls.__dict__ and "backward" in cls.__dict__:
            cls.has_backward = cls.__dict__["backward"] is not Backend.backward

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

    def feature_reasons(self, problem: Problem) -> list[str]:
        """The features of ``problem`` this backend does not declare (one reason each)."""
        wanted = problem.features
        if not wanted:
            return []
        return [
            f"backend {self.name!r} does not support the feature {name!r}"
            for name in sorted(wanted - self.features)
        ]

    def runnable_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        """Why this backend cannot run ``config`` (None: any of its configs) for ``problem`` on
        ``device``, all rules together: available in this process, supported, and for a "bwd"
        problem a backward; empty when it can. A backend whose checks raise cannot run, and
        the reason says what was raised."""
        try:
            reasons = list(
                self.unavailable_reasons()
                or self.feature_reasons(problem)
                or self.not_supported_reasons(problem, config, device)
            )
        except Exception as exc:  # noqa: BLE001 - a backend that cannot answer cannot run
            reasons = [f"not_supported_reasons raised {type(exc).__name__}: {exc}"]
        if not reasons and problem.op == "bwd" and not self.has_backward:
            reasons = [f"backend {self.name!r} has no backward"]
        return reasons

    def candidates(self, problem: Problem, device: DeviceInfo | None = None) -> list[Candidate]:
        if self.unavailable_reasons():
            return []
        return [
            Candidate(self.name, c)
            for c in ([] if self.feature_reasons(problem) else self.configs(problem.op))
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
