"""The pipeline driver: one GRPO iteration of a real run as small stage tasks joined by
memory object streams.

::

    prompts ─▶ router ─▶ rollout engines ─▶ results ─┬─▶ reward ─────────────┐
                                                      └─▶ router ─▶ inference ┴─▶ samples
    samples ─▶ groups ─▶ actor steps (when the trainer may step) ─▶ weight sync

Every item goes through the data router: rollout requests to the rollout engines,
finished responses to the inference instances for their behaviour (and reference)
log-probs, and each optimizer step's samples to the trainer's ranks (each to the rank
whose data-parallel shard holds it, :mod:`dynarl.workers.trainer_items`). A response
is rewarded by the verifier while it is scored; once every sample of a group is
rewarded and scored the group is ready, and the actor takes its ``n_minibatches``
optimizer steps (:class:`~dynarl.rl.actor_steps.ActorSteps`). Then the engines get the
new weights.

With an environment (a multi-turn task), each sample is an episode played by the
:class:`~dynarl.rl.episode_runner.EpisodeRunner`: its turns go back and forth between
the engines and the environment (the run's tool component) as router sessions, and
its reward is the environment's; the rest of the pipeline is the same.

The driver reports the iteration's boundaries and the actor's steps through the
:class:`~dynarl.rl.reporter.EventReporter`, which also carries the router's events.
"""

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup, TaskStatus

from dynarl.control import events as ev
from dynarl.control.topology import PROMPTS, TO_ACTOR, TO_INFERENCE
from dynarl.core.ids import EdgeId, GroupId, ItemId
from dynarl.data.placement import RoutedResult
from dynarl.data.router import Router
from dynarl.data.wire import Item
from dynarl.envs.config import EnvConfig
from dynarl.envs.environment import EnvironmentSpec
from dynarl.envs.prompts import PromptSampler
from dynarl.envs.verifier import AsyncVerifier
from dynarl.obs.metrics import IterationStats
from dynarl.obs.trace_records import Request
from dynarl.rl.actor_steps import ActorSteps
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode, episode_stats
from dynarl.rl.episode_runner import EpisodeRunner
from dynarl.rl.gate import StepGate
from dynarl.rl.progress import Progress, Weights
from dynarl.rl.reporter import EventReporter
from dynarl.rl.requests import group_requests, prompt_ids, response_text
from dynarl.rl.routed_results import split_results
from dynarl.rl.samples import Rewarded, Samples, Scored
from dynarl.rl.trace import RunTrace, episode_request
from dynarl.workers.config import RolloutConfig
from dynarl.workers.inference import LogprobRequest, LogprobResult
from dynarl.workers.rollout import GenerateRequest
from dynarl.workers.trainer import Trainer

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()

_Inbound = list[RoutedResult] | Episode
"""What the result stage hears: a batch of the router's results, or an episode the
runner finished."""


