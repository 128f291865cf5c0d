"""The simulator runs on virtual time or not at all: ``simulate`` refuses a real-clock
loop instead of running the modelled cluster in real time, and ``run_simulation`` gives
it a virtual-time loop from synchronous code or, through a worker thread, from a loop."""

import asyncio
import time

import anyio.to_thread
import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.errors import SimError
from dynarl.sim.run import run_simulation, simulate


def tiny() -> SimulatedRun:
    """The default 4-device job, 2 iterations: a few simulated seconds."""
    return simulated_run(DynaRLConfig(), ["run.num_iterations=2"])


@pytest.mark.timeout(10)
async def test_simulate_refuses_a_real_clock_loop_at_once() -> None:
    """On the test's own (real-clock) loop it raises before simulating anything, and
    the message names the virtual-time ways to run it."""
    started = time.perf_counter()
    with pytest.raises(SimError, match="VirtualTimeLoop") as info:
        await simulate(tiny())
    assert time.perf_counter() - started < 1.0
    assert "run_simulation" in str(info.value)
    assert "to_thread" in str(info.value)


def test_run_simulation_runs_on_virtual_time_from_sync_code() -> None:
    """Simulated seconds pass faster than wall seconds, and it is the same simulation as
    ``simulate`` on a ``VirtualTimeLoop`` of one's own."""
    result, recorder = run_simulation(tiny(), name="tiny")
    assert len(result.iterations) == 2
    assert result.generated_tokens == result.requested_tokens > 0
    assert result.iterations[-1].end_s > result.wall_s
    assert recorder.run == "tiny"
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        expected, _ = runner.run(simulate(tiny()))
    assert result.iterations == expected.iterations


async def test_run_simulation_inside_a_running_loop_says_to_use_a_worker_thread() -> None:
    with pytest.raises(SimError, match=r"anyio\.to_thread\.run_sync\(run_simulation, run\)"):
        run_simulation(tiny())


async def test_run_simulation_in_a_worker_thread_works_from_a_running_loop() -> None:
    """The notebook way: the cell's loop stays free while the thread simulates."""
    result, _ = await anyio.to_thread.run_sync(run_simulation, tiny())
    assert len(result.iterations) == 2
    assert result.generated_tokens == result.requested_tokens > 0
