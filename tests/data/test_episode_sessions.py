"""Multi-turn episodes through the real data router: the runner keeps the ids the
engine sampled, appends observations as the chat template renders them, sends each
session back to its engine, ends episodes at their limits, and always closes the
environment. The engines are the faked edge: workers that answer each turn with a
scripted policy's tokens, handed back through the slots' own item sink."""

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import msgspec
import pytest
from anyio.abc import TaskGroup

from dynarl.control import events as ev
from dynarl.core.ids import GroupId, ItemId
from dynarl.data import ItemResult, PeerLostError, Router, WorkerLink
from dynarl.data.placement import RoutedResult
from dynarl.envs.config import EnvConfig
from dynarl.envs.environment import (
    ChatMessage,
    EnvironmentFailure,
    EnvironmentSpec,
    StepResult,
    Turn,
)
from dynarl.envs.lookup import LookupEnvironment, LookupTask, lookup_spec
from dynarl.envs.prompts import Prompt
from dynarl.rl.episode import Episode, episode_stats
from dynarl.rl.episode_runner import EpisodeRunner
from dynarl.rl.turns import ChatRenderer
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.sinks import ItemSink
from dynarl.workers.tokenizer import build_tokenizer

from .helpers import Net, cluster, wait_until

TOKENIZER = build_tokenizer(chat=True)
EOT = TOKENIZER.eos_token_id
LOGPROB = -0.5
Policy = Callable[[str], str]
"""The scripted policy: the text of its next turn, given its context's text."""


def lookup_policy(context: str) -> str:
    """Call ``open_box`` on the asked box, then answer with what it returned."""
    if "<tool_response>" not in context:
        box = context.rsplit("box ", maxsplit=1)[-1][0]
        return f'<tool_call>{{"name": "open_box", "arguments": {{"box": {box}}}}}</tool_call>'
    response = context.rsplit("<tool_response>", maxsplit=1)[-1]
    return response.split("</tool_response>", maxsplit=1)[0]


def always_call(context: str) -> str:
    return '<tool_call>{"name": "open_box", "arguments": {"box": 1}}</tool_call>'


def engine(
    policy: Policy,
    contexts: list[tuple[int, ...]],
    refuse: Callable[[str], bool],
    ended: list[tuple[str, ItemId]],
) -> Callable[[WorkerLink], Any]:
    """A rollout worker answering each turn with ``policy``'s tokens (and recording
    the contexts it was asked to continue, and the sessions it hears are over); it
    refuses the turns ``refuse`` picks, as a slot refuses a request its engine cannot
    take."""

    async def hear_ends(link: WorkerLink) -> None:
        with contextlib.suppress(PeerLostError):
            while True:
                ended.extend((link.instance, i) for i in await link.receive_ended_sessions())

    async def serve(link: WorkerLink) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hear_ends, link)
            await answer(link)
            tg.cancel_scope.cancel()

    kept: dict[ItemId, tuple[int, ...]] = {}  # each session's last context + output

    async def answer(link: WorkerLink) -> None:
        try:
            while True:
                for item in await link.receive():
                    request = msgspec.msgpack.decode(item.payload, type=GenerateRequest)
                    contexts.append(request.prompt_ids)
                    context = TOKENIZER.decode(list(request.prompt_ids))
                    if refuse(context):
                        link.complete(
                            ItemResult(item=item.id, status="refused", payload=b"too long")
                        )
                        continue
                    text = policy(context)
                    ids = [*TOKENIZER.encode(text, add_special_tokens=False), EOT]
                    ids = ids[: request.sampling.max_new_tokens]
                    before = kept.get(item.id, ())
                    hit = request.prompt_ids[: len(before)] == before
                    kept[item.id] = request.prompt_ids + tuple(ids)
                    completion = Completion(
                        request_id=item.id,
                        prompt_ids=request.prompt_ids,
                        output_ids=tuple(ids),
                        output_logprobs=(LOGPROB,) * len(ids),
                        finish_reason="stop" if ids[-1] == EOT else "length",
                        weight_version=3,
                        cached_tokens=len(before) if hit else 0,
                    )
                    ItemSink(link, item, 0, multi_turn=request.multi_turn).done(completion)
        except PeerLostError:
            pass

    return serve


