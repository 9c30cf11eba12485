"""The Triton backend: FlashAttention-2 forward and backward for sm_80 and later.

Configs are named from their parameters (``tfwd_m128n64_w8s3``, ``tbwd_m32n128_w4s3``,
``tbwd_m64n128_w8s2_dqatomic``); the declared space is :data:`FWD_SPACE` / :data:`BWD_SPACE`
in :mod:`sparktune.kernels.triton_space`. Any well-formed name runs, declared or not.

Triton compiles a kernel the first time a (config, dtype, head_dim, causal) variant runs; the
compiled kernel stays in Triton's process-wide and on-disk caches, the first compile of each
variant is logged at INFO, and :meth:`TritonBackend.warmup` compiles ahead of time (optionally
in several processes, which fill the shared on-disk cache).

CPU tensors run under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before the
kernels were first imported (tests only: it is slow).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..kernels.triton_space import (
    BWD_SPACE,
    FWD_SPACE,
    MAX_HEAD_DIM,
    MIN_CAPABILITY,
    MIN_HEAD_DIM,
    config_reasons,
    default_config_name,
    parse_config,
)
from ..problem import DTYPES
from .base import Backend

if TYPE_CHECKING:
    import torch

    from ..problem import DeviceInfo, Problem

__all__ = ["TritonBackend", "warmup_jobs"]

log = logging.getLogger(__name__)

_PRE_AMPERE = (
    "Triton has no tensor-core path before sm_80 (Volta); use the spark backend"
)


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernels():
    from ..kernels import triton_attn

    return triton_attn


#: feature name -> the keyword arguments both kernel functions must take for it (the
#: backward alone for "deterministic"), docs/FEATURES.md
_FEATURE_ARGS = {
    "window": ("window",),
    "softcap": ("softcap",),
    "alibi": ("alibi_slopes",),
    "dropout": ("dropout_p", "seed", "offset"),
    "varlen": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
}


@functools.cache
def kernel_features() -> frozenset[str]:
    """The features the Triton kernels take, read from the signatures of
    ``attention_forward``/``attention_backward`` (empty when they cannot be imported): a
    feature is declared once both functions accept its keyword arguments."""
    if _triton_import_error() is not None:
        return frozenset()
    import inspect

    try:
        kernels = _kernels()
        fwd = inspect.signature(kernels.attention_forward).parameters
        bwd = inspect.signature(kernels.attention_backward).parameters
    except Exception:  # noqa: BLE001 - kernels that cannot be inspected take no feature
        return frozenset()
    names = {
        name
        for name, args in _FEATURE_ARGS.items()
        if all(a in fwd and a in bwd for a in args)
    }
    if "deterministic" in bwd:
        names.add("deterministic")
    names.add("decode")  # the split-KV kernels of triton_decode (docs/DECODING.md)
    return frozenset(names)


def _decode_reasons(problem: Problem, config: str | None, device: DeviceInfo | None) -> list[str]:
    """Why the split-KV decode kernels cannot run a decode problem (with ``config``)."""
    from ..kernels.triton_decode_space import parse_decode_config, problem_reasons

    reasons = _device_reasons(
        device,
        "decode kernels need CUDA tensors (CPU tensors run only under Triton's interpreter, "
        "TRITON_INTERPRET=1)",
        "decode kernels need sm_80 or later",
    )
    reasons += problem_reasons(problem)
    if config is not None:
        try:
            parse_decode_config(config)
        except ValueError as exc:
            reasons.append(str(exc))
    return reasons


def _device_reasons(device: DeviceInfo | None, no_cuda: str, pre_ampere: str) -> list[str]:
    """``no_cuda`` for CPU tensors unless Triton's interpreter is asked for; ``pre_ampere``
    (with the device's arch) before sm_80."""
    if device is None:
        return [] if _interpret_requested() else [no_cuda]
    if tuple(device.capability) < MIN_CAPABILITY:
        return [f"{pre_ampere} (device is sm_{device.arch})"]
    return []


def _problem_reasons(problem: Problem, device: DeviceInfo | None) -> list[str]:
    reasons = _device_reasons(
        device,
        "needs CUDA tensors (CPU tensors run only under Triton's interpreter, TRITON_INTERPRET=1)",
        _PRE_AMPERE,
    )
    if problem.dtype not in DTYPES:
        reasons.append(f"dtype {problem.dtype} (needs float16 or bfloat16)")
    if not MIN_HEAD_DIM <= problem.head_dim <= MAX_HEAD_DIM:
        reasons.append(f"head_dim {problem.head_dim} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    return reasons


class TritonBackend(Backend):
    """FlashAttention-2 in Triton (sparktune.kernels.triton_attn) behind the sparktune
    interface."""

    name = "triton"
    tunable = True

    @property
    def features(self) -> frozenset[str]:  # type: ignore[override]
        """What the installed kernels take (:func:`kernel_features`)."""
        return kernel_features()

    def unavailable_reasons(self) -> list[str]:
        error = _triton_import_error()
        if error is not None:
            return [f"triton is not importable ({error})"]
        import torch

        if not torch.cuda.is_available() and not _interpret_requested():
            return [
                "no CUDA GPU visible to torch (set TRITON_INTERPRET=1 to run CPU tensors "
                "under Triton's interpreter, slowly)"
            ]
        return []

    def configs(self, op: str = "fwd") -> Sequence[str]:
        if op == "fwd":
            return tuple(c.name for c in FWD_SPACE)
        if op == "bwd":
            return tuple(c.name for c in BWD_SPACE)
        if op == "decode":
            from ..kernels.triton_decode_space import DECODE_SPACE

            return DECODE_SPACE
        raise ValueError(f"op must be 'fwd', 'bwd' or 'decode', got {op!r}")

    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        if problem.op == "decode":
            return _decode_reasons(problem, config, device)
        reasons = _problem_reasons(problem, device)
        if config is None:
            if not reasons and default_config_name(problem, device) is None:
                space = FWD_SPACE if problem.op == "fwd" else BWD_SPACE
                first = config_reasons(space[0], problem, device)
                reasons.append(
                    f"no {problem.op} config of the space fits (e.g. {'; '.join(first)})"
                )
            return reasons
        try:
            cfg = parse_config(config)
        except ValueError as exc:
            return [*reasons, str(exc)]
        if problem.deterministic and getattr(cfg, "dq_atomic", False):
            reasons.append(
                "dQ accumulates with float atomics: gradients not bitwise reproducible "
                "(deterministic=True)"
            )
        return [*reasons, *config_reasons(cfg, problem, device)]

    def default_config(self, problem: Problem, device: DeviceInfo | None = None) -> str | None:
        if problem.op == "decode":
            if self.unavailable_reasons() or _decode_reasons(problem, None, device):
                return None
            from ..kernels.triton_decode_space import default_decode_config

            return default_decode_config(problem.head_dim)
        if self.unavailable_reasons() or _problem_reasons(problem, device):
            return None
        name = default_config_name(problem, device)
        if name is not None and problem.deterministic and self.not_supported_reasons(problem, name, device):
            # the heuristic's choice accumulates dQ with atomics: the first config that does not
            cands = self.candidates(problem, device)
            return cands[0].config if cands else None
        return name

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
        **features: object,
    ) -> torch.Tensor | None:
        kernels = _kernels()
        _check_device(kernels, q)
        with _on_device(q):
            if features:
                return kernels.attention_forward(
                    q, k, v, out, config=config, causal=causal, scale=scale, **features
                )
            return kernels.attention_forward(q, k, v, out, config=config, causal=causal, scale=scale)

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
        **features: object,
    ) -> None:
        kernels = _kernels()
        _check_device(kernels, q)
        with _on_device(q):
            kernels.attention_backward(
                dout, q, k, v, out, lse, dq, dk, dv, config=config, causal=causal, scale=scale,
                **features,
            )

    def warmup(
        self, problem: Problem, configs: Iterable[str] | None = None, *, processes: int = 1
    ) -> dict[str, float]:
        """Compile ``configs`` (default: the heuristic default) for ``problem`` ahead of time;
        returns config name -> compile seconds. With ``processes > 1`` the compilation runs in
        that many worker processes (they fill Triton's on-disk cache, from which this process
        then loads). A config that fails to compile is logged and left out. Decode problems
        compile on their first check (nothing ahead of time)."""
        if problem.op == "decode":
            return {}
        if configs is None:
            name = self.default_config(problem)
            configs = [name] if name else []
        return warmup_jobs([(problem, c) for c in configs], processes=processes)


