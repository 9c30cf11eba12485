"""Attention dropout's keep mask: the one definition every backend follows.

Element (row, col) of a call's attention probabilities is kept iff ``u >= threshold(p)``,
where ``u`` is a counter-based 32-bit hash of (key, row, col): ``key`` comes from the
``(seed, offset)`` pair drawn from the caller's generator (:func:`dropout_key`), rows are
numbered in the log-sum-exp's layout (dense: ``(b * Hq + h) * Nq + i``; varlen:
``h * total_q + t`` with ``t`` the packed query index) and columns are the key index within
the sequence. Nothing is stored: a backward regenerates the mask from the same counters. The
hash is a few integer multiplies and shifts, so a kernel computes it per element at little cost.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dropout_keep", "dropout_key", "dropout_threshold", "mix32"]

_M32 = 0xFFFFFFFF


def mix32(x: Any) -> Any:
    """A 32-bit integer hash (xor-shift-multiply), for Python ints and int64 tensors alike
    (every product is taken modulo 2**32, so uint32 arithmetic gives the same bits)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def dropout_key(seed: int, offset: int) -> int:
    """The 32-bit key of one call's dropout mask, from the ``(seed, offset)`` drawn from the
    caller's generator."""
    seed, offset = int(seed), int(offset)
    return mix32(
        mix32(mix32(mix32(seed & _M32) ^ ((seed >> 32) & _M32)) ^ (offset & _M32))
        ^ ((offset >> 32) & _M32)
    )


def dropout_threshold(dropout_p: float) -> int:
    """The 32-bit threshold of ``dropout_p``: a probability is kept iff its hash is at least
    this. ``round(p * 2**32)``, at most ``2**32 - 1`` (a ``p`` within 2**-33 of 1 keeps the
    one hash value ``2**32 - 1``, so that the threshold fits in 32 bits)."""
    return min(round(float(dropout_p) * 2**32), _M32)


def dropout_keep(key: int, row: torch.Tensor, col: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The keep mask of the module's definition for int64 ``row`` and ``col`` tensors that
    broadcast (``key`` from :func:`dropout_key`)."""
    row = row.to(torch.int64)
    u = mix32(mix32(mix32(key ^ (row & _M32)) ^ (row >> 32)) ^ col.to(torch.int64))
    return u >= dropout_threshold(dropout_p)
