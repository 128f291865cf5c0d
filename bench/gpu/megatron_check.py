"""Check the Megatron-core backend on a GPU machine: NCCL, the CUDA path without the
CPU redirections, and megatron-core's own DDP wrapper + distributed optimizer on our
models.

    python bench/gpu/megatron_check.py [--workers 2]

Checks, one line each, then a JSON summary (exit code 1 if any failed):

1. ``logits``: a tiny Qwen2 converted into Megatron on ``cuda`` gives transformers'
   logits (fp32).
2. ``train``: the trainer (MegatronPool, NCCL, one GPU per worker) steps at DP=1;
   with two or more GPUs also a DP resize 1 -> 2 -> 1 and a TP=2 reshard, whose losses
   must equal the fixed DP=1 run's.
3. ``distributed_optimizer``: the same as ``train`` with Megatron's distributed
   optimizer (``ModelSpec(distributed_optimizer=True)``, what
   ``actor.megatron.distributed_optimizer`` sets): its fixed DP=1 run and its moved run
   (DP resizes re-slice the optimizer state) must give the AdamW run's losses.

Needs a CUDA torch, transformers and megatron-core 0.16 (carry its wheel, with pyzmq
and msgspec, to a machine without them). ``--device cpu`` runs checks 2 and 3 on the
CPU with gloo (a dry run of the script; the tests cover the same there).
"""

import argparse
import datetime
import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import torch
import torch.distributed as dist

from dynarl.testing.minibatches import random_minibatch

MODEL_FIELDS = {"max_seq_len": 64, "num_layers": 2}


def check_logits() -> dict[str, Any]:
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron import convert
    from dynarl.workers.megatron.model import build_gpt, causal_logits, single_process_groups
    from dynarl.workers.megatron.spec import ModelSpec

    spec = ModelSpec(model=ModelConfig(**MODEL_FIELDS))
    hf = spec.hf_model(device="cuda")
    arch = spec.architecture()
    model = build_gpt(arch, single_process_groups(), device="cuda")
    convert.load_into(model, convert.to_megatron(dict(hf.named_parameters()), arch))
    ids = torch.randint(4, 90, (3, 17), device="cuda")
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = causal_logits(model, ids, None, vocab_size=arch.vocab_size)
    error = float((got - expected).abs().max())
    return {"ok": error < 1e-3, "max_abs_error": error}


async def check_train(
    num_workers: int, *, device: str, distributed_optimizer: bool = False
) -> dict[str, Any]:
    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.testing.workers import LocalWorkers
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron.main import megatron_trainer_main
    from dynarl.workers.megatron.pool import MegatronPool
    from dynarl.workers.megatron.spec import ModelSpec
    from dynarl.workers.torch.trainer_config import TrainerConfig

    config = TrainerConfig(micro_batch_size=4, lr=1e-2, device=device, timeout_s=300.0)
    names = [f"mt-{i}" for i in range(num_workers)]
    out: dict[str, Any] = {}
    async with LocalWorkers(megatron_trainer_main, names) as workers:
        pool = MegatronPool(
            config,
            workers=workers.channels,
            model_factory=ModelSpec(
                model=ModelConfig(**MODEL_FIELDS), distributed_optimizer=distributed_optimizer
            ),
            loss_fn=GrpoLoss.from_config(AlgorithmConfig()),
        )
        await pool.start()
        try:
            await pool.start_training([0])
            start = f"/tmp/dynarl_megatron_check_start_{int(distributed_optimizer)}.pt"
            await pool.save_checkpoint(start)
            fixed = [(await pool.train_step(random_minibatch(s))).loss for s in range(4)]
            out["fixed"] = fixed
            if num_workers >= 2:
                await pool.load_checkpoint(start)
                moved = [(await pool.train_step(random_minibatch(0))).loss]
                grow = await pool.resize([0, 1])
                moved.append((await pool.train_step(random_minibatch(1))).loss)
                await pool.resize([0])
                tp = await pool.reshard([0, 1], tp=2, pp=1)
                moved.append((await pool.train_step(random_minibatch(2))).loss)
                await pool.reshard([0], tp=1, pp=1)
                moved.append((await pool.train_step(random_minibatch(3))).loss)
                shrink = await pool.resize([0])
                out.update(
                    moved=moved,
                    dp_grow_s=grow.elapsed_s,
                    dp_shrink_s=shrink.elapsed_s,
                    tp_change_s=tp.elapsed_s,
                    max_rel_diff=float(np.max(np.abs(np.subtract(moved, fixed)) / np.abs(fixed))),
                )
                out["ok"] = out["max_rel_diff"] < 1e-4
            else:
                out["ok"] = bool(np.all(np.isfinite(fixed)))
                out["note"] = "one GPU: no resize (NCCL takes one rank per GPU)"
        finally:
            await pool.close()
    return out


def run(name: str, check: Callable[[], Any], results: dict[str, Any]) -> None:
    try:
        results[name] = check()
    except Exception as error:  # a check that crashes is a failed check, reported
        results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        traceback.print_exc()
    print(f"{name:>22}: {'ok' if results[name].get('ok') else 'FAILED'} {results[name]}")


def check_distributed_optimizer(adamw: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """The distributed optimizer's runs (``got``) against the AdamW runs (``adamw``)."""
    out = dict(got)
    if "fixed" not in adamw or "fixed" not in got:
        out["ok"] = False
        return out
    pairs = [(got["fixed"], adamw["fixed"])]
    if "moved" in got:
        pairs.append((got["moved"], adamw["fixed"]))
    out["max_rel_diff_to_adamw"] = max(
        float(np.max(np.abs(np.subtract(ours, theirs)) / np.abs(theirs))) for ours, theirs in pairs
    )
    out["ok"] = bool(got.get("ok")) and out["max_rel_diff_to_adamw"] < 1e-4
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=max(1, min(2, torch.cuda.device_count())))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (--device cpu: a dry run)", file=sys.stderr)
        return 2
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo",
            init_method="tcp://127.0.0.1:29533",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
    results: dict[str, Any] = {}
    if args.device == "cuda":
        run("logits", check_logits, results)

    def train(distributed: bool) -> dict[str, Any]:
        return anyio.run(
            functools.partial(
                check_train, args.workers, device=args.device, distributed_optimizer=distributed
            )
        )

    run("train", lambda: train(False), results)
    run(
        "distributed_optimizer",
        lambda: check_distributed_optimizer(results["train"], train(True)),
        results,
    )
    print(json.dumps({"bench": "megatron_check", "results": results}, default=str))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
