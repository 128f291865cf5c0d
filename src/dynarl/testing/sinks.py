"""A request sink for tests of rollout engines: it keeps every outcome it hears of
(completions, requests handed back with their partial output, failures) and lets a
test wait until a condition on them holds, woken at each arrival."""

from collections.abc import Callable

import anyio

from dynarl.workers.rollout import Completion, GenerateRequest


class RecordingSink:
    """A :class:`~dynarl.workers.rollout.RequestSink` that records.

    Args:
        raise_on_fail: make :meth:`fail` raise (a test that expects no failure fails
            at once) instead of recording the error in :attr:`failures`.
    """

    def __init__(self, *, raise_on_fail: bool = False) -> None:
        self.completions: dict[str, Completion] = {}
        """Finished requests by id, in the order they finished."""
        self.taken: dict[str, GenerateRequest] = {}
        """Requests handed back (aborted) with their partial output, by id."""
        self.failures: list[Exception] = []
        """Errors the engine failed the sink with."""
        self._raise_on_fail = raise_on_fail
        self._changed = anyio.Event()

    def done(self, completion: Completion) -> None:
        """Record a completion (a request completing twice is an engine's bug)."""
        assert completion.request_id not in self.completions, "completed twice"
        self.completions[completion.request_id] = completion
        self._changed.set()

    def aborted(self, request: GenerateRequest) -> None:
        """Record a request handed back."""
        self.taken[request.request_id] = request
        self._changed.set()

    async def flush(self) -> None:
        """Nothing buffered: a checkpoint only."""
        await anyio.lowlevel.checkpoint()

    async def fail(self, error: Exception) -> None:
        """Record ``error``, or raise it with ``raise_on_fail``."""
        if self._raise_on_fail:
            raise AssertionError(f"a sink failed: {error}") from error
        self.failures.append(error)
        self._changed.set()

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Wait until ``condition()`` holds (checked at every arrival).

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        with anyio.fail_after(timeout_s):
            while not condition():
                self._changed = anyio.Event()
                await self._changed.wait()
