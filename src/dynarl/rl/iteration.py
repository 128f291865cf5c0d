"""One iteration of the pipeline driver (:mod:`dynarl.rl.pipeline`): its state and
its stage tasks, joined by memory object streams.

The router's results come in through one pump; the result stage sorts them by edge
(responses to the reward stage and, once their group is admitted, to the inference
stage; a multi-turn session's ended turn to its environment; log-probs and rewards to
the collector; trained samples to the actor's step waiting for them). The collector
hands each complete group the iteration trains to the actor
(:class:`~dynarl.rl.actor_steps.ActorSteps`); then the engines get the new weights.
Its :class:`~dynarl.rl.carry.IterationGroups` keeps the iteration's groups: which it
trains, where its rollout requests are, and what it carries over (partial rollouts).
"""

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import msgspec
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup, TaskStatus

from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, TO_INFERENCE
from dynarl.core.ids import GroupId, ItemId
from dynarl.data.placement import RoutedResult
from dynarl.data.router import Router
from dynarl.data.wire import Item
from dynarl.envs.config import EnvConfig
from dynarl.envs.environment import EnvironmentSpec
from dynarl.envs.prompts import PromptSampler
from dynarl.envs.verifier import AsyncVerifier
from dynarl.obs.metrics import IterationStats
from dynarl.rl.actor_steps import ActorSteps
from dynarl.rl.carry import CarryState, IterationGroups, fresh_groups
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode
from dynarl.rl.episode_runner import EpisodeRunner
from dynarl.rl.gate import StepGate
from dynarl.rl.iteration_stats import Measured, iteration_stats, trace_requests
from dynarl.rl.progress import Progress, Weights
from dynarl.rl.reporter import EventReporter
from dynarl.rl.requests import group_requests, prompt_ids, response_text
from dynarl.rl.routed_results import SplitResults, split_results
from dynarl.rl.samples import Rewarded, Samples, Scored
from dynarl.rl.trace import RunTrace
from dynarl.workers.config import RolloutConfig
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.rollout import GenerateRequest
from dynarl.workers.trainer import Trainer

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(GenerateRequest)

_Inbound = list[RoutedResult] | Episode
"""What the result stage hears: a batch of the router's results, or an episode the
runner finished (an empty batch: look again, e.g. whether to end the rollout)."""


class Driver(Protocol):
    """What an iteration uses of the driver that runs it
    (:class:`~dynarl.rl.pipeline.Pipeline`, whose arguments these are)."""

    algorithm: AlgorithmConfig
    rollout: RolloutConfig
    seed: int
    router: Router
    trainer: Trainer
    weights: Weights
    gate: StepGate
    reporter: EventReporter
    sampler: PromptSampler
    verifier: AsyncVerifier
    tokenizer: Any
    uses_inference: bool
    on_progress: Callable[[Progress], None]
    environment: EnvironmentSpec | None
    env: EnvConfig
    max_seq_len: int
    trace: RunTrace | None
    carried: CarryState
    """What the last iteration carried over (partial rollouts)."""
    runner: EpisodeRunner | None
    """Plays the episodes (with ``environment``), across iterations."""
    tasks: TaskGroup | None
    """Where the environments' steps run: the run's tasks, so that one still running
    at the iteration's end overlaps its weight sync (``None``: the iteration's own)."""