class Pipeline:
    """Runs a real run's iterations through the data router and the trainer.

    Args:
        algorithm: batch shape, minibatches and their order.
        rollout: sampling parameters of the requests.
        seed: the run's seed (prompt order, request seeds, minibatch splits).
        router: the data router (bound and running; its ``on_event`` is ``reporter``).
        trainer: the actor.
        weights: the weight-sync group.
        gate: says when the actor may step.
        reporter: where the driver's events go.
        sampler: where prompts come from.
        verifier: the reward rule, run off the event loop.
        tokenizer: encodes prompts and decodes responses (the model's).
        uses_inference: old log-probs come from inference instances (else from the
            engines' own, which equal them).
        on_progress: sees the iteration's progress as it happens.
        environment: a multi-turn environment whose episodes are the samples (else
            single-turn responses scored by ``verifier``).
        env: the episodes' limits (with ``environment``).
        max_seq_len: the model's longest context (with ``environment``).
        trace: where each finished iteration's samples are recorded (the run
            directory's ``trace.jsonl``); ``None``: not recorded.
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        seed: int,
        router: Router,
        trainer: Trainer,
        weights: Weights,
        gate: StepGate,
        reporter: EventReporter,
        sampler: PromptSampler,
        verifier: AsyncVerifier,
        tokenizer: Any,
        uses_inference: bool,
        on_progress: Callable[[Progress], None] | None = None,
        environment: EnvironmentSpec | None = None,
        env: EnvConfig | None = None,
        max_seq_len: int = 0,
        trace: RunTrace | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.rollout = rollout
        self.seed = seed
        self.router = router
        self.trainer = trainer
        self.weights = weights
        self.gate = gate
        self.reporter = reporter
        self.sampler = sampler
        self.verifier = verifier
        self.tokenizer: Any = tokenizer  # transformers' (kept untyped: no torch here)
        self.uses_inference = uses_inference
        self.on_progress = on_progress or (lambda p: None)
        self.environment = environment
        self.env = env or EnvConfig()
        self.max_seq_len = max_seq_len
        self.trace = trace

    async def run(self, iteration: int) -> IterationStats:
        """Run iteration ``iteration`` and return what it measured."""
        return await _Iteration(self, iteration).run()


class _Iteration:
    """One iteration's state and its stage tasks."""

    def __init__(self, pipeline: Pipeline, iteration: int) -> None:
        self.p = pipeline
        self.iteration = iteration
        self.started = time.perf_counter()
        algo = pipeline.algorithm
        self.prompts = pipeline.sampler.take(algo.num_prompts)
        if pipeline.environment is None:
            ids = [prompt_ids(pipeline.tokenizer, prompt) for prompt in self.prompts]
        else:  # an episode's first prompt is what its environment's reset says
            ids = [() for _ in self.prompts]
        self.requests = group_requests(
            algo, pipeline.rollout, ids, seed=pipeline.seed, iteration=iteration
        )
        self.samples = Samples(
            [r.request_id for r in self.requests],
            algo.group_size,
            needs_scores=pipeline.uses_inference,
        )
        self.group_of = {
            rid: GroupId(f"{iteration}/{group}") for rid, group in self.samples.group_of.items()
        }
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
        self.runner: EpisodeRunner | None = None
        self.pump = anyio.CancelScope()  # the router's results into the result stage
        self.tg: TaskGroup | None = None

    async def run(self) -> IterationStats:
        p, n = self.p, len(self.requests)
        p.reporter.forget()
        responses_send, responses = anyio.create_memory_object_stream[list[Episode]](n)
        to_score_send, to_score = anyio.create_memory_object_stream[list[Episode]](n)
        facts_send, facts = anyio.create_memory_object_stream[Rewarded | Scored](2 * n)
        ready_send, ready = anyio.create_memory_object_stream[int](p.algorithm.num_prompts)
        inbox_send, inbox = anyio.create_memory_object_stream[_Inbound](n)
        if not p.uses_inference:
            to_score_send.close()
            to_score.close()
        runner = None
        if p.environment is not None:
            responses_send.close()  # the environment rewards its episodes itself
            responses.close()
            runner = EpisodeRunner(
                spec=p.environment,
                limits=p.env,
                max_seq_len=p.max_seq_len,
                tokenizer=p.tokenizer,
                router=p.router,
                finished=inbox_send.clone(),
            )
        try:
            # Episodes start (their environments reset) before the iteration does, so
            # the controller sees all of rollout's work at once, as for single turns.
            first = [] if runner is None else await self._start_episodes(runner)
            p.reporter(ev.IterationStarted(iteration=self.iteration))
            async with anyio.create_task_group() as tg:
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
        finally:
            if runner is not None:
                await runner.aclose()
        self.stage_s["score"] = self.samples.busy_s
        self.stage_s["train"] = self.actor.busy_s

        t0 = time.perf_counter()
        p.on_progress(Progress(iteration=self.iteration, stage="sync", done=0, total=1))
        await p.weights.sync_weights(self.iteration + 1)
        self.stage_s["sync"] = time.perf_counter() - t0
        p.reporter(ev.IterationDone(iteration=self.iteration))
        if p.trace is not None:
            p.trace.record(self.iteration, self._trace_requests())
        return self._stats(time.perf_counter() - self.started)

    async def _start_episodes(self, runner: EpisodeRunner) -> list[Item]:
        """Reset every episode's environment, all at once; their first turns' items."""
        first: list[Item | None] = [None] * len(self.requests)

        async def start(i: int, request: GenerateRequest) -> None:
            prompt = self.prompts[self.samples.group_of[request.request_id]]
            first[i] = await runner.start(request, prompt, self.group_of[request.request_id])

        async with anyio.create_task_group() as tg:
            for i, request in enumerate(self.requests):
                tg.start_soon(start, i, request)
        return [item for item in first if item is not None]

    def _trace_requests(self) -> list[Request]:
        """The iteration's samples as trace lines, in request order."""
        return [
            episode_request(
                self.samples.completions[rid], iteration=self.iteration, group=self.group_of[rid]
            )
            for rid in self.samples.ids
        ]

    def _request_items(self) -> list[Item]:
        """The single-turn rollout requests as router items."""
        return [
            Item(
                id=ItemId(r.request_id),
                group=self.group_of[r.request_id],
                edge=PROMPTS,
                payload=_ENCODER.encode(r),
                tokens=len(r.prompt_ids),
            )
            for r in self.requests
        ]

    def _stats(self, elapsed: float) -> IterationStats:
        samples = self.samples
        scored = [
            rid for rid in samples.ids if samples.completions[rid].end != "aborted"
        ] or samples.ids
        rewards = np.array([samples.rewards[rid] for rid in scored])
        gen_tokens = sum(c.num_sampled for c in samples.completions.values())
        return IterationStats(
            iteration=self.iteration,
            mean_reward=float(rewards.mean()),
            solved_fraction=float(np.mean(rewards >= 1.0)),
            num_samples=len(self.requests),
            gen_tokens=gen_tokens,
            mean_response_tokens=gen_tokens / len(self.requests),
            tokens_per_s=gen_tokens / elapsed,
            loss=float(np.mean(self.actor.losses)),
            grad_norm=float(np.mean(self.actor.norms)),
            weight_version=self.iteration + 1,
            stage_s=self.stage_s,
            elapsed_s=elapsed,
            episodes=episode_stats(list(samples.completions.values()))
            if self.p.environment is not None
            else {},
        )

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
        samples to the step that waits for them; until the iteration's last is in."""
        p, n, runner = self.p, len(self.requests), self.runner
        expected = {PROMPTS: n, TO_INFERENCE: n if p.uses_inference else 0, TO_ACTOR: n}
        received = dict.fromkeys(expected, 0)
        async with inbox, contextlib.AsyncExitStack() as upstream:
            for stream in (responses, to_score, facts):
                await upstream.enter_async_context(stream)
            while received != expected:
                got = await inbox.receive()
                if isinstance(got, Episode):
                    chunk: list[Episode] = [got]
                    turns: list[RoutedResult] = []
                    scored: list[LogprobResult] = []
                    trained: list[ItemId] = []
                else:
                    chunk, turns, scored, trained = split_results(got)
                for turn in turns:
                    assert runner is not None, "only episodes' turns go to environments"
                    assert self.tg is not None
                    self.tg.start_soon(runner.turn_ended, turn)
                received[PROMPTS] += len(chunk)
                received[TO_INFERENCE] += len(scored)
                received[TO_ACTOR] += len(trained)
                self.actor.delivered(trained)
                if chunk:
                    await self._responded(chunk, responses, to_score, facts, expected)
                    p.on_progress(
                        Progress(
                            iteration=self.iteration,
                            stage="rollout",
                            done=received[PROMPTS],
                            total=n,
                        )
                    )
                    if received[PROMPTS] == n:
                        self.stage_s["rollout"] = time.perf_counter() - self.started
                if scored:
                    await facts.send(Scored(tuple(scored)))
                if (received[PROMPTS], received[TO_INFERENCE]) == (n, expected[TO_INFERENCE]):
                    await upstream.aclose()  # every sample is through them
        self.pump.cancel()  # the iteration's last result is in

    async def _responded(
        self,
        chunk: list[Episode],
        responses: ObjectSendStream[list[Episode]],
        to_score: ObjectSendStream[list[Episode]],
        facts: ObjectSendStream[Rewarded | Scored],
        expected: dict[EdgeId, int],
    ) -> None:
        """Finished samples: to the verifier (single-turn) or rewarded by their
        environment, and to inference. An episode that never reached an engine (its
        environment failed to start) has nothing to score."""
        for sample in chunk:
            self.samples.completed(sample)
        if self.p.environment is None:
            await responses.send(chunk)
        else:
            await facts.send(Rewarded({e.request_id: e.reward or 0.0 for e in chunk}))
        if self.p.uses_inference:
            routed = [e for e in chunk if e.num_turns]
            expected[TO_INFERENCE] -= len(chunk) - len(routed)
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
        """Rewards and log-probs into samples; complete groups to the actor."""
        async with facts, ready:
            async for fact in facts:
                for group in self.samples.add(fact):
                    await ready.send(group)
