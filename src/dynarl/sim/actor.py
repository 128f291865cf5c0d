"""The simulated trainer's side of :class:`~dynarl.sim.world.SimWorld`: group assembly
and optimizer steps.

Samples ready to train arrive one by one; a group joins the minibatch queue once all its
samples have arrived. An optimizer step takes a minibatch of whole groups (in arrival
order, or the real loop's seeded split when training waits for the whole iteration)
once enough are queued, spreads its samples over the actor's replicas and runs
for the :class:`~dynarl.sim.costs.ActorCost` time of their tokens on all the actor's
devices (an :class:`~dynarl.sim.stages.ActorStep`). No step starts while a migration
touches the actor (the trainer is resized only between steps), and a run that trains
after rollout holds its first step until the whole iteration's samples are in.
"""

import math
from collections.abc import Callable, Sequence

import anyio

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import ACTOR, TO_ACTOR
from dynarl.core.ids import GroupId, ItemId
from dynarl.rl.batch import minibatch_indices
from dynarl.rl.config import AlgorithmConfig
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.costs import attended_context
from dynarl.sim.metrics import WorldTotals
from dynarl.sim.stages import ActorStep


class SimActor:
    """The trainer: whole groups queued for minibatches, and the optimizer step running.

    Args:
        graph: the controller's hypergraph, read to see the actor's instances and the
            migrations under way.
        emit: where events go (``Controller.handle``).
        algorithm: the batch shape (groups, minibatches).
        cluster: the cost models (the actor's step time, padding, training order).
        tokens: a sample's length in tokens.
        totals: the world's counters (the steps' busy device-seconds go here).
    """

    def __init__(
        self,
        graph: Hypergraph,
        emit: Callable[[ev.Event], None],
        algorithm: AlgorithmConfig,
        *,
        cluster: ClusterModel,
        tokens: Callable[[ItemId], int],
        totals: WorldTotals,
    ) -> None:
        self.graph = graph
        self.emit = emit
        self.algorithm = algorithm
        self.cluster = cluster
        self.tokens = tokens
        self.totals = totals
        self._group_arrived: dict[GroupId, list[ItemId]] = {}
        self._ready: list[ItemId] = []  # samples of complete groups, arrival order
        self._step: ActorStep | None = None
        self._step_ended = anyio.Event()
        self.steps_done = 0
        self._split: list[list[ItemId]] = []  # the seeded order's minibatches, in turn
        self._split_seed = [0, 0]
        self.slowdown = 1.0  # the host's: a step takes this many times its alone time

    def begin_iteration(self, iteration: int, items: Sequence[ItemId] | None, seed: int) -> None:
        """A new iteration of ``items`` (in prompt order; ``None``: not known yet, a
        partial rollout's, split in arrival order once all are in). Training after
        rollout, its minibatches are the real loop's seeded split
        (``minibatch_order=seeded``: :func:`~dynarl.rl.batch.minibatch_indices` seeded by
        the run's seed and the iteration), so each step pads and pays for the samples a
        real step would."""
        self.steps_done = 0
        self._split = []
        self._split_seed = [seed, iteration]
        if self.cluster.train_after_rollout and items is not None:
            self._split = self._seeded_split(items)

    def _seeded_split(self, items: Sequence[ItemId]) -> list[list[ItemId]]:
        parts = minibatch_indices(len(items), self.algorithm.n_minibatches, seed=self._split_seed)
        return [[items[int(i)] for i in part] for part in parts]

    def arrived(self, item: ItemId, group: GroupId) -> None:
        """``item`` is ready to train; its group joins the minibatch queue once whole."""
        members = self._group_arrived.setdefault(group, [])
        members.append(item)
        if len(members) == self.algorithm.group_size:
            self._ready.extend(members)
            del self._group_arrived[group]

    def next_time(self) -> float:
        """When the running optimizer step ends (``inf`` if none runs)."""
        return self._step.end_s if self._step is not None else math.inf

    def finish(self, now: float) -> None:
        """End the running optimizer step if it is done by ``now``."""
        if self._step is not None and self._step.end_s <= now:
            self._step_done()

    def start(self, now: float) -> None:
        """Start the next optimizer step if a minibatch is ready and the trainer may run."""
        algo = self.algorithm
        per_step = algo.samples_per_minibatch
        if self._step is not None or len(self._ready) < per_step:
            return
        if any(ACTOR in (m.src, m.dst) for m in self.graph.migrations.values()):
            return  # the trainer is told to pause at this boundary: it is being resized
        if self.graph.components[ACTOR].hold_steps:
            return  # the controller holds it: devices are on their way to it
        actors = sorted(self.graph.components[ACTOR].active_instances(), key=lambda n: n.id)
        if not actors or self.steps_done >= algo.n_minibatches:
            return
        if (
            self.cluster.train_after_rollout
            and self.steps_done == 0
            and len(self._ready) < algo.samples_per_iteration
        ):
            return
        if self.cluster.train_after_rollout and self.steps_done == 0 and not self._split:
            self._split = self._seeded_split(self._ready)
        if self._split:
            batch = self._split.pop(0)
            taken = set(batch)
            self._ready = [i for i in self._ready if i not in taken]
        else:
            batch, self._ready = self._ready[:per_step], self._ready[per_step:]
        routed = []
        for k, item in enumerate(batch):
            node = actors[k % len(actors)]
            self.emit(ev.ItemRouted(edge=TO_ACTOR, item=item, instance=node.id))
            routed.append((item, node.id))
        devices = sum(len(n.devices) for n in actors)
        tokens = [self.tokens(i) for i in batch]
        if self.cluster.padded_batches:  # every row padded to the longest: width / 2 each
            total, context = len(tokens) * max(tokens), max(tokens) / 2
        else:
            total, context = sum(tokens), attended_context(tokens)
        step_s = self.cluster.actor.step_time_s(total, devices, context)
        self._step = ActorStep(routed, now, now + step_s * self.slowdown, devices)

    def set_slowdown(self, factor: float, now: float) -> None:
        """From ``now`` on, optimizer steps take ``factor`` times their alone time (the
        running one, for what is left of it)."""
        if self._step is not None:
            self._step.stretch(factor / self.slowdown, now)
        self.slowdown = factor

    def busy_devices(self) -> int:
        """Devices the running optimizer step computes on (0 if none runs)."""
        return self._step.devices if self._step is not None else 0

    def _step_done(self) -> None:
        step = self._step
        assert step is not None
        for item, iid in step.items:
            self.emit(ev.ItemCompleted(edge=TO_ACTOR, item=item, instance=iid))
        self.totals.actor_device_s += step.device_s
        self.emit(
            ev.TrainStepDone(
                component=ACTOR,
                step=self.steps_done,
                num_steps=self.algorithm.n_minibatches,
                num_samples=len(step.items),
                duration_s=step.end_s - step.start_s,
            )
        )
        self.steps_done += 1
        self._step = None
        self._step_ended.set()
        self._step_ended = anyio.Event()

    async def step_boundary(self) -> None:
        """Return once no optimizer step runs (at once if none does)."""
        while self._step is not None:
            await self._step_ended.wait()
