"""Playing multi-turn episodes through the data router: the tool component of a real run.

Each episode is one session of the router. Its turns are rollout items that engines
hand back, when the turn ends, as sessions going to their environment (``tool_call``:
the hypergraph sees a tool call start). The runner then steps the episode's
environment (at most ``env.max_concurrent_steps`` at once: the tool component's
capacity), appends the turn's sampled ids and the observation's rendered ids to the
episode's :class:`~dynarl.rl.turns.Transcript`, and either resumes the session for its
next turn — the router sends it back to the engine holding its KV prefix while that
engine lives and has room, else to the least-loaded one (``ToolCallFinished``) — or
finishes it (``ItemCompleted``) and hands the :class:`~dynarl.rl.episode.Episode` on.

Limits per episode: ``env.max_turns``, ``env.max_total_tokens`` (each turn's token
budget is what is left of it) and ``env.max_wall_s`` (checked at every turn's end and
bounding every environment step). The environment is closed exactly once, however the
episode ends: done, truncated, aborted (:class:`~dynarl.envs.environment.EnvironmentFailure`
or a bug in the environment) or cancelled.

With partial rollouts an episode can outlive its iteration: when the rollout ends, the
runner **withdraws** the sessions still playing from the router
(:meth:`EpisodeRunner.withdraw`) and **parks** each with the request of its next turn:
the turn it was waiting for, the turn an engine was aborted from with the tokens it
had sampled, or, for an episode whose environment was stepping, the turn after the
step (the step finishes while the iteration scores and trains; an episode the step
ends is kept aside for the iteration's carry-over). Its environment stays alive, its
transcript kept, and the next iteration resumes it (:meth:`EpisodeRunner.resume`); its
wall-time limit does not run while it is parked. A step still running when the
iteration's training is over goes on beside its weight sync (the steps run in the
run's task group), and the next iteration waits for it (:meth:`EpisodeRunner.settle`):
the episode parks, or, ended by the step, carries over finished. The runner lives as
long as the pipeline driver, which closes it.
"""

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from dynarl.control.topology import PROMPTS
from dynarl.core.ids import GroupId, ItemId
from dynarl.data.errors import RoutingError
from dynarl.data.placement import RoutedResult
from dynarl.data.router import Router
from dynarl.data.wire import Item
from dynarl.envs.config import EnvConfig
from dynarl.envs.environment import (
    Environment,
    EnvironmentFailure,
    EnvironmentSpec,
    StepResult,
    Turn,
    episode_metrics,
)
from dynarl.envs.prompts import Prompt
from dynarl.rl.episode import Episode, EpisodeEnd
from dynarl.rl.turns import ChatRenderer, Transcript
from dynarl.workers.rollout import Completion, GenerateRequest

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_COMPLETION = msgspec.msgpack.Decoder(Completion)
_REQUEST = msgspec.msgpack.Decoder(GenerateRequest)
_CLOSE_TIMEOUT_S = 10.0


