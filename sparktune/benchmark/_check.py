"""Inputs of one benchmark shape and the reference check of a candidate's outputs.

The rule is the tuner's (:mod:`sparktune.tune._workload`): an output's max abs error against
attention computed in float64 on the same inputs must be at most ``ERROR_FACTOR`` times
PyTorch's own error in the input precision (:func:`~sparktune.tune.lowp_attention`), plus
``ERROR_FLOOR`` (times ``FP16_ACCUM_FACTOR`` more where the shape allows fp16 accumulation).
What is compared is what the timed call produces: the output for the forward, dq, dk and dv
for the backward, all four for forward+backward. The log-sum-exp is not compared: PyTorch's
public SDPA and the plain version do not return it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..backends.reference import reference_attention, reference_attention_backward
from ..tune import ERROR_FACTOR, ERROR_FLOOR, FP16_ACCUM_FACTOR, lowp_attention

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["CheckOutcome", "Inputs", "References", "TORCH_DTYPES", "make_inputs"]

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Inputs:
    """q, k, v and the output gradient of one shape, (B, H, N, D) contiguous."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    causal: bool
    scale: float
    allow_fp16_accum: bool = False

    def nbytes(self, op: str) -> int:
        """Bytes of what the op reads as input: q, k, v, and dout for a backward."""
        tensors = [self.q, self.k, self.v] + ([self.dout] if op != "fwd" else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def make_inputs(shape: Problem, device: torch.device | str, seed: int) -> Inputs:
    """Random normal inputs of ``shape`` (a forward Problem) on ``device``."""
    dtype = TORCH_DTYPES[shape.dtype]
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)

    def randn(heads: int, n: int) -> torch.Tensor:
        return torch.randn(
            (shape.batch, heads, n, shape.head_dim), generator=gen, device=device, dtype=dtype
        )

    return Inputs(
        q=randn(shape.heads_q, shape.seqlen_q),
        k=randn(shape.heads_kv, shape.seqlen_k),
        v=randn(shape.heads_kv, shape.seqlen_k),
        dout=randn(shape.heads_q, shape.seqlen_q),
        causal=shape.causal,
        scale=1.0 / math.sqrt(shape.head_dim),
        allow_fp16_accum=shape.allow_fp16_accum,
    )


@dataclass(frozen=True)
class CheckOutcome:
    ok: bool
    #: the worst output's max abs error and its bound
    error: float
    limit: float
    message: str = ""


def _max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    err = (got.double() - ref).abs().max().item()
    return math.inf if math.isnan(err) else err


class References:
    """The float64 references of one shape's inputs and their error bounds, computed on first
    need and kept for every op and candidate of the shape."""

    def __init__(self, inputs: Inputs, dtype_name: str) -> None:
        self.inputs = inputs
        self.dtype_name = dtype_name
        self.factor = ERROR_FACTOR * (FP16_ACCUM_FACTOR if inputs.allow_fp16_accum else 1.0)
        self._fwd: dict[str, tuple[torch.Tensor, float]] | None = None
        self._bwd: dict[str, tuple[torch.Tensor, float]] | None = None

    def _forward(self) -> dict[str, tuple[torch.Tensor, float]]:
        if self._fwd is None:
            t = self.inputs
            with torch.no_grad():
                ref, _ = reference_attention(t.q, t.k, t.v, t.causal, t.scale, torch.float64)
                low, _ = lowp_attention(t.q, t.k, t.v, causal=t.causal, scale=t.scale)
                bound = self.factor * _max_abs_err(low, ref) + ERROR_FLOOR
            self._fwd = {"out": (ref, bound)}
        return self._fwd

    def _backward(self) -> dict[str, tuple[torch.Tensor, float]]:
        if self._bwd is None:
            t = self.inputs
            refs = reference_attention_backward(
                t.dout, t.q, t.k, t.v, t.causal, t.scale, torch.float64
            )
            lows = lowp_attention(t.q, t.k, t.v, causal=t.causal, scale=t.scale, dout=t.dout)
            self._bwd = {
                name: (ref, self.factor * _max_abs_err(low, ref) + ERROR_FLOOR)
                for name, ref, low in zip(("dq", "dk", "dv"), refs, lows, strict=True)
            }
        return self._bwd

    def expected(self, op: str) -> dict[str, tuple[torch.Tensor, float]]:
        """output name -> (float64 reference, bound) for ``op``."""
        out: dict[str, tuple[torch.Tensor, float]] = {}
        if op in ("fwd", "fwd+bwd"):
            out.update(self._forward())
        if op in ("bwd", "fwd+bwd"):
            out.update(self._backward())
        return out

    def check(self, op: str, outputs: dict[str, torch.Tensor]) -> CheckOutcome:
        worst: tuple[float, float, str] | None = None
        for name, (ref, bound) in self.expected(op).items():
            got = outputs.get(name)
            if got is None:
                return CheckOutcome(False, math.inf, bound, f"no {name} produced")
            if tuple(got.shape) != tuple(ref.shape):
                return CheckOutcome(
                    False, math.inf, bound,
                    f"{name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}",
                )
            err = _max_abs_err(got, ref)
            if worst is None or err / bound > worst[0] / worst[1]:
                worst = (err, bound, name)
        assert worst is not None
        err, bound, name = worst
        if err <= bound:
            return CheckOutcome(True, err, bound)
        return CheckOutcome(
            False, err, bound,
            f"{name}: max abs error {err:.3g} exceeds the bound {bound:.3g} ({self.factor:g}x "
            f"PyTorch's own {self.dtype_name} error + {ERROR_FLOOR:g})",
        )

    def release(self) -> None:
        self._fwd = self._bwd = None
