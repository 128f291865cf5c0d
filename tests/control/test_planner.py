"""Instance-level decisions: what to drain, where requests go, valid sizes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dynarl.control import events as ev
from dynarl.control.planner import PlanBuilder, drain_order, redistribute
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, ROLLOUT, valid_dp_sizes
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .graphs import carry_out, make_graph


def test_redistribute_sends_largest_groups_first_to_the_least_loaded() -> None:
    groups = {
        GroupId("a"): [ItemId("a0"), ItemId("a1"), ItemId("a2")],
        GroupId("b"): [ItemId("b0")],
        GroupId("c"): [ItemId("c0"), ItemId("c1")],
    }
    out = dict(redistribute(groups, {InstanceId("e0"): 0, InstanceId("e1"): 1}))
    assert {out[ItemId(f"a{i}")] for i in range(3)} == {"e0"}  # largest to least loaded
    assert {out[ItemId("c0")], out[ItemId("c1")]} == {"e1"}  # next largest, e1 now lighter
    assert out[ItemId("b0")] == "e0"  # 3 vs 3: ties go to the first id
    assert sorted(out) == sorted(i for g in groups.values() for i in g)


@given(
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=20),
    loads=st.lists(st.integers(0, 10), min_size=1, max_size=6),
)
def test_redistribute_assigns_every_item_once_and_keeps_groups_whole(
    sizes: list[int], loads: list[int]
) -> None:
    groups = {
        GroupId(f"g{i}"): [ItemId(f"g{i}-{k}") for k in range(n)] for i, n in enumerate(sizes)
    }
    dests = {InstanceId(f"e{i}"): load for i, load in enumerate(loads)}
    out = redistribute(groups, dests)
    assert sorted(i for i, _ in out) == sorted(i for g in groups.values() for i in g)
    where = dict(out)
    for items in groups.values():
        assert len({where[i] for i in items}) == 1
    # LPT bound: no destination ends above the lightest by more than the largest group.
    final = dict(dests)
    for _, dest in out:
        final[dest] += 1
    assert max(final.values()) - min(final.values()) <= max(*sizes, max(loads) - min(loads))


def test_drain_order_releases_the_emptiest_engines_first() -> None:
    g = make_graph(rollout=3)
    g.apply(
        ev.ItemsEnqueued(
            edge=PROMPTS, items=tuple(ev.ItemRef(ItemId(f"i{k}"), GroupId("g")) for k in range(3))
        )
    )
    for item, inst in (("i0", "rollout-0"), ("i1", "rollout-0"), ("i2", "rollout-2")):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId(item), instance=InstanceId(inst)))
    order = [n.id for n in drain_order(list(g.components[ROLLOUT].active_instances()))]
    assert order == ["rollout-1", "rollout-2", "rollout-0"]


def test_move_reassigns_drained_requests_to_remaining_engines() -> None:
    g = make_graph(rollout=3, actor=1)
    g.apply(
        ev.ItemsEnqueued(
            edge=PROMPTS,
            items=tuple(ev.ItemRef(ItemId(f"i{k}"), GroupId(f"g{k // 2}")) for k in range(4)),
        )
    )
    for k in range(4):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId(f"i{k}"), instance=InstanceId("rollout-0")))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=(ev.ItemRef(ItemId("z"), GroupId("z")),)))
    g.apply(ev.ItemRouted(edge=PROMPTS, item=ItemId("z"), instance=InstanceId("rollout-1")))
    b = PlanBuilder(g)
    m = b.move(ROLLOUT, ACTOR, drain=1)
    assert m is not None and m.drain == ("rollout-2",)  # the empty engine goes first
    m2 = b.move(ROLLOUT, ACTOR, drain=1)
    assert m2 is not None and m2.drain == ("rollout-1",)
    assert dict(m2.reassign) == {"z": "rollout-0"}
    assert [s.id for s in m.create] == ["actor-1"]
    # A third replica would not divide the minibatch: the device goes to the free pool.
    assert m2.kind == "reshard" and m2.create == () and m2.dst is None


def test_actor_grows_only_to_valid_sizes() -> None:
    g = make_graph(rollout=5, inference=0, actor=1, actor_sizes=(1, 2, 4))
    b = PlanBuilder(g)
    assert b.grow_target(ACTOR, 5) == 4  # 6 would not divide the minibatch
    m = b.move(ROLLOUT, ACTOR, drain=5)
    assert m is not None and len(m.create) == 3
    assert g.components[ACTOR].spec.is_valid_size(b.instances(ACTOR))
    assert valid_dp_sizes(12, 8) == (1, 2, 3, 4, 6)
    assert valid_dp_sizes(12, 8, allow_uneven=True) == tuple(range(1, 9))


@settings(max_examples=80, deadline=None)
@given(
    rollout=st.integers(0, 6),
    inference=st.integers(0, 3),
    actor=st.sampled_from([1, 2, 4]),
    free=st.integers(0, 4),
    moves=st.lists(
        st.tuples(
            st.sampled_from([None, ROLLOUT, INFERENCE, ACTOR]),
            st.sampled_from([None, ROLLOUT, INFERENCE, ACTOR]),
            st.integers(0, 4),
            st.integers(0, 4),
        ),
        max_size=5,
    ),
)
def test_plans_never_assign_a_device_twice_or_lose_one(
    rollout: int, inference: int, actor: int, free: int, moves: list
) -> None:
    g = make_graph(rollout=rollout, inference=inference, actor=actor, free=free)
    b = PlanBuilder(g)
    for src, dst, drain, take in moves:
        b.move(src, dst, drain=drain, take_free=take)
    plan = b.build("random")
    moved = [d for m in plan.migrations for d in m.devices]
    assert len(moved) == len(set(moved))
    created = [d for m in plan.migrations for s in m.create for d in s.devices]
    assert len(created) == len(set(created))
    ids = [s.id for m in plan.migrations for s in m.create]
    assert len(ids) == len(set(ids)) and not set(ids) & set(g.instances)
    carry_out(g, plan)
    assert len(g.free_devices) + sum(len(n.devices) for n in g.instances.values()) == g.num_devices


def test_gather_completes_a_donors_devices_with_too_few_free_ones() -> None:
    """2 free devices cannot make a 4-device actor replica alone, nor can 3 rollout
    engines of 2 devices make 2 of them: together they make 2. With the 6 inference
    replicas of 4 devices that is exactly 8 more replicas."""
    g = make_graph(
        rollout=6,
        rollout_tp=2,
        inference=24,
        inference_tp=4,
        actor=4,
        actor_unit=4,
        actor_sizes=tuple(range(1, 10)),
        free=2,
    )
    assert len(g.free_devices) == 2
    b = PlanBuilder(g)
    before = b.instances(ACTOR)
    assert b.gather(ACTOR, before + 8, [ROLLOUT, INFERENCE])
    assert b.instances(ACTOR) == before + 8
    plan = b.build("gather")
    carry_out(g, plan)
    assert g.components[ACTOR].num_active == before + 8
    assert g.components[ACTOR].num_active_devices == 4 * (before + 8)
    assert g.components[ROLLOUT].num_active == g.components[INFERENCE].num_active == 0
    assert not g.free_devices


@given(
    actor=st.integers(1, 8),
    sizes=st.sets(st.integers(1, 8), max_size=4),
    drained=st.integers(0, 3),
    at_most=st.integers(-1, 9),
)
def test_shrink_target_is_the_largest_shrink_target_not_above_the_bound(
    actor: int, sizes: set[int], drained: int, at_most: int
) -> None:
    g = make_graph(rollout=1, inference=0, actor=actor, actor_sizes=tuple(sorted(sizes)))
    b = PlanBuilder(g, reassign=False)
    if drained:
        b.move(ACTOR, None, drain=min(drained, actor))
    for cid in (ACTOR, ROLLOUT):
        allowed = [k for k in b.shrink_targets(cid) if k <= at_most]
        assert b.shrink_target(cid, at_most) == max(allowed, default=None)


def test_drainable_limit_takes_the_first_in_drain_order() -> None:
    g = make_graph(rollout=4)
    b = PlanBuilder(g)
    whole = [n.id for n in b.drainable(ROLLOUT)]
    assert [n.id for n in b.drainable(ROLLOUT, 2)] == whole[:2]
    b.move(ROLLOUT, None, drain=1)
    assert [n.id for n in b.drainable(ROLLOUT, 2)] == whole[1:3]
    assert [n.id for n in b.drainable(ROLLOUT)] == whole[1:]
