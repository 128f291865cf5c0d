"""A supervised warm start: teach a random-init policy an environment's format (how to
call its tools, how to answer) on its demonstrations, before RL.

Agentic RL recipes start from a model that can already produce well-formed tool
calls (an instruction-tuned checkpoint, or a short "cold-start" SFT): a random policy
never writes ``<tool_call>{"name": ...}</tool_call>`` by chance, so RL alone would
have no signal. This trains the run's own random-init model with cross-entropy on the
demonstrations' assistant tokens only (the masks the episodes use), and writes it as a
checkpoint that every worker then loads through ``model.path``.
"""

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dynarl.envs.environment import ChatMessage
from dynarl.rl.turns import ChatRenderer, Transcript, transcript_of
from dynarl.workers.config import ModelConfig
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch.model import build_model, save_pretrained

logger = logging.getLogger(__name__)

BATCH_SIZE = 16
"""Demonstrations per step."""


def warm_start(
    model: ModelConfig,
    demonstrations: Sequence[Sequence[ChatMessage]],
    *,
    tools: Sequence[dict[str, object]],
    steps: int,
    lr: float,
    seed: int,
    out_dir: str | Path,
) -> list[float]:
    """Train the random-init model of ``model`` (``seed``) for ``steps`` AdamW steps
    on ``demonstrations`` and save it (with its tokenizer) to ``out_dir``; returns the
    loss of each step."""
    tokenizer = load_tokenizer(model)
    renderer = ChatRenderer(tokenizer, list(tools))
    rows = [transcript_of(renderer, tokenizer, d) for d in demonstrations]
    policy = build_model(model, seed=seed, tokenizer=tokenizer)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    losses: list[float] = []
    batches = _batches(len(rows), steps, np.random.default_rng([seed, 0x5F7]))
    pad = tokenizer.pad_token_id or 0
    for chosen in batches:
        ids, mask, attention = _tensors([rows[i] for i in chosen], pad)
        logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1]
        targets, weights = ids[:, 1:], mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        )
        loss = (nll * weights.reshape(-1)).sum() / weights.sum().clamp(min=1.0)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(float(loss.detach()))
    policy.eval()  # type: ignore[no-untyped-call]
    save_pretrained(policy, tokenizer, out_dir)
    logger.info(
        "warm start: %d steps on %d demonstrations, loss %.3f -> %.3f, saved to %s",
        steps,
        len(rows),
        losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"),
        out_dir,
    )
    return losses


def _batches(num_rows: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``steps`` batches drawn epoch by epoch in seeded orders."""
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(num_rows)
        out.extend(perm[i : i + BATCH_SIZE] for i in range(0, num_rows, BATCH_SIZE))
    return out[:steps]


def _tensors(rows: Sequence[Transcript], pad: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, loss weights (1 on the policy's tokens) and attention."""
    width = max(r.num_tokens for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n, start = r.num_tokens, len(r.prompt_ids)
        ids[i, :n] = torch.tensor(r.context())
        mask[i, start:n] = torch.tensor(r.mask, dtype=torch.float32)
        attention[i, :n] = 1
    return ids, mask, attention
