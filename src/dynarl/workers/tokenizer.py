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



def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code: one token per printable ASCII character.

    Ids 0-3 are ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``; decoding joins characters back
    without separators, so ``decode(encode(text)) == text`` for printable ASCII text. No
    BOS/EOS is added automatically; callers add the tokens they mean.
    """
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for char in _CHARACTERS:
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the checkpoint at ``config.path``, else :func:`build_tokenizer`.

    A checkpoint's ``tokenizer.json`` is loaded as written. ``AutoTokenizer`` is used only
    when there is none: for some model types (``qwen2`` among them) it swaps in the
    family's own tokenizer class, which re-derives the pre-tokenizer and would drop the
    spaces of the built-in character-level tokenizer.
    """
    if config.path is None:
        return build_tokenizer()
    tokenizer: PreTrainedTokenizerBase
    if (Path(config.path) / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(config.path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(config.path)
    return tokenizer
