"""Item sizes (``ItemRef.tokens``): once items carry sizes, the stages after rollout
measure their work in tokens; without sizes everything stays in item counts."""

import msgspec
import pytest

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.plan import InstanceSpec
from dynarl.control.rollout_lengths import expected_output_work
from dynarl.control.scoring import demands
from dynarl.control.topology import (
    ACTOR,
    INFERENCE,
    PROMPTS,
    ROLLOUT,
    TO_ACTOR,
    TO_INFERENCE,
    rl_pipeline,
)
from dynarl.core.errors import EventError, InvariantError
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, ItemId

from .graphs import make_graph


def sized_graph(
    *,
    actor_steps: int = 1,
    arrival_order: bool = False,
    expected_tokens: float = 256.0,
    inference: int = 1,
) -> Hypergraph:
    """Two rollout engines, ``inference`` inference replicas, one trainer replica (one
    device each)."""
    spec = rl_pipeline(
        rollout_tp=1,
        inference_tp=1,
        actor_devices_per_replica=1,
        actor_dp_sizes=(1, 2, 4),
        actor_steps_per_iteration=actor_steps,
        actor_steps_in_arrival_order=arrival_order,
    )
    names: list[tuple[ComponentId, str]] = [
        (ACTOR, "actor-0"),
        (ROLLOUT, "rollout-0"),
        (ROLLOUT, "rollout-1"),
        *((INFERENCE, f"inference-{k}") for k in range(inference)),
    ]
    placement: dict[ComponentId, list[InstanceSpec]] = {}
    for device, (cid, name) in enumerate(names):
        spec_i = InstanceSpec(id=InstanceId(name), devices=(DeviceId(device),))
        placement.setdefault(cid, []).append(spec_i)
    g = Hypergraph(
        spec,
        num_devices=len(names),
        placement=placement,
        expected_tokens_per_request=expected_tokens,
    )
    g.apply(ev.IterationStarted(iteration=0))
    return g


def put(g: Hypergraph, edge: EdgeId, sizes: list[int], prefix: str) -> list[ItemId]:
    """Enqueue one item per entry of ``sizes`` (its tokens) on ``edge``."""
    items = [ItemId(f"{prefix}{k}") for k in range(len(sizes))]
    refs = tuple(ev.ItemRef(i, GroupId(i), n) for i, n in zip(items, sizes, strict=True))
    g.apply(ev.ItemsEnqueued(edge=edge, items=refs))
    return items


def finish(g: Hypergraph, edge: EdgeId, item: ItemId, instance: str, tokens: int = 0) -> None:
    iid = InstanceId(instance)
    g.apply(ev.ItemRouted(edge=edge, item=item, instance=iid))
    g.apply(ev.ItemCompleted(edge=edge, item=item, instance=iid, num_tokens=tokens))


# --------------------------------------------------------------------- (a) sized


def test_sized_items_count_their_tokens_until_completed() -> None:
    g = make_graph()
    assert not g.sized
    a, b, c = put(g, TO_INFERENCE, [100, 300, 0], "s")
    assert g.sized  # latched by the first item with a size
    # A sample of unknown size (0) still counts as one token of work.
    assert g.edges[TO_INFERENCE].tokens_pending == 401
    assert g.work_pending(INFERENCE) == 401.0
    assert g.pending(INFERENCE) == 3
    g.check()

    node = g.components[INFERENCE]
    finish(g, TO_INFERENCE, a, "inference-0")
    assert g.work_pending(INFERENCE) == 301.0
    assert (node.work_completed, node.items_completed) == (100.0, 1)
    finish(g, TO_INFERENCE, b, "inference-1")
    assert g.work_pending(INFERENCE) == 1.0
    assert (node.work_completed, node.items_completed) == (400.0, 2)
    finish(g, TO_INFERENCE, c, "inference-0")
    assert g.work_pending(INFERENCE) == 0.0
    assert g.edges[TO_INFERENCE].tokens_pending == 0
    assert node.work_completed == 401.0
    g.check()


