"""A task group whose lone failure surfaces as itself.

anyio wraps every error that leaves a task group in an ``ExceptionGroup``, including an
exception raised by the body of an ``async with`` that runs inside one. Our context
managers (the router, the worker link) run the caller's block inside their task group,
so a ``PeerLostError`` raised in that block would reach the caller wrapped; this
unwraps a group holding exactly one exception.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc


@asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """``anyio.create_task_group()``, re-raising a lone exception unwrapped."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
