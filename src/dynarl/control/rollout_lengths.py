"""What a rollout component's pending requests are expected to generate, read from the
hypergraph: how far each has got, how much more the average one and the longest one
will generate, and the samples they will become.

Response lengths are heavy-tailed and capped, so the requests still running late in a
rollout are the long ones: a pending request's remaining length is the last finished
iteration's *survivors* past its progress, ``E[L - p | L > p]``. The rollout ends with
its longest request, and which one that is depends on how far each has got -- the
least advanced request that will hit the cap sets the end, however advanced the
average is -- so the longest is estimated from every pending request's own progress
(:meth:`~dynarl.control.elements.Node.progress_of`), as the median of the maximum of
their remaining lengths.
"""

import bisect
import math
from collections.abc import Iterator

from dynarl.control.elements import TOOL, HyperEdge
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import ComponentId, GroupId

_BUCKETS = 32  # progress quantiles the longest-remaining estimate works on
_ORDER_BUCKETS = 16  # equal-count buckets of :func:`completion_order`
_ORDER_POINTS = 32  # survivor lengths drawn per progress bucket


class Completions:
    """The pending requests of a rollout in the order they are expected to complete,
    in equal-count buckets: ``time[k]``, the share of the longest remaining response
    at which the requests of bucket ``k`` have completed (every running request gains
    a token per decode step, so a remainder of ``r`` tokens ends ``r / longest`` of the
    way to the rollout's end); ``length[k]``, their mean response length then."""

    __slots__ = ("length", "time")

    def __init__(self, time: tuple[float, ...], length: tuple[float, ...]) -> None:
        self.time = time
        self.length = length


def mean_progress(graph: Hypergraph, component: ComponentId) -> float:
    """Mean tokens the pending requests of a rollout component have generated."""
    pending = graph.pending(component)
    if not pending:
        return 0.0
    edges = graph.edges_into(component)
    parked = sum(e.progress_parked for e in edges)
    held = sum(  # Node.progress_sum, inlined: this runs for every candidate plan
        [
            n.progress_base + len(n.started) * n.tokens_per_request
            for n in graph.components[component].instances.values()
        ]
    )
    return max(0.0, parked + held) / pending


def returning_sessions(graph: Hypergraph, component: ComponentId) -> float:
    """How many of a rollout component's sessions now out on a tool call are expected
    to come back for another turn.

    A multi-turn session leaves its engine after every turn that calls a tool; its
    environment then either sends it back for the next turn or ends it there (a
    session whose last turn is handed back like the others ends in the tool). Of the
    sessions that left after their ``k``-th turn so far, the share that came back is
    the chance one out after ``k`` turns comes back, ``(returned_k + q) / (left_k +
    1)``, with ``q`` the share over every turn count (``(returned + 1) / (left + 1)``:
    before anything is seen, every session comes back). Counted as ended, a session
    out on a tool would read as finished rollout work, and the scheduler would give
    away the engines it returns to.
    """
    node = graph.components[component]
    returns, ends = node.tool_returns, node.tool_ends
    total_returns, total_ends = sum(returns), sum(ends)
    pooled = (total_returns + 1) / (total_returns + total_ends + 1)
    out = 0.0
    for edge in graph.edges_into(component):
        for k, count in edge.in_tool_turns.items():
            back = returns[k] if k < len(returns) else 0
            left = back + (ends[k] if k < len(ends) else 0)
            out += count * (back + pooled) / (left + 1)
    return out


