"""Inputs of one decode problem (docs/DECODING.md), the launch of a candidate on them as
``sparktune.attention_with_kvcache`` runs it, and the reference check.

The check is the dense one's rule (:mod:`sparktune.tune._workload`): a candidate's max abs
error against the float64 reference math on the same inputs must be at most
:data:`~sparktune.tune._workload.ERROR_FACTOR` times the error of the same math in the input
dtype, plus :data:`~sparktune.tune._workload.ERROR_FLOOR`; the output always, the log-sum-exp
where the candidate returns one (the torch path returns none).

The cache is full to the problem's bucket: contiguous ``(B, cache_len, Hkv, D)``, or paged
``(B * cache_len // page_size, page_size, Hkv, D)`` with the pages of each sequence in a random
order; one set of tensors serves the check and the timing. The check has ragged lengths (the
first sequence full, the others between half the capacity and all of it), so that a config's
tails are checked too; timing runs with every sequence at the capacity (what the FLOPs and
bytes of the record count). New tokens (``appends``) are written at the same slots with the
same values by every launch, so repeated launches leave the same cache.

Timing on a CUDA device replays the call captured in a CUDA graph (``graphs=True``, the
default), as serving engines run decode steps: what is ranked is the candidate's kernels, not
the host's launch cost, which is about the same for every Triton config and, at small batches,
larger than the kernels (an eager timing there ranks noise). A candidate whose call cannot be
captured (the torch path reads the lengths on the host) is timed eager, its host cost included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._kvcache import append_kv, attention_with_kvcache, check_kvcache, reference_decode
from ..dtypes import TORCH_DTYPES
from ._workload import (
    ERROR_FACTOR,
    ERROR_FLOOR,
    TUNE_SOFTCAP,
    CheckResult,
    alibi_slopes,
    check_outputs,
)

if TYPE_CHECKING:
    from ..backends.base import Backend, Candidate
    from ..problem import Problem

__all__ = ["DecodeWorkload"]


def _captured(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (two warm-up calls on a side stream first, so that the
    plan is made and the kernels compiled), as its replay; None when the capture fails."""
    stream = torch.cuda.Stream()
    try:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - a call that cannot be captured is timed eager
        torch.cuda.synchronize()
        return None
    return graph.replay