def _check_device(kernels, q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not kernels.INTERPRET:
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (got {q.device}); CPU tensors run only under "
            "Triton's interpreter, and TRITON_INTERPRET=1 must be set before "
            "sparktune.kernels.triton_attn is first imported"
        )


def _on_device(q: torch.Tensor):
    """Make q's GPU the current one, where Triton launches."""
    import contextlib

    import torch

    if q.device.type == "cuda":
        return torch.cuda.device(q.device)
    return contextlib.nullcontext()


def _warmup_one(problem: Problem, config: str) -> tuple[str, float | None, str | None]:
    try:
        seconds = _kernels().warmup(problem, [config]).get(config, 0.0)
        return config, seconds, None
    except Exception as exc:  # noqa: BLE001 - reported to the caller, never fatal
        return config, None, f"{type(exc).__name__}: {exc}"


#: a compilation (or load) in this process shorter than this came from Triton's caches
CACHE_HIT_S = 0.5

_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_size = 0


def _workers(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    """The compile workers, started once per process and kept (their start, an import of
    torch and Triton each, costs seconds; a run that tunes several problems pays it once)."""
    global _pool, _pool_size
    if _pool is None or _pool_size != processes:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        ctx = multiprocessing.get_context("spawn")
        _pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx)
        _pool_size = processes
        atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
    return _pool