class Rig:
    """A router with scripted engines, an episode runner over it, and the loop that
    hands ended turns to the runner (the pipeline driver's part)."""

    def __init__(
        self,
        router: Router,
        runner: EpisodeRunner,
        finished: Any,
        graph: Any,
        ended: list[tuple[str, ItemId]],
    ) -> None:
        self.router, self.runner, self.finished, self.graph = router, runner, finished, graph
        self.ended = ended
        """(engine, session) for each session end an engine heard of."""

    async def play(self, spec_tasks: list[Prompt], *, timeout_s: float = 10.0) -> list[Episode]:
        """Play one episode per task; the finished episodes in task order."""
        done: dict[str, Episode] = {}
        items = []
        for i, task in enumerate(spec_tasks):
            request = GenerateRequest(
                request_id=f"e{i}",
                prompt_ids=(),
                sampling=SamplingParams(max_new_tokens=64, seed=i),
            )
            item = await self.runner.start(request, task, GroupId("g"))
            if item is not None:
                items.append(item)
        await self.router.submit(items)
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as tg:
                while len(done) < len(spec_tasks):
                    while True:
                        try:
                            episode = self.finished.receive_nowait()
                        except anyio.WouldBlock:
                            break
                        done[episode.request_id] = episode
                    if len(done) == len(spec_tasks):
                        break
                    with anyio.move_on_after(0.05):
                        for d in await self.router.receive_batch():
                            assert d.result.status in ("tool_call", "refused")
                            self.runner.turn_ended(d, tg)
        return [done[f"e{i}"] for i in range(len(spec_tasks))]


@asynccontextmanager
async def rig(
    tmp_path: Path,
    spec: EnvironmentSpec,
    *,
    policy: Policy = lookup_policy,
    engines: tuple[str, ...] = ("rollout-0",),
    contexts: list[tuple[int, ...]] | None = None,
    refuse: Callable[[str], bool] = lambda context: False,
    **limits: Any,
) -> AsyncIterator[Rig]:
    net = Net("inproc", tmp_path)
    ended: list[tuple[str, ItemId]] = []
    async with cluster(net, [], all_instances=list(engines)) as c:
        for name in engines:
            c.add_worker(
                name,
                capacity=len(TASKS),  # room for every session: none waits, none moves
                serve=engine(policy, contexts if contexts is not None else [], refuse, ended),
            )
        await c.router.wait_for_instances(len(engines))
        send, receive = anyio.create_memory_object_stream[Episode](100)
        runner = EpisodeRunner(
            spec=spec,
            limits=EnvConfig(**limits),
            max_seq_len=256,
            tokenizer=TOKENIZER,
            router=c.router,
            finished=send,
        )
        try:
            yield Rig(c.router, runner, receive, c.graph, ended)
        finally:
            await runner.aclose()
            receive.close()
        c.graph.check()
    await net.aclose()


TASKS = [LookupTask(seed=0).prompt(i) for i in range(6)]


async def test_an_episode_keeps_the_sampled_ids_and_renders_only_the_observation(
    tmp_path: Path,
) -> None:
    contexts: list[tuple[int, ...]] = []
    async with rig(tmp_path, lookup_spec(0), contexts=contexts) as r:
        [episode] = await r.play(TASKS[:1])
    task = TASKS[0]
    call = lookup_policy(f"box {task.metadata['box']}")
    turn_0 = [*TOKENIZER.encode(call, add_special_tokens=False), EOT]
    turn_1 = [*TOKENIZER.encode(str(task.answer), add_special_tokens=False), EOT]
    renderer = ChatRenderer(TOKENIZER, lookup_spec(0).make().tools)
    observation = renderer.observation_ids(
        [{"role": "tool", "name": "open_box", "content": str(task.answer)}], turn_ended=True
    )
    assert episode.end == "done" and episode.reward == 1.0 and episode.num_turns == 2
    assert episode.output_ids == (*turn_0, *observation, *turn_1)
    assert episode.output_mask == (1,) * len(turn_0) + (0,) * len(observation) + (1,) * len(turn_1)
    sampled = [lp for lp, m in zip(episode.output_logprobs, episode.output_mask, strict=True) if m]
    assert set(sampled) == {LOGPROB} and episode.weight_version == 3
    # The second turn continues the first's exact ids: nothing was decoded and re-encoded.
    assert contexts[1] == contexts[0] + tuple(turn_0) + observation
    assert episode.metrics["tool_calls"] == 1 and episode.metrics["turns"] == 2
    # The second turn's context extends the first turn's: the engine had it cached.
    assert episode.metrics["context_tokens"] == len(contexts[0]) + len(contexts[1])
    assert episode.metrics["cached_tokens"] == len(contexts[0]) + len(turn_0)
    assert episode_stats([episode])["prefix_hit_rate"] == pytest.approx(
        (len(contexts[0]) + len(turn_0)) / (len(contexts[0]) + len(contexts[1]))
    )


