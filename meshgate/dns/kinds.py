"""Registry entries: "module:Class" strings, imported when a kind is first used.

The DNS registries (listeners.DNS_LISTENERS, upstream.UPSTREAMS) name their classes this way so
that a kind nobody configured is never imported (aioquic, h2 and the ODoH code load only when a
listener or upstream needs them) and so that a registry never imports the modules that import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def load_class(registry: Mapping[str, str], key: str, base: type[T]) -> type[T]:
    """The class `registry[key]` names (KeyError if none), imported now; TypeError unless it is
    a subclass of `base`."""
    ref = registry[key]
    module, _, name = ref.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{key!r} -> {ref!r} is not a {base.__name__}")
    return cls