class DecodeWorkload:
    """Random inputs of one decode problem on one torch device, candidate launches on them,
    and (lazily) the reference check. The interface of :class:`~sparktune.tune._workload.Workload`."""

    def __init__(self, problem: Problem, device: torch.device | str, *, seed: int = 0,
                 graphs: bool = True) -> None:
        if problem.op != "decode":
            raise ValueError(f"DecodeWorkload takes a decode problem, got op {problem.op!r}")
        self.problem = problem
        self.graphs = graphs
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[problem.dtype]
        self.scale = 1.0 / math.sqrt(problem.head_dim)
        self.seed = seed
        p = problem
        if p.page_size:
            self.max_blocks = p.seqlen_k // p.page_size
            self.capacity = self.max_blocks * p.page_size
        else:
            self.max_blocks = 0
            self.capacity = p.seqlen_k
        self._check_inputs: dict[str, Any] | None = None
        self._timing_inputs: dict[str, Any] | None = None
        self._refs: dict[str, tuple[torch.Tensor, float, torch.Tensor | None]] | None = None
        self._slopes = alibi_slopes(p.heads_q, self.device) if p.alibi else None

    # ------------------------------------------------------------------ inputs

    def _make(self, seed: int) -> dict[str, Any]:
        p = self.problem
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=dev, dtype=self.dtype)

        t: dict[str, Any] = {"q": randn(p.batch, p.seqlen_q, p.heads_q, p.head_dim)}
        if p.page_size:
            blocks = p.batch * self.max_blocks
            t["k_cache"] = randn(blocks, p.page_size, p.heads_kv, p.head_dim)
            t["v_cache"] = randn(blocks, p.page_size, p.heads_kv, p.head_dim)
            perm = torch.randperm(blocks, generator=gen, device=dev)
            t["block_table"] = perm.to(torch.int32).view(p.batch, self.max_blocks)
        else:
            t["k_cache"] = randn(p.batch, self.capacity, p.heads_kv, p.head_dim)
            t["v_cache"] = randn(p.batch, self.capacity, p.heads_kv, p.head_dim)
            t["block_table"] = None
        if p.appends:
            t["k"] = randn(p.batch, p.appends, p.heads_kv, p.head_dim)
            t["v"] = randn(p.batch, p.appends, p.heads_kv, p.head_dim)
        else:
            t["k"] = t["v"] = None
        most = self.capacity - p.appends
        lens = torch.full((p.batch,), most, device=dev)
        if p.batch > 1:  # ragged: the first full, the others from half the capacity up
            least = max(0, self.capacity // 2 - p.appends)
            lens[1:] = torch.randint(least, most + 1, (p.batch - 1,), generator=gen, device=dev)
        t["cache_seqlens"] = lens.to(torch.int32)
        return t

    def check_inputs(self) -> dict[str, Any]:
        """q, the caches (contiguous, or pages in a random order), the new tokens, ragged
        lengths."""
        if self._check_inputs is None:
            self._check_inputs = self._make(self.seed)
        return self._check_inputs

    def inputs(self, seed: int) -> dict[str, Any]:
        """The timing inputs: the check inputs' tensors (a long cache is tens of GB, and its
        values do not change a decode kernel's time; ``seed`` is not used) with every sequence
        at the capacity. Their appends write the last slots of each sequence, which no check
        reads but with the same values."""
        del seed
        if self._timing_inputs is None:
            t = self.check_inputs()
            full = torch.full_like(t["cache_seqlens"], self.capacity - self.problem.appends)
            self._timing_inputs = {**t, "cache_seqlens": full}
        return self._timing_inputs

    def _call_kw(self, t: dict[str, Any]) -> dict[str, Any]:
        p = self.problem
        return {
            "cache_seqlens": t["cache_seqlens"], "block_table": t["block_table"], "causal": p.causal,
            "scale": self.scale, "window": p.window, "softcap": TUNE_SOFTCAP if p.softcap else 0.0,
            "alibi_slopes": self._slopes,
        }  # fmt: skip

    # ------------------------------------------------------------------ launches

    def launch(
        self, backend: Backend, cand: Candidate, t: dict[str, Any], *, fill: float | None = None
    ) -> tuple[Callable[[], object], dict[str, torch.Tensor]]:
        """(fn, outputs): ``fn()`` is one call of ``attention_with_kvcache`` forced to the
        candidate (its host cost counts, as in a call). With ``fill`` (the check) it asks for
        the log-sum-exp where the candidate has one; timing asks for none, as a decode step
        does, and (CUDA, ``graphs``, a Triton candidate) gets the replay of the call captured
        in a CUDA graph; a capture that fails leaves the eager call."""
        del backend  # the call finds it by name
        outs: dict[str, torch.Tensor] = {}
        need_lse = fill is not None and cand.backend != "torch"
        args = (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"])
        kw = {**self._call_kw(t), "return_lse": need_lse, "backend": cand.backend, "config": cand.config}

        def fn() -> object:
            r = attention_with_kvcache(*args, **kw)
            if need_lse:
                outs["out"], outs["lse"] = r
            else:
                outs["out"] = r
            return r

        if fill is None and self.graphs and cand.backend == "triton" and self.device.type == "cuda":
            replay = _captured(fn)
            if replay is not None:
                return replay, outs
        return fn, outs

    def sdpa_baseline(self, t: dict[str, Any]) -> Callable[[], object]:
        """PyTorch's SDPA on the sliced cache (the torch decode path), as a call runs it."""
        args = (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"])
        kw = {**self._call_kw(t), "backend": "torch"}
        return lambda: attention_with_kvcache(*args, **kw)

    # ------------------------------------------------------------------ the check

    def _references(self) -> dict[str, tuple[torch.Tensor, float, torch.Tensor | None]]:
        """output name -> (float64 reference, bound, mask of entries to compare or None)."""
        if self._refs is None:
            t = self.check_inputs()
            with torch.no_grad():
                inp = check_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], **self._call_kw(t))
                append_kv(inp)  # what every candidate writes: the same values in the same slots
                low, lse_low = reference_decode(inp, self.dtype, return_lse=True)
                out64, lse64 = reference_decode(inp, torch.float64, return_lse=True,
                                                out_dtype=torch.float64)
            lse64 = lse64.double()
            finite = torch.isfinite(lse64)
            err_out = (low.double() - out64).abs().max().item()
            diff = (lse_low.double() - lse64)[finite]
            err_lse = diff.abs().max().item() if diff.numel() else 0.0
            self._refs = {
                "out": (out64, ERROR_FACTOR * err_out + ERROR_FLOOR, None),
                "lse": (lse64, ERROR_FACTOR * err_lse + ERROR_FLOOR, finite),
            }
        return self._refs

    def check(self, outputs: dict[str, torch.Tensor]) -> CheckResult:
        """Compare a candidate's outputs (from :meth:`launch` on :meth:`check_inputs`): the
        output, and the log-sum-exp when the candidate returned one."""
        refs = {n: r for n, r in self._references().items() if n == "out" or n in outputs}
        got = {n: x.float() if n == "lse" else x for n, x in outputs.items()}
        return check_outputs(refs, got, factor=ERROR_FACTOR, dtype=self.problem.dtype)
