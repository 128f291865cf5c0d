"""The rollout's engines regrouped into wider ones for the tail (``rollout.tail_tp``),
simulated end to end: the wide engines decode what the narrow ones held, no token is
lost or generated twice, and the next iteration starts at the size the predictor
picks: ``rollout.tp`` while requests wait for a slot, the tail's where every request
has one."""

from test_sim_world import run, small

from dynarl.control import events as ev
from dynarl.control.topology import ROLLOUT
from dynarl.sim.config import simulated_run

# 7B engines of two devices, regrouped into four: a step's weights read is most of a
# thin batch's time there
MODEL = ("sim.model=R1-Distill-Qwen-7B", "rollout.tp=2", "rollout.tail_tp=4")


def run_7b(*extra: str) -> tuple[list[ev.MigrationStarted], list[float]]:
    """A dynamic run of the 7B model (``small``'s cluster, responses up to 16K tokens):
    the migrations that started rollout instances, and when each iteration started."""
    starts: list[ev.MigrationStarted] = []
    iterations: list[float] = []

    def watch(event: ev.Event) -> None:
        if isinstance(event, ev.MigrationStarted) and event.migration.dst == ROLLOUT:
            starts.append(event)
        elif isinstance(event, ev.IterationStarted):
            iterations.append(event.time_s)

    cfg = small(16, "scheduler.mode=dynamic", *MODEL, "rollout.max_new_tokens=16384", *extra)
    result, _ = run(cfg, on_event=watch)
    assert result.generated_tokens == result.requested_tokens == result.engine_tokens
    assert result.events_rejected == {}
    return starts, iterations


def test_a_dynamic_run_regroups_its_tail_and_starts_the_next_iteration_narrow() -> None:
    starts, iterations = run_7b()
    regroups = [e for e in starts if e.migration.unit == 4]
    assert len(regroups) == 2, "a regroup in each iteration"
    for e in regroups:
        m = e.migration
        assert m.src == m.dst == ROLLOUT and all(len(s.devices) == 4 for s in m.create)
    # With 32 slots an engine, the waves of a narrow rollout end sooner: the next
    # iteration's rollout starts on engines of two devices.
    for start in iterations[1:]:
        first = next(e for e in starts if e.time_s >= start and e.migration.create)
        assert {len(s.devices) for s in first.migration.create} == {2}


def test_where_every_request_has_a_slot_the_next_iteration_starts_wide() -> None:
    # The whole batch at once, at either size.
    starts, iterations = run_7b("rollout.max_running_requests=256")
    (start,) = iterations[1:]
    first = next(e.migration for e in starts if e.time_s >= start and e.migration.create)
    # The borrow itself makes them wide: no engine of two devices, no second restart.
    assert first.src != ROLLOUT and first.unit == 4
    assert all(len(s.devices) == 4 for s in first.create)
    assert not [e for e in starts if e.time_s >= start and e.migration.src == ROLLOUT]


def test_the_static_modes_keep_their_engines_size() -> None:
    resized: list[ev.MigrationStarted] = []

    def watch(event: ev.Event) -> None:
        if isinstance(event, ev.MigrationStarted) and event.migration.unit:
            resized.append(event)

    for mode in ("static-colocated", "static-disaggregated", "rlhfuse"):
        cfg = simulated_run(small(16, f"scheduler.mode={mode}"), ["rollout.tail_tp=2"])
        result, _ = run(cfg, on_event=watch)
        assert result.generated_tokens == result.requested_tokens
    assert not resized
