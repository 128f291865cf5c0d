"""Building the policy model from a :class:`~dynarl.workers.config.ModelConfig`.

Two sources, one result (a ``transformers`` causal LM in eval mode, beside the fast
tokenizer of :mod:`dynarl.workers.tokenizer`):

- ``config.path`` set: the real ``from_pretrained`` path, so any causal LM checkpoint
  ``transformers`` can load works (a local directory; nothing is downloaded).
- ``config.path`` unset: a random-init ``qwen2`` or ``llama`` of the configured shape,
  seeded, sized to the character-level tokenizer built in code.

:func:`save_pretrained` writes both to a directory that the first path loads back.
"""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from dynarl.workers.config import ModelConfig
from dynarl.workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_config(config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The ``transformers`` config of a random-init model of ``config``'s shape whose
    vocabulary and special ids match ``tokenizer``."""
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_seq_len,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "tie_word_embeddings": False,
        "dtype": config.dtype,
    }
    if config.arch == "qwen2":
        return Qwen2Config(**fields)
    return LlamaConfig(**fields)


def build_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """The policy model of ``config``, in eval mode on ``device``.

    With ``config.path`` set it is loaded with ``AutoModelForCausalLM.from_pretrained``
    (``seed`` is unused); under ``torch.device("meta")``, only its architecture is
    built (a skeleton whose tensors its caller fills). Otherwise its weights are
    initialised from ``seed`` alone (the global torch RNG is left as it was), with the
    vocabulary of ``tokenizer`` (default: the one ``config`` names,
    :func:`~dynarl.workers.tokenizer.load_tokenizer`).
    """
    dtype = _DTYPES[config.dtype]
    model: PreTrainedModel
    if config.path is not None and torch.empty(0).device.type == "meta":
        # A skeleton of a checkpoint's architecture (a trainer joiner: its tensors
        # arrive from a running rank); ``from_pretrained`` refuses the meta device.
        hf_config = AutoConfig.from_pretrained(config.path)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)  # type: ignore[no-untyped-call]
    elif config.path is not None:
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(config.path, dtype=dtype)
        logger.info("loaded %s from %s", type(model).__name__, config.path)
    else:
        hf_config = model_config(config, tokenizer or load_tokenizer(config))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                hf_config, dtype=dtype
            )
        logger.info(
            "built a random-init %s (%d parameters, seed %d)",
            config.arch,
            sum(p.numel() for p in model.parameters()),
            seed,
        )
    module: torch.nn.Module = model  # nn.Module's typed to/eval (they work in place)
    if next(module.parameters()).device.type != "meta":
        # Built under ``torch.device("meta")`` (a trainer skeleton, whose tensors are
        # allocated and filled by its caller), it stays where it is.
        module.to(device)
    module.eval()
    return model


def save_pretrained(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> None:
    """Write ``model`` and ``tokenizer`` to directory ``path`` (created if missing), so a
    :class:`ModelConfig` with ``path=...`` loads them back."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence ``transformers``' progress bars for one call (the library never prints);
    their switch is global, so it is put back as it was."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
