"""The numerical oracle shared by every test file.

    from tests._oracle import assert_close_to_reference, assert_grads_close_to_reference

    assert_close_to_reference(out, q, k, v, *, causal=False, scale=None, lse=None,
                              factor=2.0, floor=1e-5, what="") -> Tolerance
    assert_grads_close_to_reference(grads, q, k, v, dout, *, causal=False, scale=None,
                                    factor=2.0, floor=1e-5, what="") -> list[Tolerance]

Tensors are (B, H, N, D) views with any strides: q, k, v the inputs the kernel was given
(float16 or bfloat16; float32 works too), ``out`` its output, ``lse`` its optional float32
(B, Hq, Nq) log-sum-exp, ``grads`` its (dq, dk, dv) for the output gradient ``dout``.

The rule (FlashAttention-2's): the kernel's max abs error against attention computed in float64
from the same inputs must be at most ``factor`` times PyTorch's own max abs error in the input
precision, plus ``floor``. PyTorch's own error is the larger of two computations in the input
dtype on the inputs' device: math SDPA, and the plain matmul-softmax-matmul (scores,
probabilities and output each rounded to the dtype; this is the one a fused kernel is measured
against, since torch's math SDPA may upcast internally). Gradients use autograd through the
same two computations. For lse the baseline is the log-sum-exp of the rounded scores; rows with
no visible key must be -inf in both.

Semantics are sparktune's: GQA (query head h reads kv head h // (Hq // Hkv)), causal aligned
bottom-right, rows with no visible key give output 0 (and zero gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparktune.backends.reference import reference_attention, reference_attention_backward

__all__ = [
    "Tolerance",
    "assert_close_to_reference",
    "assert_grads_close_to_reference",
    "lowp_attention",
    "visible_mask",
]


@dataclass(frozen=True)
class Tolerance:
    """One comparison: the kernel's error, torch's error (baseline) and the bound used."""

    what: str
    error: float
    baseline: float
    bound: float

    def __str__(self) -> str:
        return (
            f"{self.what}: max abs error {self.error:.3g} vs bound {self.bound:.3g} "
            f"(torch's own error {self.baseline:.3g})"
        )


def visible_mask(nq: int, nk: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    """(nq, nk) boolean, True where query i sees key j (bottom-right causal); None if not
    causal."""
    if not causal:
        return None
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def lowp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    kind: str = "plain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in the inputs' dtype, as plain PyTorch computes it: ``kind="plain"``
    (matmul, softmax, matmul) or ``"sdpa"`` (math SDPA). Returns (out, lse of the rounded
    scores in float32; for "sdpa" the plain scores' lse). Differentiable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sc = _scale(q, scale)
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    nq, nk = q.shape[2], k.shape[2]
    mask = visible_mask(nq, nk, causal, q.device)
    empty = None
    if mask is not None and nq > nk:
        empty = ~mask.any(dim=-1)
        mask = mask | empty[:, None]  # open rows that see nothing; they are zeroed below
    s = torch.matmul(q, k.transpose(-1, -2)) * sc
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s.detach().float(), dim=-1)
    if kind == "plain":
        out = torch.matmul(torch.softmax(s, dim=-1), v)
    elif kind == "sdpa":
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sc)
    else:
        raise ValueError(f"kind must be 'plain' or 'sdpa', got {kind!r}")
    if empty is not None:
        out = out.masked_fill(empty[:, None], 0.0)
        lse = lse.masked_fill(empty, -math.inf)
    return out, lse


def _max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    diff = (a.to(torch.float64) - ref).abs()
    return float(diff.max())


def _check(what: str, err: float, baseline: float, factor: float, floor: float) -> Tolerance:
    tol = Tolerance(what, err, baseline, factor * baseline + floor)
    assert math.isfinite(err), f"{tol} (NaN or inf in the result)"
    assert err <= tol.bound, str(tol)
    return tol


def assert_close_to_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    factor: float = 2.0,
    floor: float = 1e-5,
    what: str = "out",
) -> Tolerance:
    """Assert ``out`` (and ``lse`` if given) obey the 2x-PyTorch rule; returns out's check."""
    assert tuple(out.shape) == tuple(q.shape), (
        f"{what}: shape {tuple(out.shape)} != {tuple(q.shape)}"
    )
    with torch.no_grad():
        ref, ref_lse = reference_attention(q, k, v, causal=causal, scale=scale)
        baselines = [
            lowp_attention(q, k, v, causal=causal, scale=scale, kind=kd) for kd in ("plain", "sdpa")
        ]
    baseline = max(_max_err(o, ref) for o, _ in baselines)
    result = _check(what, _max_err(out, ref), baseline, factor, floor)
    if lse is not None:
        assert tuple(lse.shape) == tuple(ref_lse.shape), (
            f"{what} lse: shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
        )
        assert lse.dtype == torch.float32, f"{what} lse: dtype {lse.dtype}, expected float32"
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), (
            f"{what} lse: -inf rows differ from the reference"
        )
        keep = ~empty
        _check(
            f"{what} lse",
            _max_err(lse[keep], ref_lse[keep]),
            _max_err(baselines[0][1][keep], ref_lse[keep]),
            factor,
            floor,
        )
    return result


def _lowp_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    scale: float | None,
    kind: str,
) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = lowp_attention(*leaves, causal=causal, scale=scale, kind=kind)
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def assert_grads_close_to_reference(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    factor: float = 2.0,
    floor: float = 1e-5,
    what: str = "",
) -> list[Tolerance]:
    """Assert each of (dq, dk, dv) obeys the 2x-PyTorch rule against float64 gradients."""
    refs = reference_attention_backward(dout, q, k, v, causal=causal, scale=scale)
    lowps = [_lowp_grads(q, k, v, dout, causal, scale, kd) for kd in ("plain", "sdpa")]
    results = []
    for i, name in enumerate(("dq", "dk", "dv")):
        g = grads[i]
        label = f"{what} {name}".strip()
        assert g is not None, f"{label}: no gradient"
        assert tuple(g.shape) == tuple(refs[i].shape), (
            f"{label}: shape {tuple(g.shape)} != {tuple(refs[i].shape)}"
        )
        baseline = max(_max_err(lp[i], refs[i]) for lp in lowps)
        results.append(_check(label, _max_err(g, refs[i]), baseline, factor, floor))
    return results
