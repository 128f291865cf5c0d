"""How often a run starts a dead worker's process again: a restart budget with
back-off, so that a worker that keeps dying does not loop forever.

The world starts a dead slot or trainer worker again when a move needs its device (the
reboot of a crashed device, see :mod:`dynarl.api.executor`). Each worker may be
restarted at most :attr:`RestartBudget.max_restarts` times over the run, and each
restart after its first waits a back-off after the previous one (``backoff_s``,
doubling). A restart the budget refuses raises
:class:`~dynarl.workers.errors.LaunchError`: the move that needed it fails, and the
controller retries it after its own back-off (when the worker's back-off has passed,
or never once its restarts are spent).
"""

import collections
import logging
import time
from collections.abc import Callable

from dynarl.workers.errors import LaunchError

logger = logging.getLogger(__name__)


class RestartBudget:
    """The restarts a run's workers may still take, and those they took.

    Args:
        max_restarts: restarts of one worker over the run.
        backoff_s: the least time between a worker's first and second restart
            (doubled for each later one).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        *,
        max_restarts: int = 3,
        backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self._clock = clock
        self._restarts: dict[str, list[float]] = collections.defaultdict(list)
        self._recent: collections.Counter[str] = collections.Counter()

    def restarts(self, name: str) -> int:
        """How many times worker ``name`` was restarted."""
        return len(self._restarts.get(name, ()))

    def take(self, name: str, *, kind: str) -> None:
        """Count a restart of worker ``name`` (of ``kind``: ``slot``, ``trainer``),
        or raise :class:`LaunchError` if its budget is spent or its back-off has not
        passed."""
        now = self._clock()
        done = self._restarts[name]
        if len(done) >= self.max_restarts:
            raise LaunchError(
                f"{kind} worker {name} died after {len(done)} restarts; it is not "
                f"restarted again (at most {self.max_restarts}), its device stays unused"
            )
        if done:
            ready = done[-1] + self.backoff_s * 2 ** (len(done) - 1)
            if now < ready:
                raise LaunchError(
                    f"{kind} worker {name} died again {now - done[-1]:.1f} s after its "
                    f"restart; the next one waits {ready - now:.1f} s more (back-off)"
                )
        done.append(now)
        self._recent[kind] += 1
        logger.warning(
            "restarting %s worker %s (restart %d of at most %d)",
            kind,
            name,
            len(done),
            self.max_restarts,
        )

    def taken(self) -> dict[str, int]:
        """Restarts by kind since the previous call (for an iteration's metrics)."""
        recent, self._recent = dict(self._recent), collections.Counter()
        return recent
