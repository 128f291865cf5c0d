"""Property tests: random valid event sequences never break the hypergraph's
invariants, and plans never assign a device twice or lose one."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dynarl.control import events as ev
from dynarl.control.elements import TOOL
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.planner import PlanBuilder
from dynarl.control.topology import PROMPTS
from dynarl.core.errors import EventError
from dynarl.core.ids import ComponentId, EdgeId, GroupId, InstanceId, ItemId

from .graphs import make_graph

COMPONENTS = [ComponentId(c) for c in ("rollout", "inference", "actor")]


class HypergraphMachine(RuleBasedStateMachine):
    """Drives a hypergraph with random events that a correct world could send."""

    def __init__(self) -> None:
        super().__init__()
        self.g: Hypergraph = make_graph()
        self.serial = 0
        self.now = 0.0
        self.completed: set[ItemId] = set()
        self.withdrawn: dict[ItemId, int] = {}

    @initialize(
        rollout=st.integers(0, 6),
        inference=st.integers(0, 3),
        actor=st.sampled_from([0, 1, 2, 4]),
        free=st.integers(0, 3),
        rollout_tp=st.sampled_from([1, 2]),
    )
    def build(self, rollout: int, inference: int, actor: int, free: int, rollout_tp: int) -> None:
        self.g = make_graph(
            rollout=rollout - rollout % rollout_tp,
            inference=inference,
            actor=actor,
            free=free,
            rollout_tp=rollout_tp,
        )

    def tick(self) -> float:
        self.now += 0.5
        return self.now

    @invariant()
    def invariants_hold(self) -> None:
        self.g.check()
        total = self.g.num_devices
        held = sum(len(n.devices) for n in self.g.instances.values())
        in_transit = sum(
            1
            for m in self.g.migrations.values()
            for d in m.devices
            if self.g.device_owner.get(d) == m.id
        )
        assert held + in_transit + len(self.g.free_devices) == total

    @rule(
        edge=st.sampled_from([EdgeId(e) for e in ("prompts", "to_inference", "to_actor")]),
        n=st.integers(1, 5),
    )
    def enqueue(self, edge: EdgeId, n: int) -> None:
        items = []
        for _ in range(n):
            self.serial += 1
            items.append(ev.ItemRef(ItemId(f"x{self.serial}"), GroupId(f"g{self.serial // 3}")))
        self.g.apply(ev.ItemsEnqueued(edge=edge, items=tuple(items), time_s=self.tick()))

    @precondition(lambda self: bool(self.withdrawn))
    @rule(data=st.data())
    def carry_over(self, data: st.DataObject) -> None:
        """Withdrawn items come back (the next iteration), with their progress."""
        items = data.draw(
            st.lists(st.sampled_from(sorted(self.withdrawn)), unique=True, min_size=1)
        )
        generated = tuple(self.withdrawn.pop(i) for i in items)
        refs = tuple(ev.ItemRef(i, GroupId("carried")) for i in items)
        self.g.apply(
            ev.ItemsEnqueued(edge=PROMPTS, items=refs, generated=generated, time_s=self.tick())
        )

    @rule(data=st.data(), generated=st.integers(0, 5000))
    def withdraw(self, data: st.DataObject, generated: int) -> None:
        """A partial rollout's end takes pending requests out, wherever they are."""
        pending = sorted(self.g.edges[PROMPTS].items)
        if pending:
            items = data.draw(st.lists(st.sampled_from(pending), unique=True, min_size=1))
            counts = tuple(generated + k for k in range(len(items)))
            self.g.apply(
                ev.ItemsWithdrawn(
                    edge=PROMPTS, items=tuple(items), generated=counts, time_s=self.tick()
                )
            )
            self.withdrawn.update(zip(items, counts, strict=True))

    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        options = [
            (e.id, item, n.id)
            for e in self.g.edges.values()
            for item in list(e.queue)[:3]
            for c in e.spec.consumers
            for n in self.g.components[c].active_instances()
        ]
        if options:
            edge, item, inst = data.draw(st.sampled_from(options))
            self.g.apply(ev.ItemRouted(edge=edge, item=item, instance=inst, time_s=self.tick()))

    def held(self) -> list[tuple[EdgeId, ItemId, InstanceId]]:
        return [
            (edge, item, n.id) for n in self.g.instances.values() for item, edge in n.items.items()
        ]

    @rule(data=st.data(), tokens=st.integers(0, 100))
    def complete(self, data: st.DataObject, tokens: int) -> None:
        if held := self.held():
            edge, item, inst = data.draw(st.sampled_from(held))
            self.g.apply(
                ev.ItemCompleted(
                    edge=edge, item=item, instance=inst, num_tokens=tokens, time_s=self.tick()
                )
            )
            self.completed.add(item)

    @rule(data=st.data(), generated=st.none() | st.integers(0, 5000))
    def requeue(self, data: st.DataObject, generated: int | None) -> None:
        if held := self.held():
            edge, item, _ = data.draw(st.sampled_from(held))
            counts = () if generated is None else (generated,)
            self.g.apply(
                ev.ItemsRequeued(edge=edge, items=(item,), generated=counts, time_s=self.tick())
            )

    @rule(data=st.data())
    def tool_call(self, data: st.DataObject) -> None:
        held = [h for h in self.held() if h[0] == PROMPTS]
        if held:
            edge, item, inst = data.draw(st.sampled_from(held))
            self.g.apply(
                ev.ToolCallStarted(edge=edge, item=item, instance=inst, time_s=self.tick())
            )

    @rule(data=st.data())
    def tool_return(self, data: st.DataObject) -> None:
        out = [i for i, s in self.g.edges[PROMPTS].items.items() if s.owner == TOOL]
        if out:
            item = data.draw(st.sampled_from(out))
            self.g.apply(ev.ToolCallFinished(edge=PROMPTS, item=item, time_s=self.tick()))

    @rule(data=st.data(), usage=st.floats(0, 1), running=st.integers(0, 4))
    def stats(self, data: st.DataObject, usage: float, running: int) -> None:
        if self.g.instances:
            inst = data.draw(st.sampled_from(sorted(self.g.instances)))
            self.g.apply(
                ev.EngineStats(
                    instance=inst,
                    kv_usage=usage,
                    num_running=running,
                    num_queued=0,
                    gen_tokens_per_s=10.0 * running,
                    time_s=self.tick(),
                )
            )

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        if self.g.instances:
            inst = data.draw(st.sampled_from(sorted(self.g.instances)))
            self.g.apply(ev.WorkerFailed(instance=inst, reason="test", time_s=self.tick()))

    @precondition(lambda self: len(self.g.migrations) < 3)
    @rule(
        src=st.sampled_from([None, *COMPONENTS]),
        dst=st.sampled_from([None, *COMPONENTS]),
        drain=st.integers(0, 3),
        take_free=st.integers(0, 3),
    )
    def migrate(
        self, src: ComponentId | None, dst: ComponentId | None, drain: int, take_free: int
    ) -> None:
        # Instances already draining are not drainable again within another plan.
        builder = PlanBuilder(self.g)
        for m in self.g.migrations.values():
            builder._drained.update(m.drain)
        m = builder.move(src, dst, drain=drain, take_free=take_free)
        if m is None:
            return
        devices = [d for spec in m.create for d in spec.devices]
        assert len(devices) == len(set(devices)), "a plan assigns a device twice"
        assert set(devices) <= set(m.devices)
        self.g.apply(ev.MigrationStarted(migration=m, time_s=self.tick()))

    @rule(data=st.data(), ok=st.booleans())
    def finish_migration(self, data: st.DataObject, ok: bool) -> None:
        if self.g.migrations:
            mid = data.draw(st.sampled_from(sorted(self.g.migrations)))
            done = (
                ev.MigrationDone(migration=mid, time_s=self.tick())
                if ok
                else ev.MigrationFailed(migration=mid, reason="x", time_s=self.tick())
            )
            self.g.apply(done)

    @rule(item=st.integers(0, 50), inst=st.sampled_from(["rollout-0", "actor-0", "ghost"]))
    def garbage(self, item: int, inst: str) -> None:
        """An event a confused worker might send: rejected whole, or valid by chance."""
        event = ev.ItemCompleted(edge=PROMPTS, item=ItemId(f"x{item}"), instance=InstanceId(inst))
        st_ = self.g.edges[PROMPTS].items.get(ItemId(f"x{item}"))
        try:
            self.g.apply(event)
        except EventError:
            return
        assert st_ is not None and st_.owner == inst


TestHypergraph = HypergraphMachine.TestCase
TestHypergraph.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
