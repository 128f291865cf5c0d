"""Scoring placements: the predicted remaining time of the current iteration.

A component's remaining work is what it still has to do this iteration: its own pending
items plus what its predecessors have not yet handed it (items flow through every
stage). Rollout work is measured in tokens it still generates (pending requests times
their expected remaining length; a session out on a tool call counts as the chance it
comes back for another turn: :func:`~dynarl.control.rollout_lengths.returning_sessions`);
the other stages' in the tokens of the samples they score or train (what a sample costs
them grows with its length: a trainer's minibatch of long responses takes many times
one of short ones), or in items when the items carry no
sizes (:meth:`~dynarl.control.hypergraph.Hypergraph.item_work`). Its finish time is the
later of "all its work at its predicted throughput" and "its last input arrives, plus
the time to process one chunk of it" -- or, if sooner, "its last input arrives, then its
predecessors' devices join it (after a migration) for the work left": devices flow
downstream as stages finish. The iteration's remaining time is the latest finish.
The work (:class:`~dynarl.control.demand.Demand`) and the rate devices get through it
(:func:`~dynarl.control.demand.rate`) live in :mod:`dynarl.control.demand`; the
trainer, which works in whole optimizer steps, is played out step by step by
:mod:`dynarl.control.trainer_steps`.

Devices a migration brings arrive only after its cost; a component whose instances
are drained while they hold requests pays the cost too (its requests re-prefill
elsewhere). Both enter :func:`remaining_time` as per-component delays.

A rollout finishes when its slowest engine does: requests do not move between engines
by themselves, so the most loaded engine's queue (``Demand.hottest``) bounds the
remaining time however many devices the others have. A plan that drains engines
holding requests changes those queues: :func:`score_plan` places the moved requests
where the plan sends them (or as the planner would) before scoring.
"""

import heapq
import math
from collections.abc import Iterable, Mapping

from dynarl.control import partial_cut, rollout_lengths
from dynarl.control.demand import Demand, Rates
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import Plan
from dynarl.control.predictor import Predictor
from dynarl.control.reprefill import reprefill_s
from dynarl.control.trainer_steps import actor_finish, steps_in_arrival_order
from dynarl.core.ids import ComponentId, GroupId, InstanceId


def demands(
    graph: Hypergraph, *, per_engine: bool = False, estimates: Estimates | None = None
) -> dict[ComponentId, Demand]:
    """Remaining work of every component on devices (``estimates``: see
    :mod:`~dynarl.control.estimates`).

    With ``per_engine``, a rollout's demand also holds its most loaded engine's work
    (``hottest``), which then bounds its predicted finish (see :func:`rate`). Policies
    that move requests between engines ask for it; device moves are scored without it.
    (That choice dates from a fit whose per-request cost ``b`` the tail's slow windows
    inflated, which made a busy engine's queue look several times slower than it is;
    the fit now weighs relative errors and reads decode steps apart from prefills;
    scoring device moves with it was tried again on 2026-12-07: every reference row
    within the seeds' chaos, so it stays off.)

    The result is shared (with ``estimates``, once per state of the hypergraph): copy
    it before changing it.
    """
    est = or_fresh(estimates)
    plain = est.get(graph, ("demands", False), lambda: _demands(graph, est))
    if not per_engine:
        return plain
    return est.get(graph, ("demands", True), lambda: _with_hottest(graph, plain))


def _with_hottest(
    graph: Hypergraph, plain: Mapping[ComponentId, Demand]
) -> dict[ComponentId, Demand]:
    """``plain`` with each rollout's most loaded engine (its item count)."""
    out = dict(plain)
    for cid, d in plain.items():
        node = graph.components[cid]
        if node.spec.kind == "rollout":
            hottest = max((len(n.items) for n in node.active_instances()), default=0)
            out[cid] = d.with_hottest(hottest)
    return out


