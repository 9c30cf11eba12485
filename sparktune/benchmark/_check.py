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

from ..dtypes import TORCH_DTYPES
from ..tune import ERROR_FACTOR, FP16_ACCUM_FACTOR
from ..tune._workload import check_outputs, reference_bounds

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["CheckOutcome", "Inputs", "References", "TORCH_DTYPES", "make_inputs"]



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


class References:
    """The float64 references of one shape's inputs and their error bounds, computed on first
    need and kept for every op and candidate of the shape."""

    def __init__(self, inputs: Inputs, dtype_name: str) -> None:
        self.inputs = inputs
        self.dtype_name = dtype_name
        self.factor = ERROR_FACTOR * (FP16_ACCUM_FACTOR if inputs.allow_fp16_accum else 1.0)
        self._fwd: dict[str, tuple[torch.Tensor, float, None]] | None = None
        self._bwd: dict[str, tuple[torch.Tensor, float, None]] | None = None

    def _bounds(self, op: str) -> dict:
        t = self.inputs
        tensors = {"q": t.q, "k": t.k, "v": t.v, "dout": t.dout}
        return reference_bounds(
            tensors, op=op, causal=t.causal, scale=t.scale, factor=self.factor, lse=False
        )

    def _forward(self) -> dict:
        if self._fwd is None:
            self._fwd = self._bounds("fwd")
        return self._fwd

    def _backward(self) -> dict:
        if self._bwd is None:
            self._bwd = self._bounds("bwd")
        return self._bwd

    def expected(self, op: str) -> dict[str, tuple[torch.Tensor, float, None]]:
        """output name -> (float64 reference, bound, None) for ``op``."""
        out: dict = {}
        if op in ("fwd", "fwd+bwd"):
            out.update(self._forward())
        if op in ("bwd", "fwd+bwd"):
            out.update(self._backward())
        return out

    def check(self, op: str, outputs: dict[str, torch.Tensor]) -> CheckOutcome:
        r = check_outputs(self.expected(op), outputs, factor=self.factor, dtype=self.dtype_name)
        return CheckOutcome(r.ok, r.error, r.limit, r.message)

    def release(self) -> None:
        self._fwd = self._bwd = None
