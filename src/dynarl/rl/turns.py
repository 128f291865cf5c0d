"""An episode's tokens, produced once: the prompt rendered by the chat template, each
sampled turn appended as the engine generated it (in the loss, with its log-probs), and
each observation appended as the chat template renders it (out of the loss).

The history is never decoded and re-encoded: a tokenizer does not round-trip (``" 42"``
may come back as one token or two), and a trajectory re-encoded from text trains the
policy on tokens it did not sample — the most common bug in RL frameworks' trackers.
Instead, an observation's ids are the *suffix* the chat template adds after an
assistant turn: rendered once after a fixed stand-in conversation, and checked to
extend it (:class:`ChatRenderer`), so it does not depend on how the real history would
re-tokenize.
"""

from collections.abc import Sequence
from typing import Any

from dynarl.core.errors import DynaRLError
from dynarl.envs.environment import ChatMessage

_STAND_IN: list[ChatMessage] = [
    {"role": "user", "content": "?"},
    {"role": "assistant", "content": "!"},
]


class TemplateError(DynaRLError):
    """The model's chat template cannot render observations as an appended suffix (it
    rewrites earlier turns, e.g. strips past reasoning), or has no end-of-turn token."""


class ChatRenderer:
    """Renders an environment's messages to token ids with a model's chat template.

    Args:
        tokenizer: the policy's ``transformers`` tokenizer, with a chat template.
        tools: the environment's tool schemas, for the template's tool prompt.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the policy's tokenizer has no chat template; multi-turn environments "
                "need one (set model.tokenizer=chat for the built-in one)"
            )
        eos = tokenizer.eos_token
        if eos is None or tokenizer.eos_token_id is None:
            raise TemplateError("the policy's tokenizer has no end-of-turn (EOS) token")
        self._tokenizer = tokenizer
        self._tools = list(tools) or None
        self.end_of_turn_id: int = int(tokenizer.eos_token_id)
        before = self._render(_STAND_IN, generation_prompt=False)
        cut = before.rfind(eos)
        if cut < 0:
            raise TemplateError(
                f"the chat template does not end an assistant turn with {eos!r}; "
                "it cannot mark where a sampled turn stops"
            )
        self._stand_in = before
        self._after_turn = before[cut + len(eos) :]  # what follows the end-of-turn token

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        """The ids of an episode's first messages, ready for the policy's first turn."""
        return tuple(self._encode(self._render(messages, generation_prompt=True)))

    def observation_ids(
        self, observation: Sequence[ChatMessage], *, turn_ended: bool
    ) -> tuple[int, ...]:
        """The ids that follow a sampled turn: ``observation`` as the template renders
        it, then the next assistant turn's header. ``turn_ended``: the turn stopped on
        the end-of-turn token (else it ran out of tokens, and the turn is closed here).
        """
        after = self._render([*_STAND_IN, *observation], generation_prompt=True)
        if not after.startswith(self._stand_in):
            raise TemplateError(
                "the chat template renders earlier turns differently once an observation "
                "follows them, so an observation cannot be appended as tokens; use a "
                "template that only appends"
            )
        ids = self._encode(self._after_turn + after[len(self._stand_in) :])
        return tuple(ids if turn_ended else [self.end_of_turn_id, *ids])

    def _render(self, messages: Sequence[ChatMessage], *, generation_prompt: bool) -> str:
        text = self._tokenizer.apply_chat_template(
            list(messages),
            tools=self._tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class Transcript:
    """An episode's tokens as they are produced.

    ``output_ids`` holds everything after the prompt: sampled turns (``mask`` 1, with
    the engine's log-probs) and observations (``mask`` 0, log-prob 0). The next turn's
    context is ``prompt_ids + output_ids``.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = tuple(prompt_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.num_turns = 0
        self.weight_version: int | None = None

    @property
    def num_tokens(self) -> int:
        """Context length: prompt, turns and observations."""
        return len(self.prompt_ids) + len(self.output_ids)

    def context(self) -> tuple[int, ...]:
        """The next turn's prompt."""
        return self.prompt_ids + tuple(self.output_ids)

    def add_turn(
        self, token_ids: Sequence[int], logprobs: Sequence[float], weight_version: int
    ) -> None:
        """Append a sampled turn, as generated."""
        assert len(token_ids) == len(logprobs), "one log-prob per sampled token"
        self.output_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(token_ids))
        self.num_turns += 1
        held = self.weight_version
        self.weight_version = weight_version if held is None else min(held, weight_version)

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Append an observation's ids (out of the loss)."""
        self.output_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.mask.extend([0] * len(token_ids))


def transcript_of(
    renderer: ChatRenderer, tokenizer: Any, messages: Sequence[ChatMessage]
) -> Transcript:
    """The transcript a whole conversation (a demonstration) makes, token for token as
    an episode playing it would: the messages before the first assistant turn are the
    prompt, each assistant turn's text is encoded as sampled (with its end-of-turn
    token; log-probs 0), and the messages between turns are observations."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise TemplateError("a demonstration needs at least one assistant turn")
    transcript = Transcript(renderer.prompt_ids(messages[:first]))
    observation: list[ChatMessage] = []
    for message in messages[first:]:
        if message["role"] != "assistant":
            observation.append(message)
            continue
        if observation:
            transcript.add_observation(renderer.observation_ids(observation, turn_ended=True))
            observation = []
        ids = [*tokenizer.encode(message["content"], add_special_tokens=False)]
        ids.append(renderer.end_of_turn_id)
        transcript.add_turn(ids, [0.0] * len(ids), weight_version=0)
    return transcript
