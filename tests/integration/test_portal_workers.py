"""The whole portal suite (tests/integration/test_portal_mesh.py) with `socks5.workers = 2`.

Every portal there gets a worker process beside the node's own (issue 18 item 3,
tests: "the SOCKS worker mode with the whole portal suite"): the kernel spreads
the suite's connections over both, and those a worker takes that need the mesh
(all of them on these mesh nodes but the direct-fallback ones) are handed to
the node's process and routed there, so every test holds as it does with one
process. tests/integration/test_socks5_workers.py checks who took what.
"""

from __future__ import annotations

from typing import Any

import pytest

import tests.integration.test_portal_mesh as suite
from tests.integration.test_portal_mesh import *  # noqa: F403 - the suite's tests and fixtures, collected here again


@pytest.fixture(autouse=True)
def _two_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = suite.cfg

    def cfg(name: str, ipv4: str, **sections: Any) -> Any:
        socks = sections.get("socks5")
        if socks and socks.get("enable"):
            sections["socks5"] = {**socks, "workers": 2}
        return real(name, ipv4, **sections)

    monkeypatch.setattr(suite, "cfg", cfg)


async def test_the_suite_runs_with_a_worker(line: dict[str, Any]) -> None:
    pool = line["a"].socks5.workers
    assert pool is not None and len(pool.pids()) == 1