def test_rollout_work_completed_is_the_tokens_it_generated_not_the_prompt_size() -> None:
    g = make_graph()
    (p,) = put(g, PROMPTS, [50], "p")
    assert g.work_pending(ROLLOUT) == 50.0  # its requests' prompt tokens
    finish(g, PROMPTS, p, "rollout-0", tokens=700)
    assert g.components[ROLLOUT].work_completed == 700.0
    assert g.work_pending(ROLLOUT) == 0.0
    g.check()


def test_check_detects_a_corrupted_tokens_pending() -> None:
    g = make_graph()
    put(g, TO_ACTOR, [100, 200], "s")
    g.check()
    g.edges[TO_ACTOR].tokens_pending += 1
    with pytest.raises(InvariantError, match="tokens_pending"):
        g.check()


# --------------------------------------------------------------------- (b) unsized


def test_an_unsized_graph_keeps_item_counts() -> None:
    g = make_graph()
    g.apply(ev.IterationStarted(iteration=0))

    def refs(prefix: str, n: int) -> tuple[ev.ItemRef, ...]:
        return tuple(ev.ItemRef(ItemId(f"{prefix}{k}"), GroupId(prefix)) for k in range(n))

    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs("p", 4)))
    g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs("i", 3)))
    g.apply(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs("a", 2)))
    assert not g.sized
    for cid, count in ((ROLLOUT, 4), (INFERENCE, 3), (ACTOR, 2)):
        assert g.work_pending(cid) == count == g.pending(cid)
    assert expected_output_work(g, ROLLOUT) == 4.0

    d = demands(g)
    # Items flow through every stage: each stage's work is its own plus what is upstream.
    inf, act = d[INFERENCE], d[ACTOR]
    assert (inf.work, inf.load, inf.upstream, inf.tail) == (7.0, 7.0, 4.0, 1.0)
    assert (act.work, act.load, act.upstream, act.tail) == (9.0, 9.0, 7.0, 9.0)
    assert act.steps == ()

    finish(g, TO_INFERENCE, ItemId("i0"), "inference-0")
    assert g.components[INFERENCE].work_completed == 1.0
    g.check()


# --------------------------------------------------------------------- (c) negative


def test_a_negative_size_is_rejected_and_changes_nothing() -> None:
    g = make_graph()
    edge = g.edges[TO_INFERENCE]
    bad = (ev.ItemRef(ItemId("ok"), GroupId("g"), 10), ev.ItemRef(ItemId("bad"), GroupId("g"), -1))
    with pytest.raises(EventError, match="negative size"):
        g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=bad))
    assert not edge.items and not edge.queue
    assert (edge.tokens_pending, edge.num_enqueued, edge.enqueued_this_iteration) == (0, 0, 0)
    assert not g.sized  # the valid item before the bad one did not latch it either
    g.check()


def test_an_item_ref_without_a_size_decodes_with_size_zero() -> None:
    """Producers that predate sizes send ``[id, group]``."""
    ref = msgspec.json.decode(b'["i0", "g0"]', type=ev.ItemRef)
    assert ref == ev.ItemRef(ItemId("i0"), GroupId("g0"), 0)
    sized = msgspec.json.decode(msgspec.json.encode(ev.ItemRef(ItemId("i"), GroupId("g"), 7)))
    assert sized == ["i", "g", 7]


# --------------------------------------------------------------------- (d) demands