class _Play:
    """One episode in progress."""

    def __init__(
        self, request: GenerateRequest, group: GroupId, env: Environment, started_s: float
    ) -> None:
        self.request = request
        self.group = group
        self.env = env
        self.started_s = started_s
        self.renderer: ChatRenderer | None = None
        self.transcript = Transcript(())
        self.rewards: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self.env_s = 0.0
        self.tool_calls = 0
        self.turn_tokens: list[int] = []  # each turn's sampled tokens
        self.observation_tokens: list[int] = []  # each observation a next turn followed
        self.step_latency_s: list[float] = []  # the steps that produced them
        self.context_tokens = 0  # every turn's context, as sent to its engine
        self.cached_tokens = 0  # of those, the engines found in their prefix caches
        self.turn_out = False  # its turn is with the router (else its environment steps)
        self.withdrawn = False  # taken out of the router: it parks instead of resuming
        self.parked: GenerateRequest | None = None  # its next turn, for the next iteration
        self.parked_s = 0.0  # when it parked (its wall time stops meanwhile)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled for it so far, a parked turn's partial output
        included."""
        parked = 0 if self.parked is None else len(self.parked.output_ids)
        return sum(self.transcript.mask) + parked


class EpisodeRunner:
    """Plays the episodes of one environment, iteration after iteration.

    Args:
        spec: the environment.
        limits: the ``env`` section (episode limits, the tool component's capacity).
        max_seq_len: the model's longest context.
        tokenizer: the policy's tokenizer (with a chat template).
        router: the data router (sessions go back and forth through it).
        finished: where finished episodes go (else set each iteration by
            :meth:`attach`).
        now_s: the clock episode wall times are measured on.
    """

    def __init__(
        self,
        *,
        spec: EnvironmentSpec,
        limits: EnvConfig,
        max_seq_len: int,
        tokenizer: object,
        router: Router,
        finished: MemoryObjectSendStream[Episode] | None = None,
        now_s: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.spec = spec
        self.limits = limits
        self.max_tokens = min(limits.max_total_tokens or max_seq_len, max_seq_len)
        self.tokenizer = tokenizer
        self.router = router
        self.finished = finished
        self.now_s = now_s
        self.steps = anyio.CapacityLimiter(limits.max_concurrent_steps)
        self._plays: dict[str, _Play] = {}
        self._ended_aside: dict[str, Episode] = {}
        self._stepping = 0  # environment steps started and not over
        self._still = anyio.Event()  # set while none is
        self._still.set()
        self._scopes: set[anyio.CancelScope] = set()
        self._closed = False

    def attach(self, finished: MemoryObjectSendStream[Episode]) -> None:
        """An iteration begins: its finished episodes go to ``finished``."""
        self.finished = finished

    def detach(self) -> None:
        """The iteration is over: close its stream of finished episodes."""
        if self.finished is not None:
            self.finished.close()
            self.finished = None

    # ------------------------------------------------------------------ episodes

    async def start(self, request: GenerateRequest, task: Prompt, group: GroupId) -> Item | None:
        """Start an episode of ``task`` as ``request`` (its id, seed and sampling): the
        item of its first turn, for the router. An environment that fails to reset ends
        the episode aborted (``None``)."""
        rid = request.request_id
        play = _Play(request, group, self.spec.make(), self.now_s())
        self._plays[rid] = play
        try:
            with anyio.fail_after(self.limits.max_wall_s):
                messages = await play.env.reset(task)
            play.renderer = ChatRenderer(self.tokenizer, play.env.tools)
            play.transcript = Transcript(play.renderer.prompt_ids(messages))
        except Exception as e:  # a failed reset: nothing to train on
            self._log_abort(rid, "reset", e)
            await self._end(rid, "aborted")
            return None
        if play.transcript.num_tokens >= self.max_tokens:
            logger.error("episode %s: its first prompt fills the context; ends truncated", rid)
            await self._end(rid, "truncated")
            return None
        play.turn_out = True
        return self._item(play, self._request(play))

    def turn_ended(self, routed: RoutedResult, tasks: TaskGroup) -> None:
        """A turn came back from its engine: in ``tasks``, step the environment, then
        resume the session for its next turn, finish it, or (withdrawn) park it.

        Give ``tasks`` a life longer than the iteration's (the run's): a withdrawn
        episode's step still running when the iteration's training is over then goes
        on beside its weight sync, and :meth:`settle` waits for it before the next
        iteration starts."""
        self._plays[str(routed.item.id)].turn_out = False
        if not self._stepping:
            self._still = anyio.Event()
        self._stepping += 1
        tasks.start_soon(self._step, routed)

    async def _step(self, routed: RoutedResult) -> None:
        try:
            with anyio.CancelScope() as scope:
                if self._closed:  # the run stopped before the step began
                    return
                self._scopes.add(scope)
                try:
                    await self._turn_ended(routed)
                finally:
                    self._scopes.discard(scope)
        finally:
            self._stepping -= 1
            if not self._stepping:
                self._still.set()

    async def _turn_ended(self, routed: RoutedResult) -> None:
        rid = str(routed.item.id)
        play = self._plays[rid]
        if routed.refusal is not None:  # the router has finished its session
            logger.error("episode %s aborted: its engine refused the turn: %s", rid, routed.refusal)
            await self._end(rid, "aborted")
            return
        completion = _COMPLETION.decode(routed.result.payload)
        transcript = play.transcript
        transcript.add_turn(
            completion.output_ids, completion.output_logprobs, completion.weight_version
        )
        play.turn_tokens.append(len(completion.output_ids))
        play.context_tokens += len(completion.prompt_ids)
        play.cached_tokens += completion.cached_tokens
        ids = list(completion.output_ids)
        assert play.renderer is not None, "a started episode has its renderer"
        ended = bool(ids) and ids[-1] == play.renderer.end_of_turn_id
        turn = Turn(
            text=self._decode(ids[:-1] if ended else ids),
            token_ids=completion.output_ids,
            finish_reason=completion.finish_reason,
            index=transcript.num_turns - 1,
        )
        t0 = self.now_s()
        result: StepResult | None = None
        try:
            async with self.steps:
                with anyio.move_on_after(self._wall_left(play)):
                    result = await play.env.step(turn)
        except Exception as e:
            play.env_s += self.now_s() - t0
            self._log_abort(rid, f"turn {turn.index}", e)
            await self._finish(play, "aborted")
            return
        latency_s = self.now_s() - t0
        play.env_s += latency_s
        if result is None:  # the step ran past the episode's wall time
            await self._finish(play, "truncated")
            return
        play.rewards.append(result.reward)
        play.metrics.append(result.metrics)
        play.tool_calls += int(result.metrics.get("tool_calls", 0))
        if result.done:
            await self._finish(play, "done")
            return
        observation = play.renderer.observation_ids(result.observation, turn_ended=ended)
        if (
            transcript.num_turns >= self.limits.max_turns
            or transcript.num_tokens + len(observation) >= self.max_tokens
            or self._wall_left(play) <= 0
        ):
            await self._finish(play, "truncated")
            return
        transcript.add_observation(observation)
        play.observation_tokens.append(len(observation))
        play.step_latency_s.append(latency_s)
        request = self._request(play)
        if not play.withdrawn:
            try:
                await self.router.resume(
                    routed.item.id, _ENCODER.encode(request), latency_s=latency_s
                )
            except RoutingError:
                if not play.withdrawn:
                    raise
                # Withdrawn while it waited for room in the router's backlog.
            else:
                play.turn_out = True
                return
        self._park(play, request)

    # ------------------------------------------------------------------ partial rollouts

    def withdraw(self, request_ids: Sequence[str]) -> list[str]:
        """The iteration's rollout is over and these episodes carry over: take them out
        of the router (:meth:`~dynarl.data.router.Router.withdraw`). Returns those
        settled now: parked with the turn they waited an engine for, or out on a tool
        call whose result the runner has (it parks once its environment's step is
        over). For each of the others a result is still to come through the router --
        its running turn, aborted with its partial output (:meth:`recalled`) or ended
        first, or a turn that was on its way here -- and it settles then. An episode
        that already ended is left alone (its episode is on its way to the iteration).
        """
        ids = [ItemId(rid) for rid in request_ids]
        in_tool = self.router.out_on_tool_call(ids)
        taken = {item.id: item for item in self.router.withdraw(ids)}
        settled, stepping, running = [], 0, 0
        for item_id in ids:
            play = self._plays.get(str(item_id))
            if play is None:
                continue
            play.withdrawn = True
            if not play.turn_out:  # its environment steps
                settled.append(str(item_id))
                stepping += 1
            elif item_id in taken and item_id not in in_tool:  # it waited for an engine
                self._park(play, _REQUEST.decode(taken[item_id].payload))
                settled.append(str(item_id))
            else:
                running += 1
        logger.info(
            "carrying %d episodes over mid-session: %d waiting for an engine, %d in a "
            "tool call, %d whose turn is running or on its way back",
            len(settled) + running,
            len(settled) - stepping,
            stepping,
            running,
        )
        return settled

    def recalled(self, request: GenerateRequest) -> None:
        """A withdrawn episode's running turn came back aborted, holding the tokens it
        sampled: it parks with it (the next iteration's engine decodes on)."""
        self._park(self._plays[request.request_id], request)

    def is_withdrawn(self, request_id: str) -> bool:
        """Whether ``request_id`` is an episode withdrawn this iteration, still playing."""
        play = self._plays.get(request_id)
        return play is not None and play.withdrawn

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is an episode parked for the next iteration."""
        play = self._plays.get(request_id)
        return play is not None and play.parked is not None

    @property
    def parked(self) -> frozenset[str]:
        """The episodes parked for the next iteration."""
        return frozenset(rid for rid, play in self._plays.items() if play.parked is not None)

    def resume(self, request_id: str) -> Item:
        """Resume the parked episode ``request_id`` in a new iteration: the item of its
        next turn, for the router."""
        play = self._plays[request_id]
        request = play.parked
        assert request is not None, f"episode {request_id} is parked"
        play.started_s += self.now_s() - play.parked_s  # parked time is not its own
        generated = play.sampled_tokens
        play.parked, play.withdrawn, play.turn_out = None, False, True
        return self._item(play, request, generated=generated)

    def carried_over(self, withdrawn: Iterable[str]) -> tuple[dict[str, Episode], dict[str, int]]:
        """Once the iteration's training is over, what became of the ``withdrawn``
        episodes: those that ended after their rollout did (their last step said done,
        or a limit or a failure ended them; forgotten here), and the tokens each of the
        others (parked, or in an environment step that is still running) has sampled
        so far."""
        ended, self._ended_aside = self._ended_aside, {}
        playing = {rid: self._plays[rid].sampled_tokens for rid in withdrawn if rid not in ended}
        return ended, playing

    async def settle(self) -> dict[str, Episode]:
        """Wait until no environment step runs (before an iteration starts: the steps
        of episodes withdrawn from the last one, which ran on beside its weight sync).
        Returns the episodes those steps ended since :meth:`carried_over` (carry them
        over finished); the others are parked."""
        await self._still.wait()
        ended, self._ended_aside = self._ended_aside, {}
        return ended

    @property
    def num_playing(self) -> int:
        """Episodes started and not ended (parked ones included)."""
        return len(self._plays)

    def _park(self, play: _Play, request: GenerateRequest) -> None:
        play.parked, play.parked_s, play.turn_out = request, self.now_s(), False

    async def aclose(self) -> None:
        """Stop the environment steps still running, close the environments of
        episodes still playing, parked ones included (the run stops), and the stream of
        finished episodes."""
        self._closed = True
        for scope in list(self._scopes):
            scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
            await self._still.wait()
        for rid in list(self._plays):
            await self._close(self._plays.pop(rid))
        self.detach()

    # ------------------------------------------------------------------ helpers

    def _request(self, play: _Play) -> GenerateRequest:
        """The session's next turn: the whole context so far, a budget of what is left
        of the episode's tokens, a seed of its own."""
        transcript, sampling = play.transcript, play.request.sampling
        budget = min(sampling.max_new_tokens, self.max_tokens - transcript.num_tokens)
        seed = None if sampling.seed is None else sampling.seed + transcript.num_turns
        return msgspec.structs.replace(
            play.request,
            prompt_ids=transcript.context(),
            sampling=msgspec.structs.replace(sampling, max_new_tokens=budget, seed=seed),
            tool_calls=play.tool_calls,
            multi_turn=True,
        )

    @staticmethod
    def _item(play: _Play, request: GenerateRequest, *, generated: int = 0) -> Item:
        """The router item of ``play``'s turn ``request`` (its context its size;
        ``generated``: the tokens the episode sampled before, when it resumes)."""
        return Item(
            id=ItemId(play.request.request_id),
            group=play.group,
            edge=PROMPTS,
            payload=_ENCODER.encode(request),
            affinity="prefer",
            tokens=len(request.prompt_ids),
            tool_calls=play.tool_calls,
            generated=generated,
        )

    def _wall_left(self, play: _Play) -> float:
        return self.limits.max_wall_s - (self.now_s() - play.started_s)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        assert isinstance(text, str)
        return text

    async def _finish(self, play: _Play, end: EpisodeEnd) -> None:
        """The episode's environment or a limit ended it after a step: its session
        completes in the router (unless withdrawn: it left the router then)."""
        rid = play.request.request_id
        if not play.withdrawn:
            self.router.finish(ItemId(rid))
        await self._end(rid, end)

    async def _end(self, rid: str, end: EpisodeEnd) -> None:
        play = self._plays.pop(rid)
        await self._close(play)
        t = play.transcript
        metrics = episode_metrics(play.metrics)
        metrics.update(
            turns=float(t.num_turns),
            env_s=play.env_s,
            context_tokens=float(play.context_tokens),
            cached_tokens=float(play.cached_tokens),
        )
        episode = Episode(
            request_id=rid,
            prompt_ids=t.prompt_ids,
            output_ids=tuple(t.output_ids),
            output_logprobs=tuple(t.logprobs),
            output_mask=tuple(t.mask),
            weight_version=t.weight_version or 0,
            reward=sum(play.rewards) if end != "aborted" else 0.0,
            num_turns=t.num_turns,
            end=end,
            metrics=metrics,
            turn_tokens=tuple(play.turn_tokens),
            observation_tokens=tuple(play.observation_tokens),
            step_latency_s=tuple(play.step_latency_s),
        )
        if play.withdrawn:
            self._ended_aside[rid] = episode  # its group carries over
            return
        assert self.finished is not None, "an iteration is attached"
        await self.finished.send(episode)

    async def _close(self, play: _Play) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
            try:
                await play.env.close()
            except Exception:
                logger.exception("closing the environment of %s failed", play.request.request_id)

    @staticmethod
    def _log_abort(rid: str, where: str, error: Exception) -> None:
        if isinstance(error, EnvironmentFailure):
            logger.warning("episode %s aborted at %s: %s", rid, where, error)
        else:
            logger.error(
                "episode %s aborted at %s by a bug in its environment",
                rid,
                where,
                exc_info=error,
            )
