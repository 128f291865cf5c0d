"""Prefill tokens the torch engine's per-session prefix cache saves on an agentic
episode shape (agentic_tiny's: 3 turns, 64 new tokens a turn), with the engine's wall
time with and without the cache, side by side. One JSON line.

    .venv/bin/python bench/prefix_cache.py [--sessions 16] [--prompt-tokens 150]
"""

import argparse
import json
import time

import torch

from dynarl.api.config import ModelConfig
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.model import build_model


def play(engine: RolloutEngine, args: argparse.Namespace, *, multi_turn: bool) -> float:
    """Run every session's turns; each turn's context is the last one's + its output +
    an observation. Returns the wall time."""
    contexts = {
        f"s{i}": [(7 * i + j) % 90 + 5 for j in range(args.prompt_tokens)]
        for i in range(args.sessions)
    }
    start = time.perf_counter()
    for turn in range(args.turns):
        requests = [
            GenerateRequest(
                request_id=sid,
                prompt_ids=tuple(ctx),
                sampling=SamplingParams(max_new_tokens=args.new_tokens, seed=turn, ignore_eos=True),
                multi_turn=multi_turn,
            )
            for sid, ctx in contexts.items()
        ]
        for done in engine.generate(requests):
            assert isinstance(done, Completion)
            observation = [(turn + k) % 90 + 5 for k in range(args.observation_tokens)]
            contexts[done.request_id] = [*done.prompt_ids, *done.output_ids, *observation]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--observation-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(ModelConfig(max_seq_len=1024), seed=0)
    figures: dict[str, object] = {"bench": "prefix_cache", **vars(args)}
    for name, multi_turn in (("cached", True), ("uncached", False)):
        engine = RolloutEngine(model, eos_token_id=None, max_seq_len=1024, kv_capacity_tokens=16384)
        wall_s = play(engine, args, multi_turn=multi_turn)
        stats = engine.stats()
        figures[name] = {
            "prefill_tokens": stats.prefill_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "wall_s": round(wall_s, 2),
        }
    cached, uncached = figures["cached"], figures["uncached"]
    assert isinstance(cached, dict) and isinstance(uncached, dict)
    figures["prefill_saved"] = round(1 - cached["prefill_tokens"] / uncached["prefill_tokens"], 3)
    figures["wall_ratio"] = round(uncached["wall_s"] / cached["wall_s"], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