async def test_each_session_comes_back_to_the_engine_holding_its_prefix(tmp_path: Path) -> None:
    engines = ("rollout-0", "rollout-1", "rollout-2")
    async with rig(tmp_path, lookup_spec(0), engines=engines) as r:
        episodes = await r.play(TASKS)
        served: dict[ItemId, list[str]] = {}
        for e in r.graph.of(ev.ItemRouted):
            served.setdefault(e.item, []).append(e.instance)
        starts, finishes = r.graph.of(ev.ToolCallStarted), r.graph.of(ev.ToolCallFinished)
        # The engine holding each session hears that it is over.
        await wait_until(lambda: len(r.ended) == len(TASKS))
    assert all(e.reward == 1.0 for e in episodes)
    assert all(len(turns) == 2 and len(set(turns)) == 1 for turns in served.values())
    assert sorted(r.ended) == sorted((turns[-1], item) for item, turns in served.items())
    assert len({turns[0] for turns in served.values()}) > 1  # spread over the engines
    # Every turn's end is a tool call the model sees; the last one ends the episode.
    assert (len(starts), len(finishes)) == (2 * len(TASKS), len(TASKS))


class Scripted:
    """An environment whose steps a test scripts; it records its close."""

    closed: ClassVar[list[str]] = []

    def __init__(self, step: Callable[[Turn], Any], reset_fails: bool = False) -> None:
        self._step = step
        self._reset_fails = reset_fails
        self.task = ""

    @property
    def tools(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Prompt) -> list[ChatMessage]:
        self.task = task.prompt_id
        if self._reset_fails:
            raise EnvironmentFailure("the sandbox did not start")
        return [{"role": "user", "content": task.text}]

    async def step(self, turn: Turn) -> StepResult:
        result: StepResult = await self._step(turn)
        return result

    async def close(self) -> None:
        Scripted.closed.append(self.task)


def scripted(step: Callable[[Turn], Any], **kw: Any) -> EnvironmentSpec:
    Scripted.closed = []
    return EnvironmentSpec(make=lambda: Scripted(step, **kw))


async def again(turn: Turn) -> StepResult:
    return StepResult(observation=({"role": "user", "content": "again"},))


async def test_an_episode_ends_truncated_at_its_turn_limit(tmp_path: Path) -> None:
    async with rig(tmp_path, scripted(again), policy=always_call, max_turns=3) as r:
        [episode] = await r.play(TASKS[:1])
    assert (episode.end, episode.num_turns, episode.reward) == ("truncated", 3, 0.0)
    assert Scripted.closed == [TASKS[0].prompt_id]


async def test_an_episode_ends_truncated_at_its_token_budget(tmp_path: Path) -> None:
    async with rig(tmp_path, scripted(again), policy=always_call, max_total_tokens=150) as r:
        [episode] = await r.play(TASKS[:1])
    assert episode.end == "truncated"
    assert len(episode.prompt_ids) + len(episode.output_ids) <= 150


async def test_a_step_past_the_episode_wall_time_ends_it_truncated(tmp_path: Path) -> None:
    async def slow(turn: Turn) -> StepResult:
        await anyio.sleep(30)
        raise AssertionError("cancelled by the wall-time limit")

    async with rig(tmp_path, scripted(slow), max_wall_s=0.3) as r:
        [episode] = await r.play(TASKS[:1])
    assert episode.end == "truncated" and episode.metrics["env_s"] < 5


@pytest.mark.parametrize("error", [EnvironmentFailure("sandbox died"), ValueError("a bug")])
async def test_a_failing_environment_aborts_the_episode_unscored(
    tmp_path: Path, error: Exception
) -> None:
    async def broken(turn: Turn) -> StepResult:
        raise error

    async with rig(tmp_path, scripted(broken)) as r:
        episodes = await r.play(TASKS[:2])
    assert [e.end for e in episodes] == ["aborted", "aborted"]
    assert sorted(Scripted.closed) == sorted(t.prompt_id for t in TASKS[:2])


async def test_an_environment_that_fails_to_start_ends_its_episode_unrouted(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, scripted(again, reset_fails=True)) as r:
        [episode] = await r.play(TASKS[:1])
        routed = r.graph.of(ev.ItemRouted)
    assert (episode.end, episode.num_turns, routed) == ("aborted", 0, [])
    assert Scripted.closed == [TASKS[0].prompt_id]


