"""The simulator carries out the dynamic mode's tail rebalancing faithfully."""

import asyncio

from small_cluster import SIXTEEN_DEVICES

from dynarl.api.config import DynaRLConfig
from dynarl.control import events as ev
from dynarl.control.plan import Migration
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.config import SimulatedRun, simulated_run
from dynarl.sim.run import simulate


def skewed_small() -> SimulatedRun:
    """10 rollout engines, 32 requests each at most, 28K-token responses: 20 groups of 16 leave
    whole groups of similar length on one engine."""
    return simulated_run(
        DynaRLConfig(),
        [
            *SIXTEEN_DEVICES,
            "rollout.max_running_requests=32",
            "rollout.max_new_tokens=28672",
            "algorithm.num_prompts=20",
            "algorithm.group_size=16",
            "algorithm.n_minibatches=4",
            "run.num_iterations=2",
        ],
    )


def test_spreading_hot_engines_keeps_every_token_and_restarts_them_in_place() -> None:
    spreads: list[Migration] = []

    def on_event(event: ev.Event) -> None:
        m = event.migration if isinstance(event, ev.MigrationStarted) else None
        if m is not None and (m.src, m.dst) == ("rollout", "rollout"):
            spreads.append(m)

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(skewed_small(), check=True, on_event=on_event))
    assert spreads, "no hot engine was spread"
    for m in spreads:
        assert {d for s in m.create for d in s.devices} == set(m.devices)
        assert m.reassign and {t for _, t in m.reassign}.isdisjoint(m.drain)
    # Aborted requests resume elsewhere with their partial output: nothing is lost or
    # generated twice, and the engines agree.
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert result.events_rejected == {}
