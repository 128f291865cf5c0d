"""Where a partial rollout's rollout ends: when the last group it still needs completes.

With partial rollouts (``IterationStarted.groups_to_complete``) a rollout component's
iteration ends once :meth:`~dynarl.control.hypergraph.Hypergraph.groups_needed` more
groups are whole; its other requests are then withdrawn, however far they got. So
the rollout does not run until its longest request ends but until the last of the
groups it needs completes -- every due group (``IterationStarted.groups_due``: carried
as often as the staleness bound allows) and the needed number of the others -- and
until then every pending request decodes. A group
completes with its longest response: its remaining time is the last finished
iteration's *group* maxima (each group's longest response) past the furthest its
pending requests have got, ``E[H | H > p_max] - p_min`` -- the group's longest is at
least as long as its most advanced request, and its least advanced request has the
most left of it. Of the groups not due, those expected soonest are the needed ones.
"""

import numpy as np

from dynarl.control import rollout_lengths
from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import ComponentId, GroupId


class Cut:
    """A partial rollout's expected end.

    Attributes:
        tokens: tokens the slowest needed group still generates: how long the rollout
            runs, in tokens of one request.
        work: tokens every pending request generates until then (its expected
            remainder, at most ``tokens``).
        share: the share of the pending requests that belong to the needed groups
            (the samples that flow downstream).
        groups: the groups expected to complete in time, each with the tokens it
            still generates (when it completes, in tokens of one request).
        held: per needed group, its samples that finished and wait, outside the
            pipeline, for the group to be admitted (``IterationStarted.group_size``
            less those pending on rollout or past it); they flow on with the group.
        sample_work: the work one of those samples is to the stages after rollout
            (:meth:`~dynarl.control.hypergraph.Hypergraph.item_work` units).
    """

    __slots__ = ("groups", "held", "sample_work", "share", "tokens", "work")

    def __init__(
        self,
        tokens: float,
        work: float,
        share: float,
        groups: dict[GroupId, float],
        *,
        held: dict[GroupId, float] | None = None,
        sample_work: float = 0.0,
    ) -> None:
        self.tokens = tokens
        self.work = work
        self.share = share
        self.groups = groups
        self.held = held or {}
        self.sample_work = sample_work

    @property
    def held_samples(self) -> float:
        """Finished samples of the needed groups waiting outside the pipeline."""
        return sum(self.held.values())


def rollout_cut(
    graph: Hypergraph, component: ComponentId, estimates: Estimates | None = None
) -> Cut | None:
    """The expected end of a partial rollout (:class:`Cut`); ``None`` when the rollout
    runs until every pending request completes (no partial rollouts, every pending
    group needed, or no finished iteration to read group lengths from). It reads every
    pending request: with ``estimates``, once per state of the hypergraph."""
    needed = graph.groups_needed(component)
    node = graph.components[component]
    if needed is None or not node.group_lengths_prev or not node.lengths_prev:
        return None
    if not graph.pending(component):
        return None
    return or_fresh(estimates).get(
        graph, ("cut", component), lambda: _cut(graph, component, needed)
    )


def _cut(graph: Hypergraph, component: ComponentId, needed: int) -> Cut | None:
    node = graph.components[component]
    # Per pending group (in the order of its first request): its most and least
    # progress and its pending requests -- array operations over the requests.
    group_of, progress = rollout_lengths.pending_progress_by_group(graph, component)
    index: dict[GroupId, int] = dict.fromkeys(group_of, 0)
    ids = list(index)
    index.update(zip(ids, range(len(ids)), strict=True))
    codes = np.fromiter(map(index.__getitem__, group_of), dtype=np.intp, count=len(group_of))
    done = np.asarray(progress, dtype=np.float64)
    most = np.full(len(ids), -np.inf)
    np.maximum.at(most, codes, done)
    least = np.full(len(ids), np.inf)
    np.minimum.at(least, codes, done)
    counts = np.bincount(codes, minlength=len(ids))
    due = graph.groups_due
    if needed >= sum(1 for gid in ids if gid not in due):
        return None  # every pending group is needed: the usual model
    # Each group's longest response: the last iteration's group maxima past its most
    # advanced request (one token more past all of them); what is left of it for its
    # least advanced request.
    heights, suffix = node.group_lengths_prev_arrays
    n = len(heights)
    k = np.searchsorted(heights, most, side="right")
    past = k < n
    longest = most + 1.0
    longest[past] = suffix[k[past]] / (n - k[past])
    left = (longest - least).tolist()
    chosen: list[tuple[float, GroupId, float]] = []
    others: list[tuple[float, GroupId, float]] = []
    for gid, r, c in zip(ids, left, counts.tolist(), strict=True):
        (chosen if gid in due else others).append((r, gid, float(c)))
    others.sort(key=lambda r: r[0])
    chosen += others[:needed]
    if not chosen:  # over: its requests are about to be withdrawn
        return Cut(0.0, 0.0, 0.0, {})
    tokens = max(r for r, _, _ in chosen)
    # Every pending request decodes until then, each at most its own expected
    # remainder (the last finished iteration's response lengths past its progress),
    # summed in request order.
    lengths, tail = node.lengths_prev_arrays
    m = len(lengths)
    k = np.searchsorted(lengths, done, side="right")
    past = k < m
    own = np.ones_like(done)
    own[past] = tail[k[past]] / (m - k[past]) - done[past]
    work = float(np.cumsum(np.minimum(own, tokens))[-1])
    share = sum(c for _, _, c in chosen) / len(progress)
    held, sample_work = _held(graph, component, chosen)
    chosen_left = {gid: r for r, gid, _ in chosen}
    return Cut(tokens, work, share, chosen_left, held=held, sample_work=sample_work)


def _held(
    graph: Hypergraph, component: ComponentId, chosen: list[tuple[float, GroupId, float]]
) -> tuple[dict[GroupId, float], float]:
    """Per needed group, its finished samples waiting outside the pipeline, and the
    work of one (its prompt and a response as long as this iteration's so far)."""
    size = graph.group_size
    if not size:
        return {}, 0.0
    rollout = graph.edges_into(component)
    later = [e for e in graph.edges.values() if e not in rollout and e.groups]
    held: dict[GroupId, float] = {}
    for _, gid, pending in chosen:
        past = sum(e.groups[gid][0] for e in later if gid in e.groups)
        if size - pending - past > 0:
            held[gid] = float(size - pending - past)
    if not graph.sized:
        return held, 1.0
    node = graph.components[component]
    if node.items_completed_iter:
        response = node.tokens_completed_iter / node.items_completed_iter
    else:
        lengths = node.lengths_prev
        response = sum(lengths) / len(lengths) if lengths else 0.0
    num = sum(e.num_pending for e in rollout)
    prompt = sum(e.tokens_pending for e in rollout) / num if num else 0.0
    return held, prompt + response
