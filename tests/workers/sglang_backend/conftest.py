"""Fixtures of the SGLang adapter's tests: fake SGLang servers (real HTTP on loopback,
backed by the torch engine) and adapters attached to them."""

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from dynarl.testing.fake_sglang import FakeSGLang  # noqa: E402
from dynarl.workers.config import ModelConfig, RolloutConfig  # noqa: E402
from dynarl.workers.sglang.backend import connect  # noqa: E402
from dynarl.workers.sglang.config import SGLangConfig  # noqa: E402
from dynarl.workers.sglang.rollout import SGLangRollout  # noqa: E402

MODEL = ModelConfig(max_seq_len=128)


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.asynccontextmanager
async def running(fake: FakeSGLang, **config: Any) -> AsyncIterator[SGLangRollout]:
    """An adapter attached to ``fake``, running (``order`` and ``max_running_requests``
    as the rollout section's, the rest of ``config`` as ``rollout.sglang``'s)."""
    order = config.pop("order", "fifo")
    batch = config.pop("max_running_requests", RolloutConfig().max_running_requests)
    section = SGLangConfig(urls=(fake.url,), **config)
    engine = await anyio.to_thread.run_sync(
        lambda: connect(
            section, url=fake.url, name="slot-0", max_running_requests=batch, order=order
        )
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        try:
            yield engine
        finally:
            tg.cancel_scope.cancel()


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(MODEL) as server:
        yield server


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait until ``condition()`` holds, checking every 5 ms: the engine's progress
    mid-stream (tokens so far) signals no event a test could wait on."""
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await anyio.sleep(0.005)
    raise TimeoutError("the condition did not hold in time")


def cmdline(pid: str) -> str:
    """Process ``pid``'s command line, its words joined by spaces ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def servers_on(*ports: int) -> list[str]:
    """Ids of fake servers still running on any of ``ports``."""
    flags = [f"--port {port} " for port in ports]
    return [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit()
        and "fake_sglang" in (line := cmdline(pid) + " ")
        and any(flag in line for flag in flags)
    ]