def _demands(graph: Hypergraph, est: Estimates) -> dict[ComponentId, Demand]:
    items: dict[ComponentId, float] = {}  # items pending here or upstream
    flow: dict[ComponentId, float] = {}  # their work as samples (``item_work`` units)
    out: dict[ComponentId, Demand] = {}
    for cid in graph.stage_order:
        node = graph.components[cid]
        preds = graph.predecessors[cid]
        upstream = max((items.get(p, 0.0) for p in preds), default=0.0)
        upstream_work = max((flow.get(p, 0.0) for p in preds), default=0.0)
        own = float(graph.pending(cid))
        items[cid] = own + upstream
        total = own + upstream
        kind = node.spec.kind
        if kind == "rollout":
            flow[cid] = rollout_lengths.expected_output_work(graph, cid, est) + upstream_work
            per_item = rollout_lengths.expected_remaining_tokens(graph, cid, est)
            # Requests that need an engine: those at one or waiting for one, and the
            # sessions out on a tool call expected back for another turn.
            in_tool = sum(e.num_in_tool for e in graph.edges_into(cid))
            load = max(own - in_tool, 0.0) + rollout_lengths.returning_sessions(graph, cid)
            cut = partial_cut.rollout_cut(graph, cid, est) if own else None
            if cut is not None:
                # A partial rollout ends with the last group it needs: every request
                # decodes until then, and only the needed groups' samples flow on.
                flow[cid] = (flow[cid] - upstream_work) * cut.share + upstream_work
                flow[cid] += cut.held_samples * cut.sample_work
                items[cid] = own * cut.share + cut.held_samples + upstream
                per_item = cut.work / own
                longest = cut.tokens
            else:
                longest = (
                    rollout_lengths.expected_longest_remaining(graph, cid, est) if own else 0.0
                )
            out[cid] = Demand(
                work=(load + upstream) * per_item,
                load=load,
                tail=0.0,
                upstream=upstream,
                longest=longest,
                per_item=per_item,
                context=rollout_lengths.expected_context(graph, cid) if own else 0.0,
            )
            continue
        work = graph.work_pending(cid) + upstream_work
        flow[cid] = work
        if kind == "actor":
            steps_left = max(node.steps_left, 1)
            steps: tuple[float, ...] = ()
            ready: tuple[float, ...] = ()
            if node.spec.steps_in_arrival_order and graph.sized and steps_left > 1:
                steps, ready = steps_in_arrival_order(graph, cid, steps_left, est)
            running_since = None
            if node.num_in_flight():
                # The step in progress began when the trainer's instances took its
                # samples.
                running_since = min(
                    (n.held_since_s for n in node.active_instances() if n.held_since_s is not None),
                    default=graph.now_s,
                )
            out[cid] = Demand(
                work=work,
                load=total,
                tail=work / steps_left,
                upstream=upstream_work,
                steps=steps,
                ready=ready,
                running_since=running_since,
            )
        else:
            # After its last input arrives, it still processes that input (one item).
            chunk = min(work, work / total) if total else 0.0
            arriving = _arriving(graph, cid, upstream_work, est) if upstream_work > 0 else ()
            out[cid] = Demand(
                work=work, load=total, tail=chunk, upstream=upstream_work, arriving=arriving
            )
    return out


def _arriving(
    graph: Hypergraph, cid: ComponentId, upstream_work: float, est: Estimates
) -> tuple[tuple[float, float], ...]:
    """The work still on its way to ``cid`` from the rollout feeding it, in the order
    the rollout completes it: its pending requests in the equal-count buckets of
    :func:`~dynarl.control.rollout_lengths.completion_order`, each bucket's work its
    share of ``upstream_work`` by its samples' length (prompt and response), arriving
    at the bucket's share of the rollout's remaining time. Empty when ``cid`` is not
    fed by exactly one rollout, no iteration has finished yet, or the rollout is a
    partial one that will end early (:mod:`~dynarl.control.partial_cut`)."""
    rollouts = [p for p in graph.predecessors[cid] if graph.components[p].spec.kind == "rollout"]
    if len(rollouts) != 1 or partial_cut.rollout_cut(graph, rollouts[0], est) is not None:
        return ()  # (a partial rollout's samples arrive as its groups complete)
    order = rollout_lengths.completion_order(graph, rollouts[0], est)
    if order is None:
        return ()
    if graph.sized:
        edges = graph.edges_into(rollouts[0])
        pending = max(graph.pending(rollouts[0]), 1)
        prompt = sum(e.tokens_pending for e in edges) / pending
        sizes = [prompt + length for length in order.length]
    else:
        sizes = [1.0] * len(order.length)
    total = sum(sizes)
    if total <= 0:
        return ()
    return tuple(
        (share, upstream_work * size / total) for share, size in zip(order.time, sizes, strict=True)
    )


