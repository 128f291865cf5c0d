"""The task that owns a run's long-lived tasks (the router, the controller, the
workers' watchers), apart from whoever opened the run.

A run is opened in one task and may be used and closed in others: a notebook runs each
cell as its own task, so ``await stack.enter_async_context(DynaRL(cfg))`` in one cell
and ``await stack.aclose()`` in a later one enter and leave the run in different tasks.
Cancel scopes (and the task groups that hold them) must be left by the task that
entered them, so the run's own scopes live in one host task that the run owns:
:meth:`RunHost.start` starts it and waits until the run is open, :meth:`RunHost.stop`
asks it to close the run and waits until it has. The host task is the run's, never a
caller's: it is awaited on close, and a failure in it (the controller crashed) cancels
every call in progress (:meth:`RunHost.call`), which then raises that failure.

This needs the asyncio backend (a task of the loop's own); dynarl runs on asyncio.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

import anyio

from dynarl.core.errors import DynaRLError

logger = logging.getLogger(__name__)

Opener = Callable[[contextlib.AsyncExitStack], Awaitable[None]]


class RunFailedError(DynaRLError):
    """The run's own tasks failed (the controller or the data router raised); the
    run is closed. The cause is chained."""


class RunHost:
    """A run's host task: see the module docstring."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._stop: anyio.Event | None = None
        self._calls: set[anyio.CancelScope] = set()
        self.failure: BaseException | None = None
        """Why the host task ended before it was asked to (``None`` while it runs)."""

    @property
    def running(self) -> bool:
        """Whether the run is open and its tasks run."""
        return self._task is not None and not self._task.done()

    async def start(self, open_run: Opener) -> None:
        """Start the host task, which opens the run with ``open_run`` (entering every
        context it needs on the stack it is given), and wait until it is open. If
        opening fails, what was opened is closed and the error is raised here."""
        if self._task is not None:
            raise DynaRLError("this run is already open; use a new DynaRL object")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise DynaRLError("DynaRL runs on the asyncio backend of anyio") from None
        opened = anyio.Event()
        self._stop = anyio.Event()
        self._task = loop.create_task(self._main(open_run, opened, self._stop))
        ended = anyio.Event()
        self._task.add_done_callback(lambda _: ended.set())
        try:
            async with anyio.create_task_group() as tg:

                async def until(event: anyio.Event) -> None:
                    await event.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(until, opened)
                tg.start_soon(until, ended)
        except BaseException:  # the caller was cancelled: close what opens
            self._stop.set()
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._join()
            raise
        if not opened.is_set():
            await self._join()  # raises what opening raised

    async def stop(self) -> None:
        """Close the run (its contexts leave in reverse order, in the host task) and
        wait until it is closed, also when the caller is cancelled; raises
        :class:`RunFailedError` if the host task had failed."""
        if self._task is None or self._stop is None:
            return
        self._stop.set()
        with anyio.CancelScope(shield=True):
            await self._join()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Scope of a call into the open run (an iteration, a checkpoint): if the run's
        tasks fail meanwhile, the call is cancelled and raises
        :class:`RunFailedError`."""
        if not self.running:
            raise self._closed_error()
        with anyio.CancelScope() as scope:
            self._calls.add(scope)
            try:
                yield
            finally:
                self._calls.discard(scope)
        if scope.cancelled_caught and self.failure is not None:
            raise self._closed_error()

    async def _main(self, open_run: Opener, opened: anyio.Event, stop: anyio.Event) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                await open_run(stack)
                opened.set()
                await stop.wait()
        except BaseException as error:
            if opened.is_set():
                logger.error("the run's tasks failed: %r", error)
                self.failure = error
            for scope in list(self._calls):
                scope.cancel()
            raise

    async def _join(self) -> None:
        assert self._task is not None
        task = self._task
        try:
            await task
        except BaseException:
            if self.failure is None:
                raise  # opening failed, or this caller was cancelled
        finally:
            self._task = None
        if self.failure is not None:
            raise self._closed_error()

    def _closed_error(self) -> DynaRLError:
        if self.failure is None:
            return DynaRLError("the run is not open; use `async with DynaRL(cfg) as rl:`")
        error = RunFailedError(f"the run failed and is closed: {self.failure!r}")
        error.__cause__ = self.failure
        return error
