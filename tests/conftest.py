import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Nodes a test starts without a state_dir of their own use the default, ~/.local/state/meshgate:
# under the real HOME that is the developer's own node's directory (a running node holds its
# lock, and 52 tests failed with "in use by another running meshgate node"), so the whole run,
# and every `meshgate run` it starts, gets a HOME of its own.
_home = tempfile.mkdtemp(prefix="meshgate-test-home-")
os.environ["HOME"] = _home

# Property tests check behaviour, not speed: no per-example deadline (hypothesis' default 200 ms
# fails examples that a busy or slower CI machine merely ran late, as DeadlineExceeded or Flaky),
# and no too_slow health check on input generation. Examples stay random; a failure prints the
# blob that reproduces it. HYPOTHESIS_PROFILE=default restores hypothesis' own settings.
settings.register_profile(
    "meshgate", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "meshgate"))


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    """Async tests run on uvloop, the loop `meshgate run` uses by default, so
    transport differences (uvloop's are not asyncio.Transport subclasses)
    show up here. MESHGATE_TEST_LOOP=asyncio runs them on the standard loop."""
    import asyncio

    if os.environ.get("MESHGATE_TEST_LOOP", "uvloop") == "uvloop":
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
