"""Every shipped example config passes validation."""

from pathlib import Path

import pytest

from meshgate.config import load

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.toml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the demo configs take their secret from the environment (compose env_file)
    monkeypatch.setenv("MESHGATE_SECRET", "example-secret")
    load(path)