def remaining_time(
    graph: Hypergraph,
    predictor: Predictor,
    devices: Mapping[ComponentId, int],
    *,
    delays: Mapping[ComponentId, float] | None = None,
    penalties: Mapping[ComponentId, float] | None = None,
    before: Mapping[ComponentId, int] | None = None,
    demand: Mapping[ComponentId, Demand] | None = None,
    estimates: Estimates | None = None,
    rates: Rates | None = None,
) -> float:
    """Predicted seconds until the iteration's last stage finishes (the latest of
    :func:`finish_times`)."""
    finish = finish_times(
        graph,
        predictor,
        devices,
        delays=delays,
        penalties=penalties,
        before=before,
        demand=demand,
        estimates=estimates,
        rates=rates,
    )
    return max(finish.values(), default=0.0)


def finish_times(
    graph: Hypergraph,
    predictor: Predictor,
    devices: Mapping[ComponentId, int],
    *,
    delays: Mapping[ComponentId, float] | None = None,
    penalties: Mapping[ComponentId, float] | None = None,
    before: Mapping[ComponentId, int] | None = None,
    demand: Mapping[ComponentId, Demand] | None = None,
    waiting: set[ComponentId] | None = None,
    estimates: Estimates | None = None,
    rates: Rates | None = None,
) -> dict[ComponentId, float]:
    """Predicted seconds until each stage finishes this iteration's work.

    Args:
        graph: the hypergraph (read only).
        predictor: throughput model.
        devices: devices per component after the plan.
        delays: seconds before a receiver's new devices take effect (it runs on
            ``before`` until then). The longest is when the plan's migrations are all
            done: no later migration starts before (the controller commits no plan
            while one is in flight), so devices flowing downstream as stages finish
            move only after it.
        penalties: seconds a donor loses (its drained requests re-prefill elsewhere).
        before: devices per component now (defaults to ``devices``).
        demand: precomputed :func:`demands` (saves recomputing across candidates).
        waiting: if given, receives the trainers whose next step is predicted to wait
            for their predecessors' devices rather than start on their own (see
            :func:`~dynarl.control.trainer_steps.trainers_to_hold`).
        estimates: what was already read from ``graph`` (see
            :mod:`~dynarl.control.estimates`).
        rates: the rates already computed on ``graph`` and ``predictor`` as they
            are (one decision's :class:`~dynarl.control.demand.Rates`).
    """
    demand = demands(graph, estimates=estimates) if demand is None else demand
    rate_of = Rates(graph, predictor) if rates is None else rates
    delays = delays or {}
    settled = max(delays.values(), default=0.0)
    penalties = penalties or {}
    before = before or devices
    finish: dict[ComponentId, float] = {}
    for cid in graph.stage_order:
        d = demand[cid]
        if d.work <= 0:
            finish[cid] = 0.0
            continue
        n_new = devices.get(cid, 0)
        n_old = before.get(cid, n_new)
        preds = graph.predecessors[cid]
        arrival = max((finish.get(p, 0.0) for p in preds), default=0.0)
        if n_new == 0 and d.upstream > 0:
            # Its inputs are still coming: devices flow downstream as stages finish,
            # so count those its predecessors hold, arriving after a migration; all
            # its work waits until then. (With no input still coming, zero devices
            # is a stall: infinitely slow.)
            upstream = sum(devices.get(p, 0) for p in graph.ancestors[cid])
            unit = graph.components[cid].spec.devices_per_instance
            later = rate_of(cid, max(unit, upstream - upstream % unit), d)
            cost = predictor.migration_cost("workload")
            start = max(arrival, settled) + cost
            finish[cid] = start + (d.work / later if later > 0 else math.inf)
            continue
        new = rate_of(cid, n_new, d)
        old = rate_of(cid, n_old, d) if n_old != n_new else new
        if graph.components[cid].spec.kind == "actor" and d.tail > 0:
            end, waits = actor_finish(
                graph,
                predictor,
                cid,
                d,
                n_old=n_old,
                n_new=n_new,
                delay=delays.get(cid, 0.0),
                arrival=arrival,
                settled=settled,
                devices=devices,
                rates=rate_of,
            )
            finish[cid] = end + penalties.get(cid, 0.0)
            if waits and waiting is not None:
                waiting.add(cid)
            continue
        delay, penalty = delays.get(cid, 0.0), penalties.get(cid, 0.0)
        own = _time_for(d.work, old, new, delay) + penalty
        tail = d.tail / new if new > 0 else math.inf if d.tail > 0 else 0.0
        finish[cid] = max(own, arrival + tail)
        left = None  # work left when the last input arrives, if its arrivals are known
        if d.arriving and new > 0 and arrival > 0:
            drained = _drain(d, old, new, delay, arrival)
            finish[cid] = max(finish[cid], drained + penalty)
            left = max(drained - arrival, 0.0) * new
        if d.upstream > 0 and arrival > 0:
            # Devices flow downstream: once its predecessors finish, their devices can
            # join this stage (after a migration) for the work still left then. A stage
            # fed by others need not hold now the devices it will need at the end.
            spec = graph.components[cid].spec
            unit = spec.devices_per_instance
            pooled = n_new + sum(devices.get(p, 0) for p in graph.ancestors[cid])
            pooled -= pooled % unit
            if pooled > n_new:
                if left is None:
                    done = min(max(d.work - d.tail, 0.0), new * arrival)
                else:
                    done = max(d.work - left, 0.0)
                later = rate_of(cid, pooled, d)
                kind = "reshard" if spec.kind == "actor" else "workload"
                if later > 0:
                    start = max(arrival, settled) + predictor.migration_cost(kind)
                    joined = start + (d.work - done) / later
                    finish[cid] = min(finish[cid], joined)
    return finish