async def test_episodes_still_playing_are_closed_when_the_iteration_stops(
    tmp_path: Path,
) -> None:
    async def forever(turn: Turn) -> StepResult:
        await anyio.sleep(60)
        raise AssertionError("cancelled")

    async with rig(tmp_path, scripted(forever)) as r:
        with anyio.move_on_after(0.5):
            await r.play(TASKS[:2])
    assert sorted(Scripted.closed) == sorted(t.prompt_id for t in TASKS[:2])


async def test_a_turn_its_engine_refuses_aborts_the_episode_unscored(tmp_path: Path) -> None:
    def second_turn(context: str) -> bool:
        return "<tool_response>" in context

    async with rig(tmp_path, lookup_spec(), refuse=second_turn) as r:
        episodes = await r.play(TASKS[:2])
        stats = r.router.statistics()
    assert [(e.end, e.num_turns) for e in episodes] == [("aborted", 1), ("aborted", 1)]
    assert stats.num_refused == 2 and stats.num_pending == 0


# ---------------------------------------------------------------- partial rollouts


def holding_engine(
    policy: Policy, hold: Callable[[str], bool], version: list[int], held_ids: list[ItemId]
) -> Callable[[WorkerLink], Any]:
    """A rollout worker as :func:`engine`, that holds the turns ``hold`` picks (their
    ids in ``held_ids``) until the router asks for them back, then hands them back
    aborted with the first half of the policy's tokens, as an engine aborts a request
    keeping its partial output; a resumed turn decodes on from its output. Every token
    records ``version[0]``."""

    async def serve(link: WorkerLink) -> None:
        held: list[tuple[Any, GenerateRequest, list[int]]] = []
        try:
            while True:
                for item in link.receive_nowait():
                    request = msgspec.msgpack.decode(item.payload, type=GenerateRequest)
                    context = TOKENIZER.decode(list(request.prompt_ids))
                    ids = [*TOKENIZER.encode(policy(context), add_special_tokens=False), EOT]
                    assert tuple(ids[: len(request.output_ids)]) == request.output_ids
                    if hold(context):
                        held.append((item, request, ids))
                        held_ids.append(item.id)
                        continue
                    completion = Completion(
                        request_id=item.id,
                        prompt_ids=request.prompt_ids,
                        output_ids=tuple(ids),
                        output_logprobs=(*request.output_logprobs,)
                        + (LOGPROB,) * (len(ids) - len(request.output_ids)),
                        finish_reason="stop",
                        weight_version=min(request.weight_version or version[0], version[0]),
                    )
                    ItemSink(link, item, 0, multi_turn=request.multi_turn).done(completion)
                for entry in [h for h in held if link.abort_requested(h[0].id)]:
                    held.remove(entry)
                    item, request, ids = entry
                    cut = len(ids) // 2
                    partial = msgspec.structs.replace(
                        request,
                        output_ids=tuple(ids[:cut]),
                        output_logprobs=(LOGPROB,) * cut,
                        weight_version=version[0],
                    )
                    ItemSink(link, item, 0, multi_turn=True).aborted(partial)
                await anyio.sleep(0.005)
        except PeerLostError:
            pass

    return serve


class GatedLookup(LookupEnvironment):
    """The lookup environment whose first step, for the task ``gated`` names, waits
    for ``gate``; its step after that can end the episode (``done_after_gate``)."""

    gate: ClassVar[anyio.Event]
    gated: ClassVar[str]
    done_after_gate: ClassVar[bool] = False

    async def step(self, turn: Turn) -> StepResult:
        if self.task.prompt_id == self.gated and turn.index == 0:
            await self.gate.wait()
            if self.done_after_gate:
                return StepResult(observation=(), reward=0.5, done=True)
        return await super().step(turn)


def second_turn_of(task: Prompt) -> Callable[[str], bool]:
    """Whether a context is ``task``'s after its tool call (the box's code is in it)."""
    return lambda context: task.text in context and str(task.answer) in context