def test_demands_of_the_stages_after_rollout_are_in_tokens() -> None:
    g = sized_graph(expected_tokens=1000.0)
    r0, r1 = put(g, PROMPTS, [50, 70], "r")
    g.apply(ev.ItemRouted(edge=PROMPTS, item=r0, instance=InstanceId("rollout-0")))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=r1, instance=InstanceId("rollout-1")))
    # rollout-0 generates 40 tokens/s for 1 s: 40 tokens generated so far.
    e0 = InstanceId("rollout-0")
    g.apply(ev.EngineStats(instance=e0, kv_usage=0.1, num_running=1, num_queued=0, time_s=0.0))
    g.apply(
        ev.EngineStats(
            instance=e0,
            kv_usage=0.1,
            num_running=1,
            num_queued=0,
            gen_tokens_per_s=40.0,
            time_s=1.0,
        )
    )
    put(g, TO_INFERENCE, [300, 500], "s")
    put(g, TO_ACTOR, [1000], "a")

    # The rollout's two requests become samples of prompt + 40 so far + 1000 each to come.
    out = 50 + 70 + 40 + 2 * 1000.0
    assert expected_output_work(g, ROLLOUT) == pytest.approx(out)
    d = demands(g)
    inf, act = d[INFERENCE], d[ACTOR]
    assert inf.work == pytest.approx(800 + out)
    assert inf.upstream == pytest.approx(out)
    assert inf.load == 4  # the batch it runs stays a number of items
    assert inf.tail == pytest.approx(inf.work / 4)  # one (mean) item after the last arrives
    assert act.work == pytest.approx(1000 + 800 + out)
    assert act.upstream == pytest.approx(800 + out)
    assert act.load == 5
    assert act.tail == pytest.approx(act.work)  # one step left
    g.check()


# --------------------------------------------------------------------- (e) arrival order


def arrival_state(*, arrival_order: bool, sizes: bool = True) -> Hypergraph:
    """Short samples already at the trainer and inference, long requests still in
    rollout; four steps left, two samples each."""
    g = sized_graph(actor_steps=4, arrival_order=arrival_order, expected_tokens=2000.0)

    def at(n: int) -> int:
        return n if sizes else 0

    r0, r1 = put(g, PROMPTS, [at(50), at(50)], "r")
    g.apply(ev.ItemRouted(edge=PROMPTS, item=r0, instance=InstanceId("rollout-0")))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=r1, instance=InstanceId("rollout-1")))
    put(g, TO_INFERENCE, [at(300), at(400), at(500)], "s")
    put(g, TO_ACTOR, [at(80), at(100), at(120)], "a")
    g.check()
    return g


def test_steps_in_arrival_order_put_the_long_late_samples_in_the_last_step() -> None:
    g = arrival_state(arrival_order=True)
    d = demands(g)[ACTOR]
    # 8 samples (each its own group) in 4 steps of 2: the trainer's own 3, then
    # inference's 3, then rollout's 2 (50 + 2000 each, the prior's expected length).
    # Inference's count the pool's mean (400) each: which of them completes first is
    # not their queue order.
    assert d.steps == pytest.approx((80.0 + 100.0, 120.0 + 400.0, 400.0 + 400.0, 4100.0))
    assert all(a < b for a, b in zip(d.steps, d.steps[1:], strict=False))
    assert sum(d.steps) == pytest.approx(d.work)
    assert d.steps[-1] > d.work / 4  # far above the equal share (d.tail)
    # When each step's last sample arrives (a share of the time until inference ends):
    # here; inference's arrive evenly in work over it; a request still in rollout ends
    # at the median of the rollout's remaining time (no lengths seen yet: uniform).
    upstream = 1200.0 + 4100.0
    assert d.ready == pytest.approx((0.0, 300.0 / upstream, 1200.0 / upstream, 9 / 16))