def score_plan(
    graph: Hypergraph,
    predictor: Predictor,
    plan: Plan,
    before: Mapping[ComponentId, int] | None = None,
    demand: Mapping[ComponentId, Demand] | None = None,
    *,
    estimates: Estimates | None = None,
    placed: bool = False,
    rates: Rates | None = None,
) -> float:
    """Predicted remaining iteration seconds if ``plan`` is carried out now
    (``placed``: ``demand`` already holds each rollout's most loaded engine as the
    plan leaves it; else :func:`after_moves` places the moved requests; ``rates``: see
    :func:`finish_times`; without them, a component the plan resizes is rated at its
    new instance size).

    A receiver's new devices arrive after its migration's cost; a donor whose drained
    instances hold requests loses that cost too (they re-prefill elsewhere). A donor's
    drained instances stop at once (the trainer's only at its step boundary), so a
    component that drains and restarts its own instances runs without them meanwhile.

    The donor's loss is at least the migration's flat cost, and at least the re-prefill
    of the moved requests' contexts (:meth:`~dynarl.control.predictor.Predictor.prefill_cost`)
    shared by the engines it keeps, whose batches stall meanwhile. Charging the
    re-prefill alone made draining full engines look nearly free at 1.5B (nothing here
    charges the moved requests' wait for a slot on the full engines they go to); at
    32B, where a long context takes seconds to prefill, the flat cost alone made
    moving engines mid-rollout look several times cheaper than it is.
    """
    est = or_fresh(estimates)
    if before is None:
        before = {c: n.num_active_devices for c, n in graph.components.items()}
    after = dict(before)
    during = dict(before)
    delays: dict[ComponentId, float] = {}
    penalties: dict[ComponentId, float] = {}
    units: dict[ComponentId, int] = {}  # components the plan resizes
    for m in plan.migrations:
        cost = predictor.migration_cost(m.kind)
        if m.src is not None:
            drained = [graph.instances[i] for i in m.drain]
            num_devices = sum(len(n.devices) for n in drained)
            after[m.src] -= num_devices
            kind = graph.components[m.src].spec.kind
            if kind != "actor":
                during[m.src] -= num_devices
            if any(n.items for n in drained):
                stall = reprefill_s(graph, predictor, m.src, drained, len(m.drain), est=est)
                penalties[m.src] = max(penalties.get(m.src, 0.0), cost, stall)
        if m.dst is not None:
            after[m.dst] += sum(len(s.devices) for s in m.create)
            delays[m.dst] = max(delays.get(m.dst, 0.0), cost)
            if m.unit and m.unit != graph.components[m.dst].spec.devices_per_instance:
                units[m.dst] = m.unit
    if units and rates is None:
        rates = Rates(graph, predictor, units=units)
    demand = demands(graph, estimates=est) if demand is None else demand
    if not placed:
        demand = after_moves(graph, plan, demand)
    return remaining_time(
        graph,
        predictor,
        after,
        delays=delays,
        penalties=penalties,
        before=during,
        demand=demand,
        estimates=est,
        rates=rates,
    )


