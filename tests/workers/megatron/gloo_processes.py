"""Run a test's worker function in ``world`` spawned processes that meet at one free
loopback port (a gloo world of their own) and gather what they report."""

import multiprocessing
import queue
from collections.abc import Callable
from typing import Any

import pytest

from dynarl.testing.ports import free_port


def gather_from_workers(
    worker: Callable[..., None],
    *,
    world: int,
    expected: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Start ``worker(w, port, *args, results)`` for ``w`` in ``range(world)`` and
    return the first ``expected`` ``(name, value)`` pairs they put on ``results``, by
    name; fails the test if they stop reporting for ``timeout_s``."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=worker, args=(w, port, *args, results)) for w in range(world)
    ]
    for p in processes:
        p.start()
    got: dict[str, Any] = {}
    try:
        while len(got) < expected:
            name, out = results.get(timeout=timeout_s)
            got[name] = out
    except queue.Empty:
        pytest.fail(f"the workers reported only {sorted(got)}")
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got
