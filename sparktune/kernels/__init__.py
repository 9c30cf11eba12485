"""Kernels written in Python DSLs (Triton). Importing this package imports no DSL: the
configuration space (:mod:`.triton_space`) is plain data, and :mod:`.triton_attn` (which imports
torch and triton) is loaded only when a kernel runs."""

from __future__ import annotations

__all__: list[str] = []
