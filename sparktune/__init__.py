"""sparktune: autotuned fused multi-head attention kernels for PyTorch.

``sparktune.attention(q, k, v, ...)`` runs the fastest kernel available for the problem:
our CUDA and Triton kernels, PyTorch's SDPA backends, or plugins. Importing the package loads
torch but nothing optional (no optuna, sqlalchemy or triton); backends load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from . import _ops  # noqa: F401  (registers the sparktune:: custom ops)
from ._kvcache import attention_with_kvcache
from .attention import attention, varlen_attention
from .problem import DeviceInfo, Problem

if TYPE_CHECKING:
    from .dispatch import explain

__all__ = ["attention", "varlen_attention", "attention_with_kvcache", "explain", "Problem", "DeviceInfo", "__version__"]


def __getattr__(name: str) -> Any:
    # ``sparktune.explain`` is dispatch's, imported on first use (the package stays light)
    if name == "explain":
        from .dispatch import explain

        return explain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "explain"})
