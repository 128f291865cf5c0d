"""One GRPO iteration over the real world's handles, reported to the controller.

The maths is the torch reference loop's (``InprocessLoop``): the same prompts, request seeds,
rewards, group advantages, minibatch split and loss; only where it runs differs.
Requests go through the data router to the rollout engines (which route, drain and
requeue them with their partial output); finished responses are rewarded by an
:class:`~dynarl.envs.verifier.AsyncVerifier` and scored for old log-probs by the
inference instances as they arrive; then the actor takes ``n_minibatches`` optimizer
steps and the engines get the new weights. With ``algorithm.minibatch_order=completion``
the actor instead steps on whole groups in the order they finish, during the rollout
tail (a different data order from the in-process loop's). Each step waits for the actor
to hold devices and for any move of them to end: moves happen between steps.

Every step is reported to the controller as events (``IterationStarted``,
``ItemsEnqueued``, ``ItemRouted``, ``ItemCompleted``, ``TrainStepDone``,
``IterationDone``; the router reports its own routing, ``EngineStats`` and failures), so
the hypergraph and the scheduler see the run as it happens.
"""

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np

from dynarl.api.config import DynaRLConfig
from dynarl.api.world import RealWorld
from dynarl.control import events as ev
from dynarl.control.elements import Node
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import ACTOR, INFERENCE, PROMPTS, TO_ACTOR, TO_INFERENCE
from dynarl.core.ids import ComponentId, EdgeId, GroupId, ItemId
from dynarl.data.wire import Item
from dynarl.envs.prompts import Prompt, PromptSampler
from dynarl.envs.verifier import AsyncVerifier
from dynarl.obs.metrics import IterationStats
from dynarl.rl.batch import (
    Trajectory,
    from_completion,
    minibatch_indices,
    to_arrays,
    with_advantages,
)
from dynarl.rl.requests import group_requests, prompt_ids, response_text
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.rollout import Completion, GenerateRequest

logger = logging.getLogger(__name__)

Emit = Callable[[ev.Event], None]

