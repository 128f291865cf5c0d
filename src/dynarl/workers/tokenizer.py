"""The policy's tokenizer: the one saved with a checkpoint, or a character-level one
built in code for random-init models. Backend-neutral (``transformers`` and
``tokenizers``, no torch): the driver, every backend and the tests share it.
"""

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dynarl.workers.config import ModelConfig

PAD_TOKEN = "<pad>"
"""Padding token of the built-in tokenizer (id 0)."""
EOS_TOKEN = "<eos>"
"""End-of-sequence token of the built-in tokenizer (id 1); generation stops on it."""
BOS_TOKEN = "<bos>"
"""Beginning-of-sequence token of the built-in tokenizer (id 2)."""
UNK_TOKEN = "<unk>"
"""Stand-in for characters outside the built-in vocabulary (id 3)."""

_SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
_CHARACTERS = string.printable  # digits, letters, punctuation, space and \t\n\r\x0b\x0c

END_OF_TURN = "<|im_end|>"
"""End of a chat turn in the built-in chat tokenizer (Qwen's); generation stops on it."""
CHAT_TOKENS = (
    "<|im_start|>",
    END_OF_TURN,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Special tokens of the built-in chat tokenizer, one id each, as in Qwen2.5's
vocabulary."""

CHAT_TEMPLATE = (
    "{% if messages[0].role == 'system' or tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{{ '\\n' }}tools:"
    "{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls | default([]) %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The built-in chat template: Qwen2's ChatML layout (tool responses as user turns in
``<tool_response>`` tags, calls in ``<tool_call>`` tags), with the tool prompt cut to
the tools' names so that a tiny model's context stays short."""


def build_tokenizer(*, chat: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code: one token per printable ASCII character.

    Ids 0-3 are ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``; decoding joins characters back
    without separators, so ``decode(encode(text)) == text`` for printable ASCII text. No
    BOS/EOS is added automatically; callers add the tokens they mean.

    With ``chat``, the :data:`CHAT_TOKENS` follow as special tokens (one id each),
    :data:`END_OF_TURN` is the end-of-sequence token and :data:`CHAT_TEMPLATE` the chat
    template: a tokenizer for multi-turn, tool-calling episodes.
    """
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for char in _CHARACTERS:
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    if chat:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": list(CHAT_TOKENS), "eos_token": END_OF_TURN}
        )
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the checkpoint at ``config.path``, else
    :func:`build_tokenizer` (with the chat tokens when ``config.tokenizer`` is ``chat``).

    A checkpoint's ``tokenizer.json`` is loaded as written. ``AutoTokenizer`` is used only
    when there is none: for some model types (``qwen2`` among them) it swaps in the
    family's own tokenizer class, which re-derives the pre-tokenizer and would drop the
    spaces of the built-in character-level tokenizer.
    """
    if config.path is None:
        return build_tokenizer(chat=config.tokenizer == "chat")
    tokenizer: PreTrainedTokenizerBase
    if (Path(config.path) / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(config.path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(config.path)
    return tokenizer
