"""Logging set-up and rate-limited log lines for bad-input paths.

Remote input can trigger a log line per packet; `RateLimitedLog` keeps that
to at most one line per key per interval and says how many were suppressed.
"""

from __future__ import annotations

import logging
import time


def setup(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0, max_keys: int = 1024) -> None:
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return
        if len(self._last) >= self.max_keys:
            self._last.clear()  # bounded: forget old keys rather than grow
        suppressed = last[1] if last else 0
        if suppressed:
            msg += f" ({suppressed} similar suppressed)"
        self._last[key] = (now, 0)
        self.logger.log(level, msg, *args)

    def debug(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.DEBUG, key, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)
