"""The restart budget: a worker that keeps dying is restarted a bounded number of
times, each restart after the first waiting a doubling back-off."""

import pytest

from dynarl.api.restarts import RestartBudget
from dynarl.workers.errors import LaunchError


def test_a_worker_is_restarted_at_most_max_restarts_times_with_backoff() -> None:
    now = [0.0]
    budget = RestartBudget(max_restarts=3, backoff_s=5.0, clock=lambda: now[0])
    budget.take("trainer-1", kind="trainer")
    now[0] = 4.0
    with pytest.raises(LaunchError, match="back-off"):
        budget.take("trainer-1", kind="trainer")  # 5 s after the first
    budget.take("slot-2", kind="slot")  # another worker's budget is its own
    now[0] = 5.0
    budget.take("trainer-1", kind="trainer")
    now[0] = 14.0
    with pytest.raises(LaunchError, match="back-off"):
        budget.take("trainer-1", kind="trainer")  # 10 s after the second
    now[0] = 15.0
    budget.take("trainer-1", kind="trainer")
    now[0] = 1000.0
    with pytest.raises(LaunchError, match="at most 3"):
        budget.take("trainer-1", kind="trainer")
    assert budget.restarts("trainer-1") == 3
    assert budget.taken() == {"trainer": 3, "slot": 1}
    assert budget.taken() == {}  # counted once, for one iteration's metrics
