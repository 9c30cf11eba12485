"""One-time messages: a notice given once per process for each key."""

from __future__ import annotations

import logging
import warnings

__all__ = ["Once"]


class Once:
    """Gives each keyed message once: logged at ``level`` on ``logger``, and with
    ``warn=True`` also issued as a :class:`RuntimeWarning` (``stacklevel`` counts from the
    caller of this object)."""

    def __init__(self, logger: logging.Logger, level: int, *, warn: bool) -> None:
        self.logger = logger
        self.level = level
        self.warn = warn
        #: the keys already given
        self.given: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.given

    def clear(self) -> None:
        self.given.clear()

    def __call__(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key in self.given:
            return
        self.given.add(key)
        self.logger.log(self.level, "%s", message)
        if self.warn:
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