async def test_episodes_withdrawn_mid_session_park_and_resume_token_for_token(
    tmp_path: Path,
) -> None:
    """Three episodes at the rollout's end: one out on a tool call (its step still
    running), one whose second turn an engine is decoding, one waiting for an engine.
    Withdrawn, each parks with its next turn; resumed in the next iteration, each ends
    exactly as it would have uninterrupted (every token, mask and log-prob), its
    oldest token's weight version kept."""
    tasks = [LookupTask(seed=5).prompt(i) for i in range(3)]
    while len({t.text for t in tasks}) < 3 or any(
        a.text in b.text for a in tasks for b in tasks if a is not b
    ):
        tasks = [*tasks[1:], LookupTask(seed=5).prompt(len(tasks) + 7)]
    async with rig(tmp_path, lookup_spec(5)) as r:
        expected = await r.play(tasks)
    assert all(e.end == "done" and e.reward == 1.0 for e in expected)

    GatedLookup.gate, GatedLookup.gated = anyio.Event(), tasks[0].prompt_id
    version = [3]
    holding = [True]
    held: list[ItemId] = []
    in_flight = second_turn_of(tasks[1])
    net = Net("inproc", tmp_path / "carry")
    async with cluster(net, [], all_instances=["rollout-0"]) as c:
        c.add_worker(
            "rollout-0",
            capacity=1,  # one turn at a time: the third episode's next turn waits
            serve=holding_engine(
                lookup_policy, lambda ctx: holding[0] and in_flight(ctx), version, held
            ),
        )
        await c.router.wait_for_instances(1)
        send, finished = anyio.create_memory_object_stream[Episode](10)
        runner = EpisodeRunner(
            spec=EnvironmentSpec(make=GatedLookup),
            limits=EnvConfig(),
            max_seq_len=256,
            tokenizer=TOKENIZER,
            router=c.router,
        )
        runner.attach(send)
        ids = [f"e{i}" for i in range(3)]
        items = []
        for i, task in enumerate(tasks):
            request = GenerateRequest(
                request_id=ids[i], prompt_ids=(), sampling=SamplingParams(max_new_tokens=64)
            )
            item = await runner.start(request, task, GroupId("g"))
            assert item is not None
            items.append(item)
        settled: set[str] = set()
        async with anyio.create_task_group() as tg:
            await c.router.submit(items)

            def state() -> tuple[int, int, int]:
                s = c.router.statistics()
                return s.num_in_tool, s.num_in_flight, s.num_queued

            async def feed() -> None:
                while True:
                    for d in await c.router.receive_batch():
                        rid = str(d.item.id)
                        if d.result.status == "aborted":
                            runner.recalled(
                                msgspec.msgpack.decode(d.result.payload, type=GenerateRequest)
                            )
                            settled.add(rid)
                            continue
                        if runner.is_withdrawn(rid):
                            settled.add(rid)
                        runner.turn_ended(d, tg)

            feeder = anyio.CancelScope()

            async def run_feed() -> None:
                with feeder:
                    await feed()

            tg.start_soon(run_feed)
            await wait_until(lambda: held == ["e1"] and state() == (1, 1, 1))
            settled.update(runner.withdraw(ids))
            assert settled == {"e0", "e2"}  # stepping, and waiting for an engine
            await wait_until(lambda: "e1" in settled)  # aborted with its tokens
            GatedLookup.gate.set()  # the step ends after the rollout did
            await wait_until(lambda: runner.holds("e0"))
            assert all(runner.holds(rid) for rid in ids)
            assert c.router.statistics().num_pending == 0
            _, sampled = runner.carried_over(["e1"])
            partial = sampled["e1"]
            # The next iteration: new weights, every episode resumed where it stopped.
            version[0], holding[0] = 4, False
            await c.router.submit([runner.resume(rid) for rid in ids])
            got = [await finished.receive() for _ in ids]
            feeder.cancel()
        await runner.aclose()
        finished.close()
        withdrawn = [i for e in c.graph.of(ev.ItemsWithdrawn) for i in e.items]
        c.graph.check()
    await net.aclose()
    assert sorted(withdrawn) == ids
    by_id = {e.request_id: e for e in got}
    for rid, want in zip(ids, expected, strict=True):
        e = by_id[rid]
        assert (e.end, e.reward, e.num_turns) == ("done", 1.0, 2)
        assert e.output_ids == want.output_ids and e.output_mask == want.output_mask
        assert e.output_logprobs == want.output_logprobs
    # Their first turns (and half of e1's second) came from the old weights.
    assert [by_id[rid].weight_version for rid in ids] == [3, 3, 3]
    assert partial == by_id["e1"].turn_tokens[0] + by_id["e1"].turn_tokens[1] // 2


