"""sparktune: autotuned fused multi-head attention kernels for PyTorch.

``sparktune.attention(q, k, v, ...)`` runs the fastest kernel available for the problem:
our CUDA and Triton kernels, PyTorch's SDPA backends, or plugins. Importing the package loads
torch but nothing optional (no optuna, sqlalchemy or triton); backends load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .attention import attention
from .problem import DeviceInfo, Problem

__all__ = ["attention", "Problem", "DeviceInfo", "__version__"]
