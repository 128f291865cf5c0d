"""A partial rollout's end as the control plane models it: the rollout runs until the
last group it needs completes -- every due group and the needed number of the others,
those expected soonest -- not until its longest request does."""

import pytest

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.partial_cut import rollout_cut
from dynarl.control.rollout_lengths import expected_longest_remaining
from dynarl.control.scoring import demands
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT, TO_INFERENCE
from dynarl.control.trainer_steps import steps_in_arrival_order
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .test_item_sizes import sized_graph

E0 = InstanceId("rollout-0")


def _group(g: Hypergraph, name: str, generated: tuple[int, int] = (0, 0)) -> list[ItemId]:
    """Two requests of group ``name``, queued, each carrying ``generated`` tokens."""
    refs = tuple(ev.ItemRef(ItemId(f"{name}{k}"), GroupId(name), 10) for k in range(2))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs, generated=generated))
    return [r.id for r in refs]


def _complete(g: Hypergraph, items: list[ItemId], lengths: tuple[int, ...]) -> None:
    for item, n in zip(items, lengths, strict=True):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=item, instance=E0))
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=item, instance=E0, num_tokens=n))


def _graph(*, partial: bool) -> tuple[Hypergraph, dict[str, list[ItemId]]]:
    """A finished iteration of four groups (their longest responses 100, 1,000, 3,000
    and 8,000 tokens), then five pending groups: ``a`` 900 tokens in, ``b`` and ``d``
    fresh, ``c`` 2,000 and 2,500 in, ``e`` 0 and 7,000 in; ``d`` due."""
    g = sized_graph()
    for name, lengths in (("w", (50, 100)), ("x", (500, 1000)), ("y", (3000, 2000))):
        _complete(g, _group(g, name), lengths)
    _complete(g, _group(g, "z"), (8000, 4000))
    g.apply(
        ev.IterationStarted(
            iteration=1,
            time_s=10.0,
            groups_to_complete=2 if partial else None,
            groups_due=(GroupId("d"),) if partial else (),
            group_size=2 if partial else 0,
        )
    )
    items = {
        "a": _group(g, "a", (900, 900)),
        "b": _group(g, "b"),
        "c": _group(g, "c", (2500, 2000)),
        "d": _group(g, "d"),
        "e": _group(g, "e", (7000, 0)),
    }
    return g, items


def test_the_rollout_ends_with_the_slowest_group_it_needs() -> None:
    g, _ = _graph(partial=True)
    cut = rollout_cut(g, ROLLOUT)
    assert cut is not None
    # A group's longest is the group maxima past its most advanced request, less its
    # least advanced: a 4,000 - 900, b and d 3,025, c 5,500 - 2,000, e 8,000.
    assert cut.groups == pytest.approx(
        {GroupId("a"): 3100.0, GroupId("b"): 3025.0, GroupId("d"): 3025.0}
    )
    assert cut.tokens == pytest.approx(3100.0)
    assert cut.share == pytest.approx(6 / 10)
    assert cut.tokens < expected_longest_remaining(g, ROLLOUT)
    # What the scheduler scores: the rollout until then, and only the needed groups'
    # samples flowing on.
    d = demands(g)
    assert d[ROLLOUT].longest == pytest.approx(cut.tokens)
    assert d[ROLLOUT].work == pytest.approx(cut.work)
    on_policy, _ = _graph(partial=False)
    full = demands(on_policy)
    assert d[INFERENCE].upstream < full[INFERENCE].upstream
    assert d[ROLLOUT].longest < full[ROLLOUT].longest


def test_a_due_group_is_needed_however_slow_and_does_not_count_as_one_of_the_others() -> None:
    g, items = _graph(partial=True)
    assert rollout_cut(g, ROLLOUT) is not None
    assert g.groups_needed(ROLLOUT) == 2
    _complete(g, items["b"], (3000, 10))
    assert g.groups_needed(ROLLOUT) == 1
    _complete(g, items["d"], (100, 20))  # due: the others still need one more
    assert g.groups_needed(ROLLOUT) == 1
    cut = rollout_cut(g, ROLLOUT)
    assert cut is not None and set(cut.groups) == {GroupId("a")}
    _complete(g, items["a"], (1000, 990))
    cut = rollout_cut(g, ROLLOUT)  # over: the rest are about to be withdrawn
    assert cut is not None and cut.tokens == 0.0 and not cut.groups
    assert demands(g)[ROLLOUT].longest == 0.0


def test_without_partial_rollouts_or_when_every_group_is_needed_the_usual_model_holds() -> None:
    g, _ = _graph(partial=False)
    assert g.groups_needed(ROLLOUT) is None and rollout_cut(g, ROLLOUT) is None
    g, _ = _graph(partial=True)
    g.apply(ev.IterationStarted(iteration=2, time_s=20.0, groups_to_complete=5))
    assert rollout_cut(g, ROLLOUT) is None  # five pending, five needed


def test_the_trainers_plan_keeps_a_group_handed_on_while_its_last_sample_is_reported() -> None:
    """A producer reports a finished sample on the next edge before it completes on
    rollout: for that moment its group is in both. It is whole (admitted), so the
    trainer's plan keeps it even where the cut would not choose it."""
    g = sized_graph(actor_steps=2, arrival_order=True)
    for name, lengths in (("w", (50, 100)), ("x", (500, 1000)), ("y", (3000, 2000))):
        _complete(g, _group(g, name), lengths)
    _complete(g, _group(g, "z"), (8000, 4000))
    g.apply(ev.IterationStarted(iteration=1, time_s=10.0, groups_to_complete=1))
    _group(g, "a", (2900, 2900))  # 5,500 - 2,900 left: sooner than s
    slow = _group(g, "s", (0, 0))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=slow[0], instance=E0))
    g.apply(ev.ItemCompleted(edge=PROMPTS, item=slow[0], instance=E0, num_tokens=10))
    refs = tuple(ev.ItemRef(i, GroupId("s"), 20) for i in slow)
    g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs))  # s1 still in rollout
    cut = rollout_cut(g, ROLLOUT)
    assert cut is not None and set(cut.groups) == {GroupId("a")}
    steps, ready = steps_in_arrival_order(g, ACTOR, 2)
    assert len(steps) == 2 and all(0.0 <= r <= 1.0 for r in ready)


def test_the_finished_samples_a_needed_group_holds_back_flow_on_with_it() -> None:
    """A sample of a group not yet admitted waits outside the pipeline (it is neither
    pending on rollout nor queued for scoring): the group's size says it is there, and
    it reaches scoring with its group."""
    g, items = _graph(partial=True)
    _complete(g, items["b"][:1], (3000,))  # b0 done, held until b1 is
    cut = rollout_cut(g, ROLLOUT)
    assert cut is not None and GroupId("b") in cut.groups
    assert cut.held == {GroupId("b"): 1.0}
    assert cut.sample_work == pytest.approx(10 + 3000)  # a prompt, a response so far
    # Scoring's upstream work counts b0 (without the group size it went missing).
    with_held = demands(g)[INFERENCE].upstream
    g.group_size = 0
    assert with_held - demands(g)[INFERENCE].upstream == pytest.approx(3010)
