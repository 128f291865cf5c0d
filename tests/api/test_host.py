"""A run's host task: the run's own task groups are entered and left in a task of the
run's, so the caller may open it in one task and close it in another (a notebook's
cells); a failure of the run's tasks cancels the calls in progress."""

import asyncio
import contextlib

import anyio
import pytest

from dynarl.api.host import RunFailedError, RunHost


async def test_a_run_opened_in_one_task_is_closed_in_another() -> None:
    host = RunHost()
    closed = []

    async def open_run(stack: contextlib.AsyncExitStack) -> None:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        stack.callback(closed.append, "closed")
        tg.start_soon(anyio.sleep_forever)

    # Two tasks, as two notebook cells are: one opens, the other closes.
    await asyncio.get_running_loop().create_task(host.start(open_run))
    assert host.running
    await asyncio.get_running_loop().create_task(host.stop())
    assert closed == ["closed"] and not host.running


async def test_a_failure_of_the_runs_tasks_cancels_the_call_in_progress() -> None:
    host = RunHost()
    fail = anyio.Event()

    async def crash() -> None:
        await fail.wait()
        raise RuntimeError("the controller crashed")

    async def open_run(stack: contextlib.AsyncExitStack) -> None:
        tg = await stack.enter_async_context(anyio.create_task_group())
        tg.start_soon(crash)

    await host.start(open_run)
    with (
        pytest.raises(RunFailedError, match="controller crashed"),
        anyio.fail_after(5),
        host.call(),
    ):
        fail.set()
        await anyio.sleep_forever()
    assert not host.running
    with pytest.raises(RunFailedError):
        await host.stop()
    with pytest.raises(RunFailedError), host.call():
        pass


async def test_a_failure_while_opening_is_raised_and_what_opened_is_closed() -> None:
    host = RunHost()
    closed = []

    async def open_run(stack: contextlib.AsyncExitStack) -> None:
        stack.callback(closed.append, "closed")
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):
        await host.start(open_run)
    assert closed == ["closed"] and not host.running
