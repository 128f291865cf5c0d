"""The worker lifecycle state machine: allowed paths work, forbidden ones are refused
in words, and terminal states stay terminal."""

import pytest

from dynarl.workers.errors import LifecycleError
from dynarl.workers.lifecycle import TRANSITIONS, Lifecycle


def test_a_slot_moves_between_roles_through_released() -> None:
    life = Lifecycle("slot-0")
    for state in ("ready", "active", "draining", "released", "active", "released", "active"):
        life.to(state)  # type: ignore[arg-type]
    life.to("stopped")
    assert life.history == [
        "starting",
        "ready",
        "active",
        "draining",
        "released",
        "active",
        "released",
        "active",
        "stopped",
    ]


def test_a_forbidden_transition_names_the_state_and_the_next_step() -> None:
    life = Lifecycle("slot-3", "ready")
    with pytest.raises(LifecycleError, match=r"slot-3 cannot go from ready to released.*role"):
        life.to("released")
    assert life.state == "ready"
    with pytest.raises(LifecycleError, match=r"cannot generate while ready .*must be active"):
        life.require("active", action="generate")


def test_failed_and_stopped_are_terminal() -> None:
    life = Lifecycle("slot-1", "active")
    life.to("failed")
    for state in ("ready", "active", "draining", "released"):
        assert not life.can(state)  # type: ignore[arg-type]
        with pytest.raises(LifecycleError, match="launch another"):
            life.to(state)  # type: ignore[arg-type]
    life.to("stopped")
    assert TRANSITIONS["stopped"] == frozenset()
    with pytest.raises(LifecycleError):
        life.to("failed")


def test_every_state_can_fail_or_stop() -> None:
    for state, targets in TRANSITIONS.items():
        if state != "stopped":
            assert "stopped" in targets
        if state not in ("failed", "stopped"):
            assert "failed" in targets
