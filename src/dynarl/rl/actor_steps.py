"""The actor's part of one iteration: its optimizer steps on finished groups.

A step waits for the :class:`~dynarl.rl.gate.StepGate`, sends its samples through the
data router to the trainer's ranks (each to the rank whose data-parallel shard holds
it, :mod:`dynarl.workers.trainer_items`), lets the ranks train on them, and is over
once the router has every sample back. Steps are taken on whole groups in the order
they finish (``algorithm.minibatch_order=completion``, during the rollout tail) or over
the whole iteration in a seeded split (``seeded``, the maths of the torch reference
loop). A trainer that loses a rank mid-step rebuilds itself from the survivors and the
step is re-run on them, or only completed if it was applied.
"""

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import anyio
from anyio.abc import ObjectReceiveStream

from dynarl.control import events as ev
from dynarl.control.topology import ACTOR, TO_ACTOR
from dynarl.core.ids import GroupId, ItemId
from dynarl.data.router import Router
from dynarl.rl.batch import Trajectory, minibatch_indices, to_arrays
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.gate import StepGate
from dynarl.rl.progress import Progress, Weights
from dynarl.rl.reporter import EventReporter
from dynarl.rl.samples import Samples
from dynarl.workers.errors import TrainerError, TrainerRecoveredError
from dynarl.workers.trainer import StepMetrics, Trainer
from dynarl.workers.trainer_items import shard_items

logger = logging.getLogger(__name__)


class ActorSteps:
    """One iteration's optimizer steps and what they measured.

    Args:
        iteration: the iteration's 0-based index.
        algorithm: minibatches and their order.
        seed: the run's seed (the seeded split).
        trainer: the actor.
        router: carries each step's samples to the trainer's ranks and back.
        gate: says when the actor may step.
        weights: told that the trainer moves past the engines' weights.
        reporter: where each step's :class:`~dynarl.control.events.TrainStepDone` goes.
        group_of: each sample's router group.
        pad_token_id: pads the minibatch arrays.
        on_progress: sees each step start.
    """

    def __init__(
        self,
        *,
        iteration: int,
        algorithm: AlgorithmConfig,
        seed: int,
        trainer: Trainer,
        router: Router,
        gate: StepGate,
        weights: Weights,
        reporter: EventReporter,
        group_of: Mapping[str, GroupId],
        pad_token_id: int,
        on_progress: Callable[[Progress], None],
    ) -> None:
        self.iteration = iteration
        self.algorithm = algorithm
        self.seed = seed
        self.trainer = trainer
        self.router = router
        self.gate = gate
        self.weights = weights
        self.reporter = reporter
        self.group_of = group_of
        self.pad_token_id = pad_token_id
        self.on_progress = on_progress
        self.busy_s = 0.0
        """Seconds the steps took, from sending their samples to having them back."""
        self.losses: list[float] = []
        self.norms: list[float] = []
        self._training: set[ItemId] = set()  # the running step's samples not back yet
        self._trained = anyio.Event()

    def delivered(self, ids: Iterable[ItemId]) -> None:
        """The router delivered these samples back from the trainer's ranks."""
        self._training.difference_update(ids)
        if not self._training:
            self._trained.set()

    async def run(self, ready: ObjectReceiveStream[int], samples: Samples) -> None:
        """Take the iteration's steps as ``ready`` hands out the groups it trains
        (``num_prompts`` of them), each once complete."""
        algo = self.algorithm
        finished: list[int] = []
        per_step = algo.num_prompts // algo.n_minibatches
        async with ready:
            async for group in ready:
                finished.append(group)
                if algo.minibatch_order == "completion" and len(finished) % per_step == 0:
                    await self._step(
                        len(finished) // per_step - 1, *samples.trajectories(finished[-per_step:])
                    )
        if algo.minibatch_order == "completion":
            return
        trajectories, ids = samples.trajectories(finished)
        seed = [self.seed, self.iteration]
        for step, part in enumerate(
            minibatch_indices(len(trajectories), algo.n_minibatches, seed=seed)
        ):
            chosen = [int(i) for i in part]
            await self._step(step, [trajectories[i] for i in chosen], [ids[i] for i in chosen])

    async def _step(
        self, step: int, minibatch: Sequence[Trajectory], ids: Sequence[ItemId]
    ) -> None:
        """Optimizer step ``step`` on ``minibatch`` once the gate opens."""
        num_steps = self.algorithm.n_minibatches
        self.on_progress(
            Progress(iteration=self.iteration, stage="train", done=step, total=num_steps)
        )
        await self.gate.wait()
        self.weights.trainer_moves_ahead()
        arrays = to_arrays(minibatch, pad_token_id=self.pad_token_id)
        groups = [self.group_of[i] for i in ids]
        ranks = self.trainer.rank_instances()
        items, shards = shard_items(arrays, ids, groups, ranks, edge=TO_ACTOR)
        self._training, self._trained = set(ids), anyio.Event()
        t0 = time.perf_counter()
        await self.router.submit(items)
        metrics = await self._train_step(shards, ids)
        await self._trained.wait()
        duration = time.perf_counter() - t0
        self.busy_s += duration
        self.losses.append(metrics.loss)
        self.norms.append(metrics.grad_norm)
        self.reporter(
            ev.TrainStepDone(
                component=ACTOR,
                step=step,
                num_steps=num_steps,
                num_samples=len(ids),
                duration_s=duration,
            )
        )

    async def _train_step(
        self, shards: list[tuple[str, ...]], ids: Sequence[ItemId]
    ) -> StepMetrics:
        """The trainer's step on ``shards``; if it loses a rank meanwhile it rebuilds
        itself from the survivors, and the step is re-run on them (every sample the
        router holds for the step, at the rank holding it: the lost rank's went to the
        others), or only completed if the recovery found it applied."""
        trainer = self.trainer
        for _ in range(len(shards) + 1):
            try:
                return await trainer.train_step(shards)
            except TrainerRecoveredError as recovered:
                recovery = recovered.recovery
                logger.warning("%s; the step runs again on the survivors", recovered)
            where = self.router.holders(i for i in ids if i in self._training)
            ranks = trainer.rank_instances()
            strays = {i: at for i, at in where.items() if at not in ranks}
            if strays or len(where) != len(self._training):
                raise TrainerError(
                    f"after the trainer lost a rank, samples of the step are not at its "
                    f"ranks {ranks}: {strays or sorted(self._training - where.keys())}"
                )
            shards = [tuple(i for i in ids if where.get(i) == rank) for rank in ranks]
            if recovery.step_applied and recovery.last_step is not None:
                await trainer.finish_step(shards)
                return recovery.last_step
        raise TrainerError(f"the trainer lost {len(shards)} ranks in one step; giving up")
