"""The progress bar of the long-running commands (tune, bench)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, *, unit: str, disable: bool) -> Any:
    """A tqdm bar on stderr, or None when disabled, empty or tqdm is not installed."""
    if disable or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