_DECODER = msgspec.msgpack.Decoder(Completion)
_ENCODER = msgspec.msgpack.Encoder()


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Where the running iteration is (for a progress display).

    Attributes:
        iteration: 0-based index.
        stage: ``rollout``, ``train`` or ``sync``.
        done, total: responses finished out of those requested (rollout), or
            optimizer steps taken out of ``n_minibatches`` (train).
    """

    iteration: int
    stage: str
    done: int
    total: int


class GrpoIteration:
    """Runs iterations over a :class:`RealWorld`.

    Args:
        cfg: the run's configuration.
        world: the started workers.
        graph: the controller's hypergraph (read only: which instances are active).
        emit: where events go (the controller).
        sampler: where prompts come from.
        verifier: the reward rule, run off the event loop.
        tokenizer: encodes prompts and decodes responses (the model's).
        on_progress: sees the iteration's progress as it happens.
    """

    def __init__(
        self,
        cfg: DynaRLConfig,
        world: RealWorld,
        graph: Hypergraph,
        *,
        emit: Emit,
        sampler: PromptSampler,
        verifier: AsyncVerifier,
        tokenizer: Any,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.world = world
        self.graph = graph
        self.emit = emit
        self.sampler = sampler
        self.verifier = verifier
        self.tokenizer: Any = tokenizer  # transformers' (kept untyped: no torch here)
        self.on_progress = on_progress or (lambda p: None)
        self.groups: dict[ItemId, GroupId] = {}
        """Group of every item of the running iteration (for the event bridge)."""
        self.uses_inference = bool(graph.components[INFERENCE].instances) or (
            cfg.scheduler.mode != "static-disaggregated"
        )
        """Whether old log-probs come from inference instances (else the engines')."""
        self._train_s = 0.0

    def downstream(self) -> EdgeId:
        """The edge finished rollout items go to next."""
        return TO_INFERENCE if self.uses_inference else TO_ACTOR

    async def run(self, iteration: int) -> IterationStats:
        """Run iteration ``iteration`` and return what it measured."""
        algo = self.cfg.algorithm
        started = time.perf_counter()
        stage_s: dict[str, float] = {}
        self.emit(ev.IterationStarted(iteration=iteration))
        prompts = self.sampler.take(algo.num_prompts)
        requests = self._requests(prompts, iteration)
        group_of = {r.request_id: i // algo.group_size for i, r in enumerate(requests)}
        self.groups = {
            ItemId(r.request_id): GroupId(f"{iteration}/{group_of[r.request_id]}") for r in requests
        }
        items = [
            Item(
                id=ItemId(r.request_id),
                group=self.groups[ItemId(r.request_id)],
                edge=PROMPTS,
                payload=_ENCODER.encode(r),
                tokens=len(r.prompt_ids),
            )
            for r in requests
        ]
        completions: dict[str, Completion] = {}
        rewards: dict[str, float] = {}
        old_logprobs: dict[str, tuple[float, ...]] = {}
        # Wall time during which some chunk was being scored (chunks overlap).
        num_scoring, scoring_since, score_s = 0, 0.0, 0.0

        # Groups whose every sample is rewarded and scored, in the order they finish.
        unscored = dict.fromkeys(range(algo.num_prompts), algo.group_size)
        send_ready, receive_ready = anyio.create_memory_object_stream[int](algo.num_prompts)
        losses: list[float] = []
        norms: list[float] = []
        self._train_s = 0.0

        def trajectories_of(groups: Sequence[int]) -> tuple[list[Trajectory], list[ItemId]]:
            chosen = [r for r in requests if group_of[r.request_id] in set(groups)]
            trajectories = with_advantages(
                [
                    msgspec.structs.replace(
                        from_completion(
                            completions[r.request_id],
                            group_id=group_of[r.request_id],
                            reward=rewards[r.request_id],
                        ),
                        old_logprobs=old_logprobs[r.request_id],
                    )
                    for r in chosen
                ]
            )
            return trajectories, [ItemId(r.request_id) for r in chosen]

        async def score(chunk: list[Completion]) -> None:
            nonlocal num_scoring, scoring_since, score_s
            if not num_scoring:
                scoring_since = time.perf_counter()
            num_scoring += 1
            texts = [response_text(self.tokenizer, c) for c in chunk]
            pairs = [
                (prompts[group_of[c.request_id]], t) for c, t in zip(chunk, texts, strict=True)
            ]
            values = await self.verifier.score_many(pairs)
            rewards.update((c.request_id, v) for c, v in zip(chunk, values, strict=True))
            old_logprobs.update(await self._old_logprobs(chunk))
            num_scoring -= 1
            if not num_scoring:
                score_s += time.perf_counter() - scoring_since
            for c in chunk:
                unscored[group_of[c.request_id]] -= 1
                if not unscored[group_of[c.request_id]]:
                    send_ready.send_nowait(group_of[c.request_id])

        async def train_as_groups_finish() -> None:
            """``minibatch_order=completion``: a minibatch of whole groups as soon as
            that many have finished, while the rollout tail still runs."""
            per_step = algo.num_prompts // algo.n_minibatches
            finished: list[int] = []
            async with receive_ready:
                async for group in receive_ready:
                    finished.append(group)
                    if len(finished) % per_step == 0:
                        step = len(finished) // per_step - 1
                        part = finished[-per_step:]
                        loss, norm = await self._train_step(iteration, step, *trajectories_of(part))
                        losses.append(loss)
                        norms.append(norm)
                        if step + 1 == algo.n_minibatches:
                            return

        streaming = algo.minibatch_order == "completion"
        await self.world.router.submit(items)
        # Both ends close however the rollout ends (the trainer task may close its end
        # first); the task group is left before them.
        async with send_ready, receive_ready, anyio.create_task_group() as tg:
            if streaming:
                tg.start_soon(train_as_groups_finish)
            while len(completions) < len(items):
                chunk = []
                for done in await self.world.router.receive_batch():
                    completion = _DECODER.decode(done.result.payload)
                    completions[completion.request_id] = completion
                    chunk.append(completion)
                if chunk:
                    tg.start_soon(score, chunk)
                self.on_progress(
                    Progress(
                        iteration=iteration,
                        stage="rollout",
                        done=len(completions),
                        total=len(items),
                    )
                )
            stage_s["rollout"] = time.perf_counter() - started
        stage_s["score"] = score_s

        ordered = [completions[r.request_id] for r in requests]
        if not streaming:
            trajectories, ids = trajectories_of(range(algo.num_prompts))
            parts = minibatch_indices(
                len(trajectories), algo.n_minibatches, seed=[self.cfg.run.seed, iteration]
            )
            for step, part in enumerate(parts):
                loss, norm = await self._train_step(
                    iteration,
                    step,
                    [trajectories[int(i)] for i in part],
                    [ids[int(i)] for i in part],
                )
                losses.append(loss)
                norms.append(norm)
        stage_s["train"] = self._train_s
        t0 = time.perf_counter()
        self.on_progress(Progress(iteration=iteration, stage="sync", done=0, total=1))
        await self.world.sync_weights(iteration + 1)
        stage_s["sync"] = time.perf_counter() - t0
        self.emit(ev.IterationDone(iteration=iteration))

        elapsed = time.perf_counter() - started
        reward_values = np.array([rewards[r.request_id] for r in requests])
        gen_tokens = sum(len(c.output_ids) for c in ordered)
        return IterationStats(
            iteration=iteration,
            mean_reward=float(reward_values.mean()),
            solved_fraction=float(np.mean(reward_values >= 1.0)),
            num_samples=len(ordered),
            gen_tokens=gen_tokens,
            mean_response_tokens=gen_tokens / len(ordered),
            tokens_per_s=gen_tokens / elapsed,
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(norms)),
            weight_version=iteration + 1,
            stage_s=stage_s,
            elapsed_s=elapsed,
        )

    # ------------------------------------------------------------------ stages

    def _requests(self, prompts: Sequence[Prompt], iteration: int) -> list[GenerateRequest]:
        # The in-process loop's requests, so both loops sample the same way.
        cfg = self.cfg
        ids = [prompt_ids(self.tokenizer, p) for p in prompts]
        return group_requests(
            cfg.algorithm, cfg.rollout, ids, seed=cfg.run.seed, iteration=iteration
        )

    async def _old_logprobs(
        self, chunk: Sequence[Completion]
    ) -> list[tuple[str, tuple[float, ...]]]:
        """The behaviour policy's log-probs of ``chunk``: from an inference instance
        (reported as the inference stage), or the engines' own."""
        if not self.uses_inference:
            return [(c.request_id, c.output_logprobs) for c in chunk]
        with anyio.fail_after(600):
            # Inference holds no devices now (a migration is moving some): wait.
            while not (active := self._active(INFERENCE)):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        target = min(active, key=lambda n: (len(n.items), n.id))
        handle = self.world.inference[target.id]
        for c in chunk:
            self.emit(
                ev.ItemRouted(edge=TO_INFERENCE, item=ItemId(c.request_id), instance=target.id)
            )
        with self.world.scoring(target.id):  # a migration releases it only after
            results = await handle.score(
                [
                    LogprobRequest(
                        item_id=c.request_id,
                        token_ids=c.prompt_ids + c.output_ids,
                        response_start=len(c.prompt_ids),
                    )
                    for c in chunk
                ]
            )
        refs = tuple(
            ev.ItemRef(
                ItemId(c.request_id),
                self.groups[ItemId(c.request_id)],
                len(c.prompt_ids) + len(c.output_ids),
            )
            for c in chunk
        )
        self.emit(ev.ItemsEnqueued(edge=TO_ACTOR, items=refs))
        for c in chunk:
            self.emit(
                ev.ItemCompleted(edge=TO_INFERENCE, item=ItemId(c.request_id), instance=target.id)
            )
        return [(r.item_id, tuple(r.logprobs)) for r in results]

    async def _train_step(
        self,
        iteration: int,
        step: int,
        minibatch: Sequence[Trajectory],
        ids: Sequence[ItemId],
    ) -> tuple[float, float]:
        """Optimizer step ``step`` on ``minibatch`` once the actor holds devices and no
        move of them is under way; returns its loss and gradient norm."""
        algo = self.cfg.algorithm
        trainer = self.world.trainer
        assert trainer is not None, "start the world first"
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        self.on_progress(
            Progress(iteration=iteration, stage="train", done=step, total=algo.n_minibatches)
        )
        actors = await self._actor_ready()
        self.world.trainer_ahead = True
        batch = list(ids)
        for k, item in enumerate(batch):
            self.emit(ev.ItemRouted(edge=TO_ACTOR, item=item, instance=actors[k % len(actors)].id))
        t0 = time.perf_counter()
        metrics = await trainer.train_step(to_arrays(minibatch, pad_token_id=pad))
        duration = time.perf_counter() - t0
        self._train_s += duration
        for item in batch:
            owner = self.graph.edges[TO_ACTOR].items[item].owner
            if owner is not None:
                self.emit(ev.ItemCompleted(edge=TO_ACTOR, item=item, instance=owner))
        self.emit(
            ev.TrainStepDone(
                component=ACTOR,
                step=step,
                num_steps=algo.n_minibatches,
                num_samples=len(batch),
                duration_s=duration,
            )
        )
        return metrics.loss, metrics.grad_norm

    async def _actor_ready(self) -> list[Node]:
        """The actor's instances, once it has some, no move of its devices is under way
        (a move decided at the last step boundary goes before the next step) and the
        controller does not hold it (devices are on their way to it)."""
        with anyio.fail_after(600):
            while True:
                moving = any(ACTOR in (m.src, m.dst) for m in self.graph.migrations.values())
                actors = self._active(ACTOR)
                if actors and not moving and not self.graph.components[ACTOR].hold_steps:
                    return actors
                await anyio.sleep(0.02)

    def _active(self, component: ComponentId) -> list[Node]:
        node = self.graph.components.get(component)
        return [] if node is None else sorted(node.active_instances(), key=lambda n: n.id)
