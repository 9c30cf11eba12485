"""The input dtypes sparktune knows: one table, keyed by their names in the problem key
(:data:`sparktune.problem.DTYPES`)."""

from __future__ import annotations

import torch

from .problem import DTYPES

__all__ = ["DTYPE_NAMES", "TORCH_DTYPES"]

#: the problem key's dtype name -> the torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
#: torch dtype -> its name in the problem key
DTYPE_NAMES: dict[torch.dtype, str] = {t: name for name, t in TORCH_DTYPES.items()}