def warmup_jobs(
    jobs: Sequence[tuple[Problem, str]], *, processes: int = 1
) -> dict[str, float]:
    """Compile each (problem, config) pair; see :meth:`TritonBackend.warmup`. The result maps
    ``"<config> <dtype> d<head_dim> causal=<0|1>"`` to compile seconds (in the workers when
    they compiled it).

    Jobs run in this process while each takes less than :data:`CACHE_HIT_S` (they come from
    Triton's on-disk cache: a second tuning run, or a new sequence length of a shape already
    compiled; the first job, which also pays Triton's start in this process, is not judged).
    At the first that takes longer, and ``processes > 1``, the rest go to that many
    worker processes, which fill the on-disk cache; this process then loads from it."""
    kernels = _kernels()
    if kernels.INTERPRET or not jobs:
        return {}

    def key(p: Problem, c: str) -> str:
        return f"{c} {p.dtype} d{p.head_dim} causal={int(p.causal)}"

    results: dict[str, float] = {}
    left = list(jobs)
    first = True
    while left:
        p, c = left[0]
        t0 = time.monotonic()
        _, seconds, error = _warmup_one(p, c)
        left.pop(0)
        if error is not None:
            log.warning("triton: warmup of %s failed: %s", key(p, c), error)
        else:
            results[key(p, c)] = seconds or 0.0
        # (the first job of a process also pays Triton's own start: it does not decide)
        if processes > 1 and not first and time.monotonic() - t0 >= CACHE_HIT_S:
            break  # compiling, not loading: the rest in parallel
        first = False
    if left:
        pool = _workers(processes)
        futures = {pool.submit(_warmup_one, p, c): (p, c) for p, c in left}
        for fut in concurrent.futures.as_completed(futures):
            p, c = futures[fut]
            try:
                _, seconds, error = fut.result()
            except Exception as exc:  # noqa: BLE001 - a dead worker is reported, not fatal
                seconds, error = None, f"{type(exc).__name__}: {exc}"
            if error is not None:
                log.warning("triton: warmup of %s failed: %s", key(p, c), error)
            else:
                results[key(p, c)] = seconds or 0.0
        # in this process: loads what the workers compiled
        for p, c in left:
            _warmup_one(p, c)
    return results
