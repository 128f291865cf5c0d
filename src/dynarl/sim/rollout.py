"""A rollout on a fixed set of modelled engines, no controller: the static baseline.

Whole groups go to the engine with the fewest requests so far (as the reference
system's router does); a multi-turn request runs its tool calls off the devices and
returns for its next turn to the engine holding its prefix. Events are processed in
global time order, each engine advancing only when it has an event, so a rollout of
thousands of sequences on tens of engines costs a few thousand engine events.
"""

import heapq
import math
from collections.abc import Sequence

import msgspec

from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.sim.engine import SimEngine
from dynarl.sim.jobs import Job


class RolloutResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a rollout did: when each request finished, its last engine's index, the
    tokens generated, tool calls made and the time the last request finished."""

    finish_s: dict[ItemId, float]
    engine_of: dict[ItemId, int]
    generated_tokens: int
    num_tool_calls: int
    makespan_s: float


def turn_job(request: Request, turn: int) -> Job:
    """The job of ``request``'s turn ``turn``: its context is the prompt plus every
    earlier turn's output and tool output."""
    context = (
        request.prompt_tokens
        + sum(request.output_tokens[:turn])
        + sum(request.tool_output_tokens[:turn])
    )
    return Job(
        id=request.id,
        group=request.group,
        context_tokens=context,
        output_tokens=request.output_tokens[turn],
        tool_call_after=turn < request.num_tool_calls,
    )


def assign_groups(requests: Sequence[Request], num_engines: int) -> list[int]:
    """Engine index per request: whole groups, largest first, each to the engine with
    the fewest requests so far (ties to the lowest index)."""
    groups: dict[GroupId, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(request.group, []).append(i)
    load = [(0, e) for e in range(num_engines)]
    heapq.heapify(load)
    out = [0] * len(requests)
    for members in sorted(groups.values(), key=len, reverse=True):
        count, engine = heapq.heappop(load)
        for i in members:
            out[i] = engine
        heapq.heappush(load, (count + len(members), engine))
    return out


def run_static_rollout(
    requests: Sequence[Request], engines: Sequence[SimEngine], *, start_s: float = 0.0
) -> RolloutResult:
    """Run ``requests`` to completion on ``engines`` (all at ``start_s``)."""
    home = assign_groups(requests, len(engines))
    index = {r.id: i for i, r in enumerate(requests)}
    turn = [0] * len(requests)
    for e, engine in enumerate(engines):
        engine.advance_to(start_s)
        engine.submit([turn_job(requests[i], 0) for i in range(len(requests)) if home[i] == e])
    # (next event time, engine); an engine's stale entries are skipped on pop
    events = [(engine.next_event_time(), e) for e, engine in enumerate(engines)]
    heapq.heapify(events)
    tools: list[tuple[float, int]] = []  # (return time, request index)
    finish: dict[ItemId, float] = {}
    generated = calls = 0
    while True:
        while events and events[0][0] != engines[events[0][1]].next_event_time():
            heapq.heappop(events)
        event_s = events[0][0] if events else math.inf
        tool_s = tools[0][0] if tools else math.inf
        if tool_s < event_s:
            _, i = heapq.heappop(tools)
            e = home[i]
            engines[e].advance_to(tool_s)
            engines[e].submit([turn_job(requests[i], turn[i])])
        elif event_s < math.inf:
            _, e = heapq.heappop(events)
            for done in engines[e].advance_to(event_s):
                i = index[done.id]
                generated += done.generated_tokens
                if done.tool_call:
                    calls += 1
                    heapq.heappush(tools, (done.time_s + requests[i].tool_latency_s[turn[i]], i))
                    turn[i] += 1
                else:
                    finish[done.id] = done.time_s
        else:
            break
        heapq.heappush(events, (engines[e].next_event_time(), e))
    return RolloutResult(
        finish_s=finish,
        engine_of={r.id: home[i] for i, r in enumerate(requests)},
        generated_tokens=generated,
        num_tool_calls=calls,
        makespan_s=max(finish.values(), default=start_s) - start_s,
    )
