"""A sparktune backend whose kernels have known costs.

Each config computes attention with sparktune's float32 reference math (so it runs anywhere),
except the deliberately broken ones, and has a known cost that :func:`cost_ms` reports to the
tuner's ``CostTimer``. The costs are chosen so that the right answers are unambiguous:

- ``wrong`` is the cheapest and computes a wrong output: it must be pruned, never win;
- ``crash`` raises when launched: it must be recorded as failed;
- ``d64only`` supports head_dim 64 only: elsewhere it must be filtered out before tuning;
- ``fast`` wins short sequences, ``long`` wins seqlen_k >= 1024;
- backward: ``bwd_fast`` wins, ``bwd_wrong`` is wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from sparktune.backends.base import Backend
from sparktune.backends.reference import reference_attention, reference_attention_backward

__all__ = ["FWD_COSTS", "BWD_COSTS", "KnownCostBackend", "cost_ms", "LONG_FROM"]

#: relative cost per unit of work (GFLOP); None: the cost depends on the shape (see cost_ms)
FWD_COSTS = {"fast": 1.0, "medium": 2.0, "slow": 4.0, "long": None, "wrong": 0.25, "crash": 0.1, "d64only": 0.5}
BWD_COSTS = {"bwd_fast": 1.0, "bwd_slow": 3.0, "bwd_wrong": 0.2}
#: seqlen_k from which "long" is the fastest forward config
LONG_FROM = 1024
#: cost of PyTorch's default SDPA, the baseline of the speedup column
BASELINE_COST = 3.0


def cost_ms(config: str | None, problem) -> float | None:
    """The known time in ms of ``config`` on ``problem`` (None for an unknown config; the
    tuner's baseline pseudo-candidate is given as ``"sdpa:default"``)."""
    work = problem.flops() / 1e9
    if config == "sdpa:default":
        return BASELINE_COST * work
    if config == "long":
        return (0.5 if problem.seqlen_k >= LONG_FROM else 8.0) * work
    rel = FWD_COSTS.get(config, BWD_COSTS.get(config))
    return None if rel is None else rel * work


class KnownCostBackend(Backend):
    name = "knowncost"
    tunable = True

    def __init__(self) -> None:
        #: config -> number of launches, to see what dispatch ran
        self.calls: Counter[str] = Counter()

    def configs(self, op: str = "fwd") -> Sequence[str]:
        return tuple(FWD_COSTS if op == "fwd" else BWD_COSTS)

    def not_supported_reasons(self, problem, config=None, device=None) -> list[str]:
        if config is None:
            return []
        if config not in self.configs(problem.op):
            return [f"{config!r} is not a {problem.op} config"]
        if config == "d64only" and problem.head_dim != 64:
            return [f"head_dim {problem.head_dim} (d64only needs 64)"]
        return []

    def default_config(self, problem, device=None) -> str | None:
        return "medium" if problem.op == "fwd" else "bwd_slow"

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        self.calls[config] += 1
        if config == "crash":
            raise RuntimeError("knowncost: the crash config crashed, as designed")
        o, lse = reference_attention(q, k, v, causal, scale, torch.float32)
        if config == "wrong":
            o = o + 0.5
        out.copy_(o)
        return lse.float() if need_lse else None

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, *, config, causal, scale):
        self.calls[config] += 1
        gq, gk, gv = reference_attention_backward(dout, q, k, v, causal, scale, torch.float32)
        if config == "bwd_wrong":
            gq = gq * 1.5
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)
