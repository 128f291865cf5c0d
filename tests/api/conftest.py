"""Real runs more than one test module reads: made once a session, on worker
processes, by the CLI as a user would."""

import subprocess
import sys
from pathlib import Path

import pytest

from .test_facade import SMALL

CLI = [sys.executable, "-m", "dynarl.cli", "run", "--quiet"]
"""``dynarl run`` with one plain line per iteration."""


def sets(*overrides: str) -> list[str]:
    """``--set`` arguments of ``overrides``."""
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.fixture(scope="session")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 3-iteration run (checkpoints after each), by the CLI."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("whole") / "run"
    args = sets(*SMALL, "run.num_iterations=3", "run.checkpoint_every=1")
    subprocess.run([*CLI, "--out", str(out), *args], check=True, capture_output=True, timeout=240)
    return out