def pending_progress(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> list[float]:
    """Tokens each pending request of a rollout component has generated, ascending
    (once per state of the hypergraph, with ``estimates``)."""
    return or_fresh(estimates).get(
        graph, ("progress", component), lambda: _pending_progress(graph, component)
    )


def _pending_progress(graph: Hypergraph, component: ComponentId) -> list[float]:
    edges = graph.edges_into(component)
    if all(e.spec.consumers == (component,) for e in edges):
        return _progress_by_holder(graph, component, edges)
    out: list[float] = []
    for edge in edges:
        for st in edge.items.values():
            owner = st.owner
            if owner is None or owner == TOOL:
                out.append(st.generated)
            else:
                out.append(graph.instances[owner].progress_of(st))
    out.sort()
    return out


def _progress_by_holder(
    graph: Hypergraph, component: ComponentId, edges: list[HyperEdge]
) -> list[float]:
    """:func:`_pending_progress` when only ``component`` consumes its edges: every
    held request is then held by one of its instances, so each instance's running and
    waiting requests are read together (its share of the tokens looked up once, not
    once per request) and the queued ones from the edges' queues (the sorted values
    are the same)."""
    out: list[float] = []
    for edge in edges:  # the parked requests: queued, or out on a tool call
        items = edge.items
        out.extend([items[i].generated for i in edge.queue])
        out.extend([st.generated for st in edge.in_tool.values()])
    for node in graph.components[component].instances.values():
        tpr = node.tokens_per_request
        out.extend([st.generated + tpr - st.mark for st in node.started.values()])
        out.extend([st.generated for st in node.waiting.values()])
    out.sort()
    return out


def pending_progress_by_group(
    graph: Hypergraph, component: ComponentId
) -> tuple[list[GroupId], list[float]]:
    """The group and the tokens generated of every pending request of a rollout
    component, as two lists in the same (no particular) order: :func:`pending_progress`
    with each request's group (read the same way, per holder), for the models that need
    a group's requests together (:mod:`~dynarl.control.partial_cut`)."""
    edges = graph.edges_into(component)
    groups: list[GroupId] = []
    progress: list[float] = []
    if any(e.spec.consumers != (component,) for e in edges):  # shared edges: each item
        for edge in edges:
            for st in edge.items.values():
                owner = st.owner
                groups.append(st.group)
                progress.append(
                    st.generated
                    if owner is None or owner == TOOL
                    else graph.instances[owner].progress_of(st)
                )
        return groups, progress
    for edge in edges:
        parked = [st for st in edge.items.values() if st.owner in (None, TOOL)]
        groups.extend([st.group for st in parked])
        progress.extend([st.generated for st in parked])
    for inst in graph.components[component].instances.values():
        tpr = inst.tokens_per_request
        started = inst.started.values()
        groups.extend([st.group for st in started])
        progress.extend([st.generated + tpr - st.mark for st in started])
        waiting = inst.waiting.values()
        groups.extend([st.group for st in waiting])
        progress.extend([st.generated for st in waiting])
    return groups, progress


def expected_remaining_tokens(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> float:
    """Expected tokens a pending request of a rollout component still generates, on
    average over them.

    With a finished iteration, each one's survivors of its lengths past its own
    progress, ``E[L - p | L > p]``, averaged over the pending requests (in up to
    :data:`_BUCKETS` progress quantiles; reading every pending request, with
    ``estimates`` once per state of the hypergraph). With heavy-tailed lengths that
    remainder grows with the progress, so taken once at the mean progress it gave the
    fresh and short requests the long ones' remainders: on simulated math 32B the
    rollout's remaining work came out 28-91% above what its requests went on to
    generate through the middle of the rollout. During the first iteration, at least
    the mean response length so far (or the prior before any: this iteration's
    completions are the short ones, so their mean is biased low until it ends), and
    at least what the requests in flight have generated on average: with heavy-tailed
    lengths, the survivors are the long ones.
    """
    node = graph.components[component]
    lengths = node.lengths_prev
    if lengths:
        est = or_fresh(estimates)
        return est.get(
            graph, ("remaining", component), lambda: _mean_remaining(graph, component, est)
        )
    progress = mean_progress(graph, component)
    done = node.items_completed - node.items_completed_iter
    if done:
        mean = (node.tokens_completed - node.tokens_completed_iter) / done
    else:
        mean = graph.expected_tokens_per_request
    return max(mean, progress)


def _remaining_past(lengths: list[int], suffix: list[float], progress: float) -> float:
    """``E[L - p | L > p]`` over the sorted ``lengths`` (``suffix``: their suffix
    sums), at least one token (a request past every length seen)."""
    k = bisect.bisect_right(lengths, progress)
    if k < len(lengths):
        return suffix[k] / (len(lengths) - k) - progress
    return max(1.0, lengths[-1] - progress)


def _mean_remaining(graph: Hypergraph, component: ComponentId, est: Estimates) -> float:
    node = graph.components[component]
    lengths, suffix = node.lengths_prev, node.lengths_prev_suffix
    progress = pending_progress(graph, component, est)
    n = len(progress)
    if not n:
        return _remaining_past(lengths, suffix, 0.0)
    total = 0.0
    for i, count in _quantiles(n):
        total += count * _remaining_past(lengths, suffix, progress[i + count // 2])
    return total / n


def _quantiles(n: int) -> Iterator[tuple[int, int]]:
    """Up to :data:`_BUCKETS` equal-count buckets of ``n`` sorted values: each one's
    first index and count."""
    size = max(1, math.ceil(n / _BUCKETS))
    for i in range(0, n, size):
        yield i, min(size, n - i)


def expected_longest_remaining(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> float:
    """Tokens the longest pending request of a rollout component still generates.
    The rollout cannot end sooner, however many devices it has.

    With a finished iteration, the median of the maximum over pending requests of
    their survivors' remaining lengths (independent draws given each one's progress).
    During the first, the longest response seen (or the cap, before any) less the
    least progress: that request may be as long as the longest.

    It reads every pending request: with ``estimates``, once per state of the
    hypergraph.
    """
    if not graph.pending(component):
        return 0.0
    est = or_fresh(estimates)
    return est.get(graph, ("longest", component), lambda: _longest(graph, component, est))


def _longest(graph: Hypergraph, component: ComponentId, est: Estimates) -> float:
    progress = pending_progress(graph, component, est)
    node = graph.components[component]
    mean = expected_remaining_tokens(graph, component, est)
    if node.lengths_prev:
        cap = graph.max_tokens_per_request
        longest = max(mean, _median_of_max(node.lengths_prev, progress, cap))
    else:
        longest = max(
            mean, (node.max_tokens_completed or graph.max_tokens_per_request) - progress[0]
        )
    return longest


def expected_context(graph: Hypergraph, component: ComponentId) -> float:
    """Mean tokens of context a token the pending requests of a rollout component
    still generate attends to: their prompt, what they generated so far and half of
    what they still generate, weighted by it -- ``p + g + E[r^2] / 2E[r]`` with ``r``
    the survivors' remaining length past the mean progress ``g`` (so the long
    remainders, which generate most tokens, weigh most). Without a finished iteration,
    as if each had the expected remainder (:func:`expected_remaining_tokens`).

    A decode step reads the KV of every running request, so this is what each of
    those tokens costs beyond the weights.
    """
    pending = graph.pending(component)
    if not pending:
        return 0.0
    prompt = sum(e.tokens_pending for e in graph.edges_into(component)) / pending
    progress = mean_progress(graph, component)
    node = graph.components[component]
    lengths = node.lengths_prev
    k = bisect.bisect_right(lengths, progress)
    if k < len(lengths):
        # Over the survivors L > g: E[(L-g)^2] / 2E[L-g] = (E[L^2] - 2g E[L] + g^2) / 2(E[L] - g)
        n = len(lengths) - k
        first, second = node.lengths_prev_suffix[k] / n, node.lengths_prev_suffix_sq[k] / n
        remaining = first - progress
        half = (second - 2 * progress * first + progress**2) / (2 * remaining)
    else:
        half = expected_remaining_tokens(graph, component) / 2
    return prompt + progress + max(half, 0.0)


def completion_order(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> Completions | None:
    """When the pending requests of a rollout component complete, in order, and how
    long they are then (:class:`Completions`); ``None`` before a finished iteration.

    Each pending request's remainder is drawn from the survivors of the last finished
    iteration's lengths past its progress (independently); the mixture over requests,
    cut into equal-count buckets, is the completion order: the short remainders first,
    the requests that reach the longest lengths last. Like the longest remaining, it
    reads every pending request: with ``estimates``, once per state of the hypergraph.
    """
    node = graph.components[component]
    if not node.lengths_prev or not graph.pending(component):
        return None
    est = or_fresh(estimates)
    return est.get(graph, ("order", component), lambda: _completion_order(graph, component, est))


def _completion_order(graph: Hypergraph, component: ComponentId, est: Estimates) -> Completions:
    lengths = graph.components[component].lengths_prev
    progress = pending_progress(graph, component, est)
    n = len(progress)
    points: list[tuple[float, float, float]] = []  # (remainder, weight, final length)
    for i, count in _quantiles(n):
        p = progress[i]
        k = bisect.bisect_right(lengths, p)
        left = len(lengths) - k
        if left == 0:  # past every length seen: one more token (see expected_remaining)
            points.append((1.0, float(count), p + 1.0))
            continue
        draws = min(left, _ORDER_POINTS)
        weight = count / draws
        picks = [lengths[k + (2 * j + 1) * left // (2 * draws)] for j in range(draws)]
        points.extend([(final - p, weight, final) for final in map(float, picks)])
    points.sort()
    longest = max(expected_longest_remaining(graph, component, est), 1.0)
    total = sum([w for _, w, _ in points])
    times: list[float] = []
    means: list[float] = []
    edge = total / _ORDER_BUCKETS
    acc = mass = tokens = 0.0
    reached = edge - 1e-9  # where the first bucket ends (less a rounding margin)
    for r, w, final in points:
        acc += w
        mass += w
        tokens += w * final
        if acc >= reached and len(times) < _ORDER_BUCKETS:
            times.append(min(1.0, r / longest))
            means.append(tokens / mass)
            mass = tokens = 0.0
            reached = edge * (len(times) + 1) - 1e-9
    while len(times) < _ORDER_BUCKETS:  # rounding: the last bucket ends with the last
        times.append(min(1.0, points[-1][0] / longest))
        means.append(tokens / mass if mass > 0 else (means[-1] if means else 0.0))
        mass = tokens = 0.0
    return Completions(tuple(times), tuple(means))


def expected_output_work(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> float:
    """Work, in :meth:`~dynarl.control.hypergraph.Hypergraph.item_work` units, of the
    samples a rollout component's pending requests will become: their prompts, what
    they generated so far and what they are expected to generate
    (:func:`expected_remaining_tokens`); their count before items carry sizes."""
    pending = graph.pending(component)
    if not graph.sized or not pending:
        return float(pending)
    prompts = sum(e.tokens_pending for e in graph.edges_into(component))
    so_far = mean_progress(graph, component) * pending
    return prompts + so_far + pending * expected_remaining_tokens(graph, component, estimates)


def _median_of_max(lengths: list[int], progress: list[float], cap: float) -> float:
    """The smallest ``r`` with ``P(max_i (L_i - p_i) <= r) >= 1/2``, where ``L_i`` is
    drawn from ``lengths`` (sorted) given ``L_i > p_i``, for the sorted ``progress``.

    Progress is taken in up to ``_BUCKETS`` equal-count quantiles, each at its least
    value (the least advanced request has the most left, so this errs long). A request
    past every length seen runs to the cap.
    """
    buckets = [(progress[i], count) for i, count in _quantiles(len(progress))]
    floor = 0.0  # a request past every length seen ends at the cap
    survivors: list[tuple[float, int, int, int]] = []  # (p, count, first survivor, survivors)
    for p, count in buckets:
        k = bisect.bisect_right(lengths, p)
        if k == len(lengths):
            floor = max(floor, cap - p, 1.0)
        else:
            survivors.append((p, count, k, len(lengths) - k))
    if not survivors:
        return floor

    def log_p_max_within(r: float) -> float:
        total = 0.0
        for p, count, k, left in survivors:
            within = bisect.bisect_right(lengths, p + r) - k
            if within == 0:
                return -math.inf
            total += count * math.log(within / left)
        return total

    lo, hi = 0.0, float(lengths[-1])  # P(max <= longest length) = 1
    half = math.log(0.5)
    while hi - lo > max(1.0, hi / 512):
        mid = (lo + hi) / 2
        if log_p_max_within(mid) >= half:
            hi = mid
        else:
            lo = mid
    return max(floor, hi)
