"""Errors every layer raises at start-up, named for the config key involved."""

from __future__ import annotations

from meshgate.config import HostPort


class StartupError(Exception):
    """A service could not start; the message names the config key and address."""


def bind_error(key: str, address: HostPort | str, exc: OSError) -> StartupError:
    reason = exc.strerror or str(exc)
    return StartupError(f"{key}: cannot listen on {address}: {reason}")
