"""The lifecycle of a worker process (a device slot): its states and the transitions
between them.

::

    starting ──▶ ready ──▶ active ◀──▶ draining
                             ▲  │          │
                             │  ▼          ▼
                             released ◀────┘
    (any state but stopped) ──▶ failed;   (any state) ──▶ stopped

- ``starting``: the process is starting (importing, connecting); not yet said hello.
- ``ready``: connected, holds no role.
- ``active``: serving a role (a rollout engine or an inference worker) with its
  memory held.
- ``draining``: takes no new work and finishes or hands back what it holds (a
  migration is taking its device away); it becomes ``active`` again if the migration
  fails.
- ``released``: its role's device memory is released; the process stays, ready to
  resume that role or assume another without a restart.
- ``failed``: something broke (its role could not be built, a step raised, the process
  died); it serves nothing more.
- ``stopped``: it shut down.

A forbidden transition raises :class:`~dynarl.workers.errors.LifecycleError`.
"""

from collections.abc import Mapping
from typing import Final, Literal

from dynarl.workers.errors import LifecycleError

LifecycleState = Literal["starting", "ready", "active", "draining", "released", "failed", "stopped"]
"""Where a worker process is in its lifecycle."""

TRANSITIONS: Final[Mapping[LifecycleState, frozenset[LifecycleState]]] = {
    "starting": frozenset({"ready", "failed", "stopped"}),
    "ready": frozenset({"active", "failed", "stopped"}),
    "active": frozenset({"draining", "released", "failed", "stopped"}),
    "draining": frozenset({"active", "released", "failed", "stopped"}),
    "released": frozenset({"active", "failed", "stopped"}),
    "failed": frozenset({"stopped"}),
    "stopped": frozenset(),
}
"""The states each state may move to."""

_NEXT_STEP: Final[Mapping[LifecycleState, str]] = {
    "starting": "wait until it has said hello",
    "ready": "give it a role first (assume_role)",
    "active": "drain it or release its memory first",
    "draining": "abort or finish its requests, then release its memory",
    "released": "resume its memory or give it a role first",
    "failed": "shut it down and launch another",
    "stopped": "launch another",
}


class Lifecycle:
    """One worker's lifecycle state, moved only along :data:`TRANSITIONS`.

    Args:
        name: the worker, for error messages (e.g. ``"slot-0"``).
        state: the initial state.
    """

    def __init__(self, name: str, state: LifecycleState = "starting") -> None:
        self.name = name
        self._state: LifecycleState = state
        self.history: list[LifecycleState] = [state]
        """Every state it has been in, in order."""

    @property
    def state(self) -> LifecycleState:
        """The current state."""
        return self._state

    def can(self, new: LifecycleState) -> bool:
        """Whether moving to ``new`` is allowed now (staying put always is)."""
        return new == self._state or new in TRANSITIONS[self._state]

    def to(self, new: LifecycleState) -> None:
        """Move to ``new`` (a no-op if already there).

        Raises :class:`LifecycleError` if the transition is forbidden.
        """
        if new == self._state:
            return
        if new not in TRANSITIONS[self._state]:
            allowed = ", ".join(sorted(TRANSITIONS[self._state])) or "nothing"
            raise LifecycleError(
                f"{self.name} cannot go from {self._state} to {new} (from {self._state} it "
                f"may go to: {allowed}); {_NEXT_STEP[self._state]}"
            )
        self._state = new
        self.history.append(new)

    def require(self, *states: LifecycleState, action: str) -> None:
        """Raise :class:`LifecycleError` unless the state is one of ``states``; the
        message says that ``action`` needs one of them and what to do."""
        if self._state not in states:
            raise LifecycleError(
                f"{self.name} cannot {action} while {self._state} (it must be "
                f"{' or '.join(states)}); {_NEXT_STEP[self._state]}"
            )
