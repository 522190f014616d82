import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    """Async tests run on uvloop, the loop `meshgate run` uses by default, so
    transport differences (uvloop's are not asyncio.Transport subclasses)
    show up here. MESHGATE_TEST_LOOP=asyncio runs them on the standard loop."""
    import asyncio

    if os.environ.get("MESHGATE_TEST_LOOP", "uvloop") == "uvloop":
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
