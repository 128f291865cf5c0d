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
"""

import logging
import time
from collections.abc import Callable

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from dynarl.control.topology import PROMPTS
from dynarl.core.ids import GroupId, ItemId
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


class EpisodeRunner:
    """Plays an iteration's episodes of one environment.

    Args:
        spec: the environment.
        limits: the ``env`` section (episode limits, the tool component's capacity).
        max_seq_len: the model's longest context.
        tokenizer: the policy's tokenizer (with a chat template).
        router: the data router (sessions go back and forth through it).
        finished: where finished episodes go.
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
        finished: MemoryObjectSendStream[Episode],
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
        return self._item(rid, play)

    async def turn_ended(self, routed: RoutedResult) -> None:
        """A turn came back from its engine: step the environment, then resume the
        session for its next turn or finish it."""
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
            self.router.finish(routed.item.id)
            await self._end(rid, "aborted")
            return
        latency_s = self.now_s() - t0
        play.env_s += latency_s
        if result is None:  # the step ran past the episode's wall time
            self.router.finish(routed.item.id)
            await self._end(rid, "truncated")
            return
        play.rewards.append(result.reward)
        play.metrics.append(result.metrics)
        play.tool_calls += int(result.metrics.get("tool_calls", 0))
        if result.done:
            self.router.finish(routed.item.id)
            await self._end(rid, "done")
            return
        observation = play.renderer.observation_ids(result.observation, turn_ended=ended)
        if (
            transcript.num_turns >= self.limits.max_turns
            or transcript.num_tokens + len(observation) >= self.max_tokens
            or self._wall_left(play) <= 0
        ):
            self.router.finish(routed.item.id)
            await self._end(rid, "truncated")
            return
        transcript.add_observation(observation)
        play.observation_tokens.append(len(observation))
        play.step_latency_s.append(latency_s)
        await self.router.resume(
            routed.item.id, _ENCODER.encode(self._request(play)), latency_s=latency_s
        )

    async def aclose(self) -> None:
        """Close the environments of episodes still playing (the iteration stops)."""
        for rid in list(self._plays):
            await self._close(self._plays.pop(rid))
        self.finished.close()

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

    def _item(self, rid: str, play: _Play) -> Item:
        return Item(
            id=ItemId(rid),
            group=play.group,
            edge=PROMPTS,
            payload=_ENCODER.encode(self._request(play)),
            affinity="prefer",
            tokens=play.transcript.num_tokens,
        )

    def _wall_left(self, play: _Play) -> float:
        return self.limits.max_wall_s - (self.now_s() - play.started_s)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        assert isinstance(text, str)
        return text

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
