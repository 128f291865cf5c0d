"""Fixtures for the data-plane tests: transport ends of every kind."""

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .helpers import Net


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (ipc socket paths are limited to ~100
    characters)."""
    path = Path(tempfile.mkdtemp(prefix="dyn-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["inproc", "zmq-tcp", "zmq-ipc"])
async def net(request: pytest.FixtureRequest, short_tmp: Path) -> AsyncIterator[Net]:
    """Transport ends of every kind."""
    n = Net(request.param, short_tmp)
    yield n
    await n.aclose()


@pytest.fixture
async def inproc(short_tmp: Path) -> AsyncIterator[Net]:
    """In-process transport ends only (fast router tests)."""
    n = Net("inproc", short_tmp)
    yield n
    await n.aclose()