def test_a_step_drawn_from_the_samples_between_rollout_and_trainer_holds_their_mean() -> None:
    """Groups whose last samples are at inference complete in no order of their size
    (many replicas side by side): a step filled from them is predicted at their mean,
    not at the smallest ones' that happen to be first in the queue."""
    g = sized_graph(actor_steps=4, arrival_order=True)
    put(g, PROMPTS, [50, 50], "r")
    put(g, TO_ACTOR, [100, 100], "a")  # two whole groups at the trainer: exact
    put(g, TO_INFERENCE, [10, 10, 990, 990], "s")  # the small ones first in the queue
    d = demands(g)[ACTOR]
    # The first step: the trainer's own two; the second: two of inference's four, at
    # their mean (not the queue's first two, 10 + 10).
    assert d.steps[:2] == pytest.approx((200.0, 1000.0))
    assert sum(d.steps) == pytest.approx(d.work)


def test_groups_at_a_stage_of_several_replicas_complete_in_no_order_of_its_queue() -> None:
    """One replica scores its samples in the order they came: a group is complete with
    its last one in the queue. Several do not keep that order (the data plane routes
    by count and moves queued samples to whichever runs out): a group of ``m`` samples
    there completes at the median of the latest of ``m`` uniform shares of the time."""

    def ready(replicas: int) -> tuple[float, ...]:
        g = sized_graph(actor_steps=2, arrival_order=True, inference=replicas)
        # Group A's two samples first in the queue, then B's one and C's one.
        groups = ("A", "A", "B", "C")
        refs = tuple(ev.ItemRef(ItemId(f"s{k}"), GroupId(n), 100) for k, n in enumerate(groups))
        g.apply(ev.ItemsEnqueued(edge=TO_INFERENCE, items=refs))
        for k, ref in enumerate(refs):
            iid = InstanceId(f"inference-{k % replicas}")
            g.apply(ev.ItemRouted(edge=TO_INFERENCE, item=ref.id, instance=iid))
        d = demands(g)[ACTOR]
        assert d.steps == pytest.approx((200.0, 200.0))
        return d.ready

    # In queue order: A complete halfway through inference's time, B and C at the end.
    assert ready(1) == pytest.approx((0.5, 1.0))
    # On two replicas: B and C (one sample each) at the median of one uniform share,
    # A (two) at the median of the later of two: B and C make the first step.
    assert ready(2) == pytest.approx((0.5, 0.5**0.5))


def test_a_step_waits_for_the_last_request_of_each_of_its_groups() -> None:
    g = sized_graph(actor_steps=2, arrival_order=True, expected_tokens=2000.0)
    group = {"a0": "A", "a1": "A", "b0": "B", "b1": "B", "c0": "C", "c1": "C"}

    def enqueue(edge: EdgeId, names: list[str]) -> None:
        refs = tuple(ev.ItemRef(ItemId(n), GroupId(group[n]), 100) for n in names)
        g.apply(ev.ItemsEnqueued(edge=edge, items=refs))

    enqueue(PROMPTS, ["b1", "c0", "c1"])
    enqueue(TO_ACTOR, ["a0", "a1", "b0"])
    d = demands(g)[ACTOR]
    # Three samples are here, a minibatch's worth, but group B's other request is in
    # rollout: the first step trains A and B, and starts when b1 ends.
    assert len(d.steps) == 2
    assert d.steps[0] == pytest.approx(300.0 + 100.0 + 2000.0)
    assert d.ready[0] == pytest.approx(9 / 16)  # b1: the median of one request
    # The second waits for both of C's: the median of the later of two.
    assert d.ready[1] == pytest.approx((int(0.5**0.5 * 16) + 1) / 16)


def test_without_arrival_order_or_sizes_the_steps_are_equal() -> None:
    assert demands(arrival_state(arrival_order=False))[ACTOR].steps == ()
    unsized = arrival_state(arrival_order=True, sizes=False)
    assert not unsized.sized
    assert demands(unsized)[ACTOR].steps == ()


def test_the_last_step_has_no_order_to_split() -> None:
    g = arrival_state(arrival_order=True)
    g.apply(ev.TrainStepDone(component=ACTOR, step=2, num_steps=4, num_samples=2, duration_s=1))
    assert demands(g)[ACTOR].steps == ()
