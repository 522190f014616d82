"""A clone with nothing beside it tests itself: every file the code, tests,
bench and docs read or cite lives inside the repository.

The tree is copied (the files git tracks, plus new unignored ones) into an
otherwise empty directory, so any sibling directory the
checkout happens to have here is out of reach, and the suite is collected
and the tests that read data files are run from that copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require_tool

ROOT = Path(__file__).resolve().parents[2]

# Paths that lead out of the repository: the sibling directory an earlier layout read
# (its vectors, notes and peers) and the design pages that lived there, not here.
# Spelled in pieces so this file does not name them itself.
_SIBLING = "sha" + "red"
_OUTSIDE = re.compile(
    rf"\.\./{_SIBLING}|\b{_SIBLING}/(vectors|notes|peers)\b|\b(DESIGN|INTERFACE)\.md\b"
)


def _repo_files() -> list[str]:
    git = require_tool("git")
    out = subprocess.run(
        [git, "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def test_no_file_points_outside_the_repository() -> None:
    offenders = []
    for rel in _repo_files():
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binary files
        for n, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert offenders == []


@pytest.fixture(scope="module")
def lone_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # <tmp>/alone/meshgate: the clone's parent holds nothing else
    dest = tmp_path_factory.mktemp("alone") / "meshgate"
    for rel in _repo_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["meshgate"]
    return dest


def _pytest_in(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(clone))  # the clone's own meshgate and tests
    env.pop("MESHGATE_VECTORS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600,
    )


def test_a_lone_clone_collects_every_test(lone_clone: Path) -> None:
    run = _pytest_in(lone_clone, "--collect-only", "tests")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.splitlines()[-1].lower()


def test_a_lone_clone_passes_the_tests_that_read_files(lone_clone: Path) -> None:
    # the published vectors and the shipped example configs
    run = _pytest_in(
        lone_clone,
        "tests/unit/test_mesh_noise.py", "tests/unit/test_odoh_vectors.py",
        "tests/unit/test_dns_wire.py", "tests/unit/test_examples.py",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
