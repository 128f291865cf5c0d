"""The trainer's step model: when an actor gets through its remaining optimizer steps.

The trainer (the ``actor`` component) works in whole minibatches, one optimizer step
each, and is resized only between steps: a step starts as soon as its minibatch is
complete, on the devices the trainer holds then, and runs on them to its end, whatever
devices free up meanwhile. Its finish time is therefore not its remaining work over a
rate: scoring (:func:`~dynarl.control.scoring.finish_times`) plays its steps out one
by one with :func:`actor_finish`. A step in progress runs on the current devices, and
a plan that resizes the trainer takes effect only after that step ends (plus the
move's cost). The samples already at the trainer make the first minibatches; the rest
arrive until its predecessors finish (evenly, or as :func:`steps_in_arrival_order`
says when each step's last group arrives).

What a step costs depends on the samples in its minibatch. When every minibatch draws
evenly from the iteration's samples, the remaining steps are equal. When minibatches
are formed in arrival order (``steps_in_arrival_order`` on the actor's spec, set by
``algorithm.minibatch_order=completion``) and samples carry sizes, each step trains the
next whole groups in the order they complete -- the trainer's own complete groups
first, then the others as their last sample arrives (:func:`steps_in_arrival_order`)
-- so with heavy-tailed response lengths the last step, holding the longest
responses, can take several times the average and waits for the rollout's end.

A step may finish sooner if it waits for the devices the trainer's predecessors free
when they finish (they join it after a reshard) than if it starts now on the few it
holds and keeps them waiting at its boundary.
:func:`~dynarl.control.policies.hold.trainers_to_hold` names the
trainers whose next step should wait; :class:`~dynarl.control.policies.hold.HoldForDevices`
holds them at their step boundary.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter

from dynarl.control import partial_cut, rollout_lengths
from dynarl.control.demand import Demand, Rates
from dynarl.control.elements import ItemState
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.core.ids import ComponentId, GroupId

StepPlan = tuple[tuple[float, ...], tuple[float, ...]]


def steps_in_arrival_order(
    graph: Hypergraph, cid: ComponentId, steps_left: int, estimates: Estimates | None = None
) -> StepPlan:
    """The work of each of a trainer's ``steps_left`` remaining steps when each trains
    the next minibatch of whole groups in the order the groups complete (streamed
    minibatches), and when each step's last group completes, as a share of the time
    until the trainer's predecessors finish.

    A group is complete when its last sample reaches the trainer. Samples already here
    have arrived; those at a stage between rollout and the trainer arrive over that
    time: in queue order (evenly in work) where one instance holds the stage, in no
    order of it where several do (:func:`_reached`). A group with ``m`` requests still in
    rollout completes with the last of them: at the median of the maximum of ``m``
    draws from the rollout's completion order
    (:func:`~dynarl.control.rollout_lengths.completion_order`; before a finished
    iteration, of draws uniform in time), and its requests are then about as long as
    the responses that end there (a group's lengths correlate). So with heavy-tailed
    response lengths the groups with a long response come last, the last minibatch
    holds the longest responses, and a step can wait long for its last group even
    with many samples here.

    It reads every pending sample: with ``estimates``, once per state of the
    hypergraph. :func:`~dynarl.control.scoring.demands` stores it as the actor's
    :attr:`Demand.steps <dynarl.control.demand.Demand.steps>` and ``ready`` (only for a
    trainer with ``steps_in_arrival_order``, sized items and more than one step left),
    which :func:`actor_finish` then plays out."""
    est = or_fresh(estimates)
    return est.get(graph, ("steps", cid, steps_left), lambda: _steps(graph, cid, steps_left, est))


def _steps(graph: Hypergraph, cid: ComponentId, steps_left: int, est: Estimates) -> StepPlan:
    chain: list[ComponentId] = []
    stage: ComponentId | None = cid
    while stage is not None:
        chain.append(stage)
        if graph.components[stage].spec.kind == "rollout":
            break
        preds = [p for p in graph.predecessors[stage] if graph.spec.component(p).on_devices]
        stage = max(preds, key=graph.pending, default=None)
    # group -> [samples, work, ready share, requests in rollout, their prompt tokens]
    groups: dict[GroupId, list[float]] = {}
    # Samples between rollout and trainer arrive in chain order (nearest the trainer
    # first), in queue order: the work arrived by each group's last one.
    arrival: dict[GroupId, float] = {}
    arrived = 0
    rollout: ComponentId | None = None
    sized = graph.sized
    for stage in chain:
        kind = graph.components[stage].spec.kind
        for edge in graph.edges_into(stage):
            if kind == "rollout":
                # Only the order of the samples between the two matters: here the
                # edge's counts per group serve (O(groups), not O(items)). Most
                # groups are only here (0.0 + x is x, as a float).
                if edge.groups:
                    rollout = stage
                for group, (num, size) in edge.groups.items():
                    g = groups.get(group)
                    if g is None:
                        groups[group] = [0.0 + num, 0.0, 0.0, 0.0 + num, 0.0 + size]
                    else:
                        g[0] += num
                        g[3] += num
                        g[4] += size
                continue
            if stage == cid:
                for group, (num, size) in edge.groups.items():
                    g = groups.setdefault(group, [0.0, 0.0, 0.0, 0.0, 0.0])
                    g[0] += num
                    g[1] += size if sized else num
                continue
            # Per group its counts (groups in the order of their first sample), per
            # sample only its work (graph.item_work, summed in whole tokens).
            states = list(edge.items.values())
            order = [st.group for st in states]
            for group in dict.fromkeys(order):
                num, size = edge.groups[group]
                g = groups.setdefault(group, [0.0, 0.0, 0.0, 0.0, 0.0])
                g[0] += num
                g[1] += size if sized else num
            # max(tokens, 1), with no call per sample (sizes are never negative)
            works = [st.tokens or 1 for st in states] if sized else [1] * len(order)
            here = sum(works)
            for group, by in _reached(graph, stage, states, works, here):
                at = arrived + by
                if arrival.get(group, -1.0) < at:
                    arrival[group] = at
            arrived += here
    if rollout is not None:
        _rollout_groups(graph, rollout, groups, est)
    upstream = sum([g[1] for g in groups.values()]) - graph.work_pending(cid)
    for group, by in arrival.items():
        g = groups[group]
        g[2] = max(g[2], min(1.0, by / upstream) if upstream > 0 else 0.0)
    _pool_work(groups, arrival)
    total = sum([g[0] for g in groups.values()])
    per_step = math.ceil(total / steps_left)
    steps: list[float] = []
    ready: list[float] = []
    count, work, last = 0.0, 0.0, 0.0
    for g in sorted(groups.values(), key=itemgetter(2)):
        count, work, last = count + g[0], work + g[1], max(last, g[2])
        if count >= per_step - 1e-9:
            steps.append(work)
            ready.append(last)
            count = work = 0.0
    if count > 0:
        steps.append(work)
        ready.append(last)
    return tuple(steps), tuple(ready)


def _reached(
    graph: Hypergraph,
    stage: ComponentId,
    states: Sequence[ItemState],
    works: list[int],
    total: int,
) -> Iterator[tuple[GroupId, float]]:
    """For each group with samples at a stage between rollout and the trainer (the
    edge's ``states``, ``works`` each, ``total`` in all): the stage's work done (of
    ``total``) when its last sample there is done.

    One instance works through its samples in the order they came: a group is done
    with its last one in the edge's order. Several do not keep that order: the data
    plane routes by count, not by work, and moves queued samples to whichever
    instance runs out (the busiest's oldest first), each to the back of its new
    queue. Measured on simulated math 32B at 64 devices (seed 5, two replicas 245 s
    of work behind, 4,279 samples of 509 groups): the samples were done in an order
    unrelated to the edge's, on each replica too, and the first minibatch's 128
    groups were complete after 58% of the stage's time, where the edge's order put
    them at 10%; the trainer, given 32 devices for that minibatch, held them idle
    for 245 s. A stage with no instance is no better: the devices that come to it
    later run several (math 7B at 128 devices, seed 5: 7,220 samples queued, every
    minibatch complete within the last 2 s of the 23 s its replicas took). So unless
    one instance holds the stage, each sample is done at a uniform share of the
    stage's work, and a group of ``m`` samples there at the median of the largest of
    ``m`` such shares, ``0.5 ** (1 / m)``, as a group with ``m`` requests in rollout
    ends (:func:`_rollout_groups`)."""
    if graph.components[stage].num_active == 1:
        by = 0.0
        for st, w in zip(states, works, strict=True):
            by += w
            yield st.group, by
        return
    counts: dict[GroupId, int] = {}
    for st in states:
        counts[st.group] = counts.get(st.group, 0) + 1
    for group, m in counts.items():
        yield group, total * 0.5 ** (1.0 / m)


def _pool_work(groups: dict[GroupId, list[float]], arrival: dict[GroupId, float]) -> None:
    """Give the groups whose last samples are between rollout and the trainer (none
    left in rollout) the pool's mean work per sample: which of them complete first is
    not their queue order.

    The stages in between run many replicas side by side, each working through its
    own queue in micro-batches, so such a pool's groups complete in an order unrelated
    to their size. Measured on simulated math 1.5B at 128 devices (seed 0, 1 s ticks,
    the state where the trainer's first step was decided): 337 such groups, completed
    within 2 s, rank correlation 0.03 between a group's work and when it completed and
    0.10 between its queue position and when it completed, while the queue position
    put the small groups first (0.85 with their work). A minibatch drawn from the pool
    holds its mean: the first step held 5.2M tokens where the queue order's groups
    made 2.4M, and the trainer, not held, ran it on 4 devices for 42 s instead of
    waiting 22 s for the cluster (the iteration took 152 s instead of 134). The work
    in all is unchanged. Where an intermediate stage drains a long queue over many
    seconds (few large replicas), its queue order says more than this assumes."""
    pool = [g for gid, g in groups.items() if gid in arrival and not g[3]]
    count = sum([g[0] for g in pool])
    if count <= 0:
        return
    mean = sum([g[1] for g in pool]) / count
    for g in pool:
        g[1] = g[0] * mean


def _rollout_groups(
    graph: Hypergraph, rollout: ComponentId, groups: dict[GroupId, list[float]], est: Estimates
) -> None:
    """Fill in, for the groups with requests in ``rollout``, when their last request
    completes (share of the rollout's remaining time) and their requests' work."""
    cut = partial_cut.rollout_cut(graph, rollout, est)
    if cut is not None:
        # A partial rollout: only the groups expected to complete before it ends are
        # trained this iteration, each when its longest remaining response ends. (A
        # group with samples past rollout is admitted already: its last one may still
        # be reported in rollout, for the moment it is handed on.)
        aside = [gid for gid, g in groups.items() if g[0] == g[3] and gid not in cut.groups]
        for group in aside:
            del groups[group]
        scale = 1.0 / cut.tokens if cut.tokens > 0 else 0.0
        for gid, left in cut.groups.items():
            if gid in groups:
                groups[gid][2] = max(groups[gid][2], min(1.0, left * scale))
        for gid, num in cut.held.items():  # finished, waiting outside the pipeline
            if gid in groups:
                groups[gid][0] += num
                groups[gid][1] += num * cut.sample_work
    order = rollout_lengths.completion_order(graph, rollout, est)
    if order is None:  # no lengths yet: completions uniform in time, each of the mean
        length = rollout_lengths.mean_progress(graph, rollout)
        length += rollout_lengths.expected_remaining_tokens(graph, rollout, est)
        times: tuple[float, ...] = tuple((k + 1) / 16 for k in range(16))
        lengths: tuple[float, ...] = (length,) * 16
    else:
        times, lengths = order.time, order.length
    k = len(times)
    buckets: dict[float, int] = {}  # by m (groups mostly have the same sizes)
    last: list[tuple[list[float], float]] = []  # (group, length of its last response)
    for g in groups.values():
        m = g[3]
        if not m:
            continue
        b = buckets.get(m, -1)
        if b < 0:
            q = 0.5 ** (1.0 / m)  # median of the maximum of m uniform quantiles
            b = buckets[m] = min(k - 1, int(q * k))
        if cut is None:
            g[2] = max(g[2], times[b])
        last.append((g, m * lengths[b]))
    # A group's requests are taken as long as its last one (they correlate), but they
    # are not all that long: the groups' work in all is what the requests are expected
    # to generate, each the mean of the completion order's lengths. (Unscaled, the
    # steps held 2.2 times the work at agentic 1.5B on 128 devices, seed 0, 4 s into
    # the measured iteration: 70M tokens where 32M came, and the trainer's steps were
    # predicted twice as long as they ran.)
    expected = sum([g[3] for g, _ in last]) * sum(lengths) / k
    drawn = sum([w for _, w in last])
    scale = expected / drawn if drawn > 0 else 1.0
    for g, w in last:
        g[1] += g[4] + w * scale


def actor_finish(
    graph: Hypergraph,
    predictor: Predictor,
    cid: ComponentId,
    d: Demand,
    *,
    n_old: int,
    n_new: int,
    delay: float,
    arrival: float,
    devices: Mapping[ComponentId, int],
    rates: Rates | None = None,
    settled: float = 0.0,
) -> tuple[float, bool]:
    """When the trainer finishes its remaining optimizer steps, and whether its next
    step (the first not yet running) waits for its predecessors' devices.

    The trainer works in whole minibatches and is resized only between steps: a step
    starts as soon as its minibatch is complete, on the devices the trainer holds
    then, and runs on them to its end, whatever devices free up meanwhile. A step in
    progress (the trainer holds samples, since it started) runs on the current
    devices for what is left of it, and a plan that
    resizes the trainer takes effect ``delay`` after that step ends (after ``delay``
    if none runs; the next step waits for it). The samples already here make the
    first minibatches; the rest arrive evenly until the predecessors finish
    (``arrival``). A step may instead wait for the predecessors' devices to join
    (a reshard after they finish), if that ends it sooner: the trainer is held at its
    step boundary meanwhile (:func:`trainers_to_hold`). Steps are equal (``d.tail``
    each) unless ``d.steps`` says what each holds, and ``d.ready`` when each one's
    last sample arrives (as a share of ``arrival``).

    Returns the predicted seconds from now until the last step ends (before any
    penalty for drained requests, which the caller adds) and whether the next step
    waits. :func:`~dynarl.control.scoring.finish_times` uses it for an actor with work
    left; ``n_old``/``n_new`` are its devices now and after the plan, ``delay`` the
    plan's migration cost, ``arrival`` when its predecessors are predicted to finish,
    ``settled`` when the plan's migrations are all done (the predecessors' devices
    move on only after both) and ``devices`` every component's devices after the plan
    (``rates``: the decision's :class:`~dynarl.control.demand.Rates`, if it keeps
    them).
    """
    sizes = d.steps or (d.tail,) * max(1, round(d.work / d.tail))
    steps = len(sizes)
    own = max(d.work - d.upstream, 0.0)
    node = graph.components[cid]
    unit = node.spec.devices_per_instance
    pooled = n_new + sum(devices.get(p, 0) for p in graph.ancestors[cid])
    pooled -= pooled % unit
    join = max(arrival, settled) + predictor.migration_cost("reshard") if arrival > 0 else math.inf
    rate_of = Rates(graph, predictor) if rates is None else rates

    def step_s(j: int, n: int) -> float:
        r = rate_of(cid, n, d)
        return sizes[j - 1] / r if r > 0 else math.inf

    t, first = 0.0, 1
    resized = delay > 0 and n_new != n_old
    if d.running_since is not None:
        # The step in progress ends its predicted length after it started (when the
        # trainer's instances took its samples), not a whole step from now: counted
        # from now, a hold for the devices on their way was seen too late to matter.
        t, first = max(step_s(1, n_old) - (graph.now_s - d.running_since), 0.0), 2
    ready_new = t + delay if resized else 0.0
    n = n_new
    need = 0.0 - own
    waits = False
    for j in range(1, steps + 1):
        need += sizes[j - 1]
        if j < first:
            continue
        if d.ready:
            ready = arrival * d.ready[j - 1]
        else:
            ready = 0.0 if need <= 1e-9 else arrival * min(1.0, need / max(d.upstream, 1e-9))
        start = max(t, ready, ready_new)
        end = start + step_s(j, n)
        if pooled > n:
            joined = max(start, join) + step_s(j, pooled)
            if joined < end:
                waits = waits or (j == first and start < join)
                n, end = pooled, joined
        t = end
    return t, waits