def after_moves(
    graph: Hypergraph, plan: Plan, demand: Mapping[ComponentId, Demand]
) -> Mapping[ComponentId, Demand]:
    """``demand`` with each rollout's most loaded engine as it is after ``plan``: a
    drained engine's requests go where the plan's ``reassign`` sends them, the others
    (a candidate built without reassignment) as the planner would send them (whole
    groups, largest first, to the least loaded engine)."""
    out: dict[ComponentId, Demand] | None = None
    for cid in {m.src for m in plan.migrations if m.src is not None}:
        node = graph.components[cid]
        d = demand[cid]
        if node.spec.kind != "rollout" or d.hottest <= 0:
            continue
        drained = {i for m in plan.migrations if m.src == cid for i in m.drain}
        moved = [(i, e) for iid in drained for i, e in graph.instances[iid].items.items()]
        if not moved:
            continue
        loads = {n.id: len(n.items) for n in node.active_instances() if n.id not in drained}
        targets = {i: t for m in plan.migrations if m.src == cid for i, t in m.reassign}
        rest: dict[GroupId, int] = {}
        for item, edge in moved:
            target = targets.get(item)
            if target in loads:
                loads[target] += 1
            else:
                group = graph.edges[edge].items[item].group
                rest[group] = rest.get(group, 0) + 1
        _place_groups(loads, rest.values())
        out = dict(demand) if out is None else out
        out[cid] = d.with_hottest(max(loads.values(), default=0))
    return demand if out is None else out


def _place_groups(loads: dict[InstanceId, int], sizes: Iterable[int]) -> None:
    """Add groups of ``sizes`` items to ``loads``, largest first to the least loaded."""
    if not loads:
        return
    heap = [(load, iid) for iid, load in loads.items()]
    heapq.heapify(heap)
    for size in sorted(sizes, reverse=True):
        load, iid = heapq.heappop(heap)
        loads[iid] = load + size
        heapq.heappush(heap, (load + size, iid))


def _drain(d: Demand, old: float, new: float, delay: float, arrival: float) -> float:
    """When a stage whose inputs come in ``d.arriving``'s chunks (the last at
    ``arrival``) has done its work: what is here first, then each chunk once it has
    arrived, in order. Devices idle while their inputs are still coming do not get
    ahead: a stage sized to its work's total finishes late when most of that work
    arrives last (the longest responses do)."""
    here = max(d.work - d.upstream, 0.0)  # the chunks carry ``d.upstream`` in all
    t = _time_for(here, old, new, delay)
    for share, w in d.arriving:
        t = max(t, share * arrival) + w / new
    return t


def _time_for(work: float, old: float, new: float, delay: float) -> float:
    """Time to do ``work`` at rate ``old`` for ``delay`` seconds, then at ``new``."""
    if delay <= 0:
        return work / new if new > 0 else math.inf
    if old > 0 and work <= old * delay:
        return work / old
    done = old * delay
    return delay + (work - done) / new if new > 0 else math.inf
