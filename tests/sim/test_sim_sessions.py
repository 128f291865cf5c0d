"""Agentic rollout in the simulator: sessions out on tool calls come back for more
turns, and the dynamic scheduler keeps the engine slots they come back to."""

import asyncio

import pytest
from recipes.paper import paper_setting

from dynarl.control import events as ev
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.obs.timeline import Interval
from dynarl.sim.config import simulated_run
from dynarl.sim.run import simulate


@pytest.mark.slow
def test_the_rollout_keeps_slots_for_its_sessions_while_they_are_out_on_tools() -> None:
    """Long tool calls and short turns: most sessions are out on a tool at any time.
    Counted as no load, they let the scheduler shrink the rollout below the slots its
    sessions need (before: 21 engines x 8 slots for 188 sessions, 164 of them out on
    a tool, 4 s into the iteration)."""
    cfg = paper_setting("agentic", "1.5b", 64, mode="dynamic", num_iterations=1)
    cfg = simulated_run(
        cfg,
        [
            "algorithm.num_prompts=16",
            "rollout.max_running_requests=8",
            "sim.tool_mean_s=3.0",
            "sim.tool_timeout_s=10",
            "sim.first_turn_median_tokens=300",
            "sim.warmup_iterations=0",
        ],
    )
    slots = cfg.job.rollout.max_running_requests
    engines0 = cfg.job.rollout.initial_devices // cfg.job.rollout.tp
    # (time, sessions pending, sessions out on a tool), after every change
    states: list[tuple[float, int, int]] = []
    pending = in_tool = 0

    def on_event(event: ev.Event) -> None:
        nonlocal pending, in_tool
        if isinstance(event, ev.ItemsEnqueued) and event.edge == "prompts":
            pending += len(event.items)
        elif isinstance(event, ev.ItemCompleted) and event.edge == "prompts":
            pending -= 1
        elif isinstance(event, ev.ToolCallStarted):
            in_tool += 1
        elif isinstance(event, (ev.ToolCallFinished)):
            in_tool -= 1
        else:
            return
        states.append((event.time_s, pending, in_tool))

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        _, timeline = runner.run(simulate(cfg, on_event=on_event))
    rollout = [
        line
        for line in timeline.lines()
        if isinstance(line, Interval) and line.component == "rollout"
    ]
    assert max(n for _, _, n in states) > 0.5 * 256  # most sessions out on a tool at once
    short = []
    for t, waiting, out in states:
        if not out:
            continue
        devices = sum(1 for i in rollout if i.start_s <= t < i.end_s)
        engines = devices // cfg.job.rollout.tp
        if engines * slots < min(waiting, engines0 * slots):
            short.append((t, engines, waiting, out))
    assert not short, short[:3]