async def first_turn_to_its_environment(r: Rig, task: Prompt, tasks: TaskGroup) -> RoutedResult:
    """Start episode ``e0`` of ``task``, and once its first turn is back, hand it to
    its environment (its step runs in ``tasks``); the turn."""
    item = await r.runner.start(GenerateRequest(request_id="e0", prompt_ids=()), task, GroupId("g"))
    assert item is not None
    await r.router.submit([item])
    [turn] = await r.router.receive_batch()
    r.runner.turn_ended(turn, tasks)
    return turn


async def test_an_episode_its_running_step_ends_after_the_withdrawal_is_kept_aside(
    tmp_path: Path,
) -> None:
    """An episode out on a tool call when the rollout ends, whose step then ends it:
    it does not reach the iteration's stream of finished episodes (its group carries
    over) but is kept aside, and its session is not completed twice."""
    task = TASKS[0]
    GatedLookup.gate, GatedLookup.gated = anyio.Event(), task.prompt_id
    GatedLookup.done_after_gate = True
    try:
        async with rig(tmp_path, EnvironmentSpec(make=GatedLookup)) as r:
            async with anyio.create_task_group() as tg:
                await first_turn_to_its_environment(r, task, tg)
                assert r.runner.withdraw(["e0"]) == ["e0"]
                GatedLookup.gate.set()
            ended, _ = r.runner.carried_over(["e0"])
            assert r.runner.num_playing == 0
            with pytest.raises(anyio.WouldBlock):
                r.finished.receive_nowait()
            assert r.router.statistics().num_pending == 0
    finally:
        GatedLookup.done_after_gate = False
    assert ended["e0"].end == "done" and ended["e0"].reward == 0.5


@pytest.mark.parametrize("step_ends_it", [True, False])
async def test_a_step_still_running_at_the_iterations_end_is_settled_before_the_next(
    tmp_path: Path, step_ends_it: bool
) -> None:
    """The steps run in a task group that outlives the iteration: an episode withdrawn
    while its environment steps is carried over open (with its tokens) while the step
    goes on (the iteration's weight sync runs meanwhile); :meth:`settle` waits for the
    step and hands over the episode it ended (to carry over finished), or leaves it
    parked for the next iteration to resume."""
    task = TASKS[0]
    GatedLookup.gate, GatedLookup.gated = anyio.Event(), task.prompt_id
    GatedLookup.done_after_gate = step_ends_it
    try:
        async with rig(tmp_path, EnvironmentSpec(make=GatedLookup)) as r:
            async with anyio.create_task_group() as run_tasks:  # the run's, not the iteration's
                turn = await first_turn_to_its_environment(r, task, run_tasks)
                await anyio.sleep(0.05)  # the step has begun (it waits for the gate)
                assert r.runner.withdraw(["e0"]) == ["e0"]
                # The iteration's training is over; its step is not.
                ended, sampled = r.runner.carried_over(["e0"])
                first = msgspec.msgpack.decode(turn.result.payload, type=Completion)
                assert ended == {} and sampled["e0"] == len(first.output_ids)
                settling = anyio.Event()
                late: dict[str, Episode] = {}

                async def settle() -> None:
                    late.update(await r.runner.settle())
                    settling.set()

                run_tasks.start_soon(settle)
                await anyio.sleep(0.05)
                assert not settling.is_set(), "settle() returned with a step running"
                GatedLookup.gate.set()
                with anyio.fail_after(10):
                    await settling.wait()
            if step_ends_it:
                assert late["e0"].end == "done" and late["e0"].reward == 0.5
                assert r.runner.num_playing == 0
            else:
                assert late == {} and r.runner.holds("e0")
            with pytest.raises(anyio.WouldBlock):
                r.finished.receive_nowait()
            assert r.router.statistics().num_pending == 0
    finally:
        GatedLookup.done_after_gate = False


async def test_closing_the_runner_stops_a_running_step_and_closes_its_environment(
    tmp_path: Path,
) -> None:
    task = TASKS[0]
    GatedLookup.gate, GatedLookup.gated = anyio.Event(), task.prompt_id  # never set
    closed: list[str] = []

    class Closing(GatedLookup):
        async def close(self) -> None:
            closed.append(self.task.prompt_id)

    async with rig(tmp_path, EnvironmentSpec(make=Closing)) as r:
        async with anyio.create_task_group() as run_tasks:
            await first_turn_to_its_environment(r, task, run_tasks)
            r.runner.withdraw(["e0"])
            with anyio.fail_after(10):
                await r.runner.aclose()
        assert closed == [task.prompt_id] and r.runner.num_playing == 0