class Iteration:
    """One iteration's state and its stage tasks.

    Args:
        pipeline: the driver (its collaborators, and what the last iteration carried).
        iteration: the iteration's 0-based index.
    """

    def __init__(self, pipeline: Driver, iteration: int) -> None:
        self.p = pipeline
        self.iteration = iteration
        self.started = time.perf_counter()
        algo = pipeline.algorithm
        prompts = pipeline.sampler.take(fresh_groups(algo, pipeline.carried))
        if pipeline.environment is None:
            ids = [prompt_ids(pipeline.tokenizer, prompt) for prompt in prompts]
        else:  # an episode's first prompt is what its environment's reset says
            ids = [() for _ in prompts]
        requests = group_requests(
            algo, pipeline.rollout, ids, seed=pipeline.seed, iteration=iteration
        )
        size = algo.group_size
        runner = pipeline.runner
        self.groups = IterationGroups(
            algorithm=algo,
            carried=pipeline.carried,
            fresh=[
                (GroupId(f"{iteration}/{k}"), prompt, requests[k * size : (k + 1) * size])
                for k, prompt in enumerate(prompts)
            ],
            playing=frozenset() if runner is None else runner.parked,
        )
        if self.groups.restarted:
            logger.warning(
                "iteration %d: %d episodes carried over mid-session restart from their "
                "first turn (a checkpoint cannot hold a live environment; their groups' "
                "finished samples are kept)",
                iteration,
                len(self.groups.restarted),
            )
        self.prompts = self.groups.prompts
        self.requests = self.groups.rollout
        self.samples = Samples(self.groups.request_ids, size, needs_scores=pipeline.uses_inference)
        for episode, _ in self.groups.waiting:  # carried over finished: rewarded below
            self.samples.completed(episode)
        self.group_of = {
            rid: self.groups.group_ids[group] for rid, group in self.groups.group_of.items()
        }
        self.submitted = False  # every rollout request is with the router
        self.num_to_score = self.num_scored = self.num_trained = 0
        self.stage_s: dict[str, float] = {}
        self.actor = ActorSteps(
            iteration=iteration,
            algorithm=algo,
            seed=pipeline.seed,
            trainer=pipeline.trainer,
            router=pipeline.router,
            gate=pipeline.gate,
            weights=pipeline.weights,
            reporter=pipeline.reporter,
            group_of=self.group_of,
            pad_token_id=getattr(pipeline.tokenizer, "pad_token_id", None) or 0,
            on_progress=pipeline.on_progress,
        )
        self.carried_out = CarryState()
        """What it carries over to the next iteration (once run)."""
        self.trained: list[Episode] = []
        """The samples it trained, in request order (once run)."""
        self.runner: EpisodeRunner | None = None
        self.pump = anyio.CancelScope()  # the router's results into the result stage
        self.tg: TaskGroup | None = None

    async def run(self) -> IterationStats:
        """Run the iteration and return what it measured; what it carries over
        (:attr:`carried_out`) and the samples it trained (:attr:`trained`) are kept."""
        p, n = self.p, len(self.samples.ids)
        p.reporter.forget()
        responses_send, responses = anyio.create_memory_object_stream[list[Episode]](n)
        to_score_send, to_score = anyio.create_memory_object_stream[list[Episode]](n)
        facts_send, facts = anyio.create_memory_object_stream[Rewarded | Scored](2 * n)
        ready_send, ready = anyio.create_memory_object_stream[int](p.algorithm.num_prompts)
        inbox_send, inbox = anyio.create_memory_object_stream[_Inbound](n)
        if not p.uses_inference:
            to_score_send.close()
            to_score.close()
        runner = p.runner
        if runner is not None:
            responses_send.close()  # the environment rewards its episodes itself
            responses.close()
            runner.attach(inbox_send.clone())
        try:
            # Episodes start (their environments reset) before the iteration does, so
            # the controller sees all of rollout's work at once, as for single turns.
            first = [] if runner is None else await self._start_episodes(runner)
            p.reporter(self._started())
            async with anyio.create_task_group() as tg, inbox_send.clone() as wake:
                self.pump = await tg.start(self._pump, inbox_send)
                self.tg, self.runner = tg, runner
                tg.start_soon(
                    self._route_results, inbox, responses_send, to_score_send, facts_send.clone()
                )
                if runner is None:
                    tg.start_soon(self._reward, responses, facts_send.clone())
                if p.uses_inference:
                    tg.start_soon(self._to_inference, to_score)
                facts_send.close()
                tg.start_soon(self._collect, facts, ready_send)
                tg.start_soon(self.actor.run, ready, self.samples)
                await p.router.submit(self._request_items() if runner is None else first)
                self.submitted = True
                if self.groups.admission.over:
                    # The groups it trains were whole before every request was
                    # submitted: the result stage withdraws the rest now.
                    await wake.send([])
        finally:
            if runner is not None:
                runner.detach()
        self.stage_s["score"] = self.samples.busy_s
        self.stage_s["train"] = self.actor.busy_s
        completions, rewards = self.samples.completions, self.samples.rewards
        open_tokens: dict[str, int] = {}
        if runner is not None:  # episodes the rollout's end withdrew
            ended, open_tokens = runner.carried_over(self.groups.open)
            completions = {**completions, **ended}
            rewards = {**rewards, **{rid: e.reward or 0.0 for rid, e in ended.items()}}
        carried = self.groups.carry_out(completions, rewards, open_tokens)

        t0 = time.perf_counter()
        p.on_progress(Progress(iteration=self.iteration, stage="sync", done=0, total=1))
        await p.weights.sync_weights(self.iteration + 1)
        self.stage_s["sync"] = time.perf_counter() - t0
        p.reporter(ev.IterationDone(iteration=self.iteration))
        if p.trace is not None:
            trained = trace_requests(self.iteration, self.samples, self.groups)
            p.trace.record(self.iteration, trained)
        stats = iteration_stats(
            Measured(
                iteration=self.iteration,
                samples=self.samples,
                groups=self.groups,
                losses=self.actor.losses,
                norms=self.actor.norms,
                stage_s=self.stage_s,
                elapsed_s=time.perf_counter() - self.started,
                episodes=p.environment is not None,
                partial=p.algorithm.partial_rollouts,
            ),
            carried,
            completions,
            open_tokens,
        )
        self.carried_out = carried
        self.trained = [self.samples.completions[rid] for rid in self.groups.trained()]
        return stats

    def _started(self) -> ev.IterationStarted:
        """The iteration's start as the controller hears it: with partial rollouts,
        the groups its rollout must complete (the due ones, and how many others)."""
        if not self.p.algorithm.partial_rollouts:
            return ev.IterationStarted(iteration=self.iteration)
        admission, ids = self.groups.admission, self.groups.group_ids
        return ev.IterationStarted(
            iteration=self.iteration,
            groups_to_complete=admission.quota_left,
            groups_due=tuple(ids[k] for k in sorted(admission.due)),
            group_size=self.p.algorithm.group_size,
        )

    async def _start_episodes(self, runner: EpisodeRunner) -> list[Item]:
        """Reset every new episode's environment, all at once; their first turns' items,
        and the next turns' of the episodes carried over, which the runner kept."""
        first: list[Item | None] = [None] * len(self.requests)

        async def start(i: int, request: GenerateRequest) -> None:
            rid = request.request_id
            if runner.holds(rid):
                first[i] = runner.resume(rid)
                return
            prompt = self.prompts[self.samples.group_of[rid]]
            first[i] = await runner.start(request, prompt, self.group_of[rid])

        async with anyio.create_task_group() as tg:
            for i, request in enumerate(self.requests):
                tg.start_soon(start, i, request)
        return [item for item in first if item is not None]

    def _request_items(self) -> list[Item]:
        """The single-turn rollout requests as router items (a carried one holds its
        partial output, which the engine that takes it resumes from)."""
        return [
            Item(
                id=ItemId(r.request_id),
                group=self.group_of[r.request_id],
                edge=PROMPTS,
                payload=_ENCODER.encode(r),
                tokens=len(r.prompt_ids),
                generated=len(r.output_ids),
            )
            for r in self.requests
        ]

    # ------------------------------------------------------------------ stages

    async def _pump(
        self,
        inbox: ObjectSendStream[_Inbound],
        *,
        task_status: TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The router's results into the result stage's inbox, until cancelled."""
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async with inbox:
                while True:
                    await inbox.send(await self.p.router.receive_batch())

    async def _route_results(
        self,
        inbox: ObjectReceiveStream[_Inbound],
        responses: ObjectSendStream[list[Episode]],
        to_score: ObjectSendStream[list[Episode]],
        facts: ObjectSendStream[Rewarded | Scored],
    ) -> None:
        """The router's results, by edge: responses to the reward and inference
        stages, a multi-turn session's ended turn to its environment, log-probs to the
        collector (those streams close once every sample is through them), trained
        samples to the step that waits for them; until the iteration's last is in.
        Carried finished samples go first (their rewards, and their scores once their
        groups are admitted)."""
        p, runner = self.p, self.runner
        num_trained = p.algorithm.num_prompts * p.algorithm.group_size
        async with inbox, contextlib.AsyncExitStack() as upstream:
            for stream in (responses, to_score, facts):
                await upstream.enter_async_context(stream)
            if self.groups.waiting:
                await facts.send(Rewarded({e.request_id: r for e, r in self.groups.waiting}))
            await self._score(self.groups.score_first, to_score)
            while not (self._scored_all and self.num_trained == num_trained):
                got = await inbox.receive()
                if isinstance(got, Episode):
                    split = SplitResults([got], [], [], [], [])
                else:
                    split = split_results(got)
                for turn in split.turns:
                    assert runner is not None, "only episodes' turns go to environments"
                    assert self.tg is not None
                    if runner.is_withdrawn(str(turn.item.id)):  # it ended as it was recalled
                        self.groups.came_back_open(str(turn.item.id))
                    runner.turn_ended(turn, self.tg if p.tasks is None else p.tasks)
                for request in split.withdrawn:
                    if runner is None:
                        self.groups.came_back(request)
                    else:
                        runner.recalled(request)
                        self.groups.came_back_open(request.request_id)
                self.num_scored += len(split.scored)
                self.num_trained += len(split.trained)
                self.actor.delivered(split.trained)
                if split.responses:
                    await self._responded(split.responses, responses, to_score, facts)
                    p.on_progress(
                        Progress(
                            iteration=self.iteration,
                            stage="rollout",
                            done=len(self.samples.completions),
                            total=len(self.samples.ids),
                        )
                    )
                if split.scored:
                    await facts.send(Scored(tuple(split.scored)))
                if self.submitted:
                    self._withdraw_rest()
                if self.groups.rollout_over and "rollout" not in self.stage_s:
                    self.stage_s["rollout"] = time.perf_counter() - self.started
                if self._scored_all:
                    await upstream.aclose()  # every sample is through them
        self.pump.cancel()  # the iteration's last result is in

    @property
    def _scored_all(self) -> bool:
        """The rollout is over and every sample sent to be scored has its score."""
        return self.groups.rollout_over and self.num_scored == self.num_to_score

    def _withdraw_rest(self) -> None:
        """Once the groups the iteration trains are whole: the requests still out are
        withdrawn (those running come back through the router with their output), and
        the groups it does not train are set aside."""
        rest = self.groups.to_withdraw()
        if rest is None:
            return
        aside = self.groups.set_aside()
        self.samples.set_aside(aside)
        finished = [ItemId(rid) for k in aside for rid in self.samples.ids_of(k)]
        self.p.reporter.set_aside(
            PROMPTS, [rid for rid in finished if rid in self.samples.completions]
        )
        if not rest:
            return
        runner = self.p.runner
        if runner is not None:  # episodes park with the runner (EpisodeRunner.withdraw)
            for rid in runner.withdraw(rest):
                self.groups.came_back_open(rid)
            return
        for item in self.p.router.withdraw([ItemId(rid) for rid in rest]):
            self.groups.came_back(_REQUEST.decode(item.payload))

    async def _responded(
        self,
        chunk: list[Episode],
        responses: ObjectSendStream[list[Episode]],
        to_score: ObjectSendStream[list[Episode]],
        facts: ObjectSendStream[Rewarded | Scored],
    ) -> None:
        """Finished samples: to the verifier (single-turn) or rewarded by their
        environment, and, once their group is admitted, to inference. Admission is
        decided first, so no group is complete before the collector knows whether it
        is trained."""
        for sample in chunk:
            self.samples.completed(sample)
        scorable = self.groups.finished([e.request_id for e in chunk])
        if self.groups.withdrawn:  # finished after the rollout ended: carried over
            self.p.reporter.set_aside(PROMPTS, [ItemId(e.request_id) for e in chunk])
        if self.p.environment is None:
            await responses.send(chunk)
        else:
            await facts.send(Rewarded({e.request_id: e.reward or 0.0 for e in chunk}))
        await self._score(scorable, to_score)

    async def _score(
        self, request_ids: list[str], to_score: ObjectSendStream[list[Episode]]
    ) -> None:
        """These finished samples to inference (with an inference stage). An episode
        that never reached an engine (its environment failed to start) has nothing to
        score."""
        if not self.p.uses_inference:
            return
        routed = [self.samples.completions[rid] for rid in request_ids]
        routed = [e for e in routed if e.num_turns]
        self.num_to_score += len(routed)
        if routed:
            await to_score.send(routed)

    async def _reward(
        self,
        responses: ObjectReceiveStream[list[Episode]],
        facts: ObjectSendStream[Rewarded | Scored],
    ) -> None:
        """The verifier's reward of each response, off the event loop."""
        p = self.p

        async def one(chunk: list[Episode]) -> None:
            pairs = [
                (self.prompts[self.samples.group_of[c.request_id]], response_text(p.tokenizer, c))
                for c in chunk
            ]
            values = await p.verifier.score_many(pairs)
            rewards = {c.request_id: v for c, v in zip(chunk, values, strict=True)}
            await facts.send(Rewarded(rewards))

        async with facts, responses, anyio.create_task_group() as tg:
            async for chunk in responses:
                tg.start_soon(one, chunk)

    async def _to_inference(self, to_score: ObjectReceiveStream[list[Episode]]) -> None:
        """Finished responses to the inference instances, through the router."""
        async with to_score:
            async for chunk in to_score:
                await self.p.router.submit([self._sample_item(c) for c in chunk])

    def _sample_item(self, c: Episode) -> Item:
        request = LogprobRequest(
            item_id=c.request_id,
            token_ids=c.prompt_ids + c.output_ids,
            response_start=len(c.prompt_ids),
        )
        return Item(
            id=ItemId(c.request_id),
            group=self.group_of[c.request_id],
            edge=TO_INFERENCE,
            payload=_ENCODER.encode(request),
            tokens=len(c.prompt_ids) + len(c.output_ids),
        )

    async def _collect(
        self, facts: ObjectReceiveStream[Rewarded | Scored], ready: ObjectSendStream[int]
    ) -> None:
        """Rewards and log-probs into samples; complete groups the iteration trains to
        the actor."""
        async with facts, ready:
            async for fact in facts:
                for group in self.samples.add(fact):
                    if self.groups.admission.is_admitted(group):
                        await ready.send(group)
