"""Kernel backends: built-in ones live here; plugins register through entry points."""

from __future__ import annotations

from .base import Backend, Candidate

__all__ = ["Backend", "Candidate"]
