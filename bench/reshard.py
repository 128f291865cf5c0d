"""Benchmark: how long the elastic trainer takes to grow by one rank, beside a bare
gloo broadcast of the same bytes measured in the same run.

For each model size a pool of two pre-started workers trains one step on worker 0
(so AdamW has its state), then resizes ``[0] -> [0, 1]``: groups are created, worker 1
receives parameters, buffers and AdamW state, and the switch is committed. The time of
that resize (best of ``--repeats``, each after shrinking back) is set beside the best
time of one bare gloo broadcast of the same number of bytes between two other
processes: ``raw_s`` into a freshly allocated receive buffer (as a joiner, which holds
no memory before it joins, receives) and ``raw_warm_s`` into an already touched one.
The gap between the two is first-touch page faulting, which on some virtual machines
costs more than the copy. A shrink ``[0, 1] -> [0]`` moves no state: the fixed cost.

With ``--megatron`` (when megatron-core is installed), the Megatron trainer of a
model of the same width and depth (the built-in character vocabulary) adds two rows per
size, each beside a bare broadcast of the bytes it moved: a data-parallel grow
``[0] -> [0, 1]`` (the joiner receives its shard, moments and step from worker 0) and
a change of tensor-parallel size ``TP=1 on [0] -> TP=2 on [0, 1]`` (worker 0 cuts
worker 1's shard of weights and AdamW state from its state in the HF layout and sends
it). Their ``shrink`` is the way back. ``--distributed-optimizer`` adds the same two
rows with Megatron's distributed optimizer (``megatron-do``): its AdamW moments are
sliced over the data-parallel group, so a resize makes them whole (one sum over the
old group), and the source replica's leader cuts and sends each new member its whole
shard (weights, moments, step), which the member re-slices.

Aim: ``reshard_s <= 2 * raw_s + 0.5``. Prints a table, then one JSON line.

    python bench/reshard.py [--sizes 10M,50M,200M] [--repeats 2] [--megatron]
                            [--distributed-optimizer]
"""

import argparse
import datetime
import functools
import json
import multiprocessing
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import anyio
import numpy as np

from dynarl.testing.workers import LocalWorkers
from dynarl.workers.torch.loss import weighted_nll
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.torch.trainer_main import trainer_main
from dynarl.workers.torch.trainer_pool import TrainerPool

# hidden size, layers, vocabulary, MLP width of a Qwen2 with about that many parameters
SHAPES = {
    "10M": (256, 6, 8192, 1024),
    "50M": (512, 9, 16384, 2048),
    "200M": (1024, 12, 32000, 2816),
}


def qwen2_factory(size: str) -> functools.partial:  # type: ignore[type-arg]
    """A picklable factory of a random-init Qwen2 of ``size``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, vocab, mlp = SHAPES[size]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        intermediate_size=mlp,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False,
    )
    return functools.partial(Qwen2ForCausalLM, config)


def count_params(size: str) -> int:
    """Parameters of the model of ``size`` (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in qwen2_factory(size)().parameters())


def measure_reshard(size: str, repeats: int) -> dict[str, float]:
    """Best grow and shrink times of a two-worker pool training a model of ``size``."""
    config = TrainerConfig(micro_batch_size=1, timeout_s=600.0, reshard_timeout_s=120.0)
    rng = np.random.default_rng(0)
    minibatch = {
        "input_ids": rng.integers(0, 1000, size=(1, 16)),
        "loss_weights": np.ones((1, 16), dtype=np.float32),
    }
    grows: list[float] = []
    shrinks: list[float] = []

    async def run() -> int:
        async with LocalWorkers(trainer_main, ["trainer-0", "trainer-1"]) as workers:
            pool = TrainerPool(
                config,
                workers=workers.channels,
                model_factory=qwen2_factory(size),
                loss_fn=weighted_nll,
            )
            await pool.start()
            try:
                await pool.start_training([0])
                await pool.train_step(minibatch)
                num_bytes = 0
                for _ in range(repeats):
                    grow = await pool.resize([0, 1])
                    grows.append(grow.elapsed_s)
                    num_bytes = grow.bytes_moved
                    shrinks.append((await pool.resize([0])).elapsed_s)
                return num_bytes
            finally:
                await pool.close()

    num_bytes = anyio.run(run)
    return {
        "params": count_params(size),
        "bytes": num_bytes,
        "reshard_s": min(grows),
        "shrink_s": min(shrinks),
    }


def measure_megatron(
    size: str, repeats: int, *, distributed_optimizer: bool = False
) -> list[dict[str, float]]:
    """Best DP-grow and TP-change times of a two-worker Megatron pool (with Megatron's
    distributed optimizer, or torch's AdamW)."""
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron.main import megatron_trainer_main
    from dynarl.workers.megatron.pool import MegatronPool
    from dynarl.workers.megatron.spec import ModelSpec

    hidden, layers, _, mlp = SHAPES[size]
    heads, kv_heads = hidden // 64, max(2, hidden // 256)
    model = ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=mlp,
        max_seq_len=64,
    )
    config = TrainerConfig(micro_batch_size=1, timeout_s=600.0, reshard_timeout_s=120.0)
    rng = np.random.default_rng(0)
    minibatch = {
        "input_ids": rng.integers(4, 90, size=(1, 16)),
        "loss_weights": np.ones((1, 16), dtype=np.float32),
    }
    name = "megatron-do" if distributed_optimizer else "megatron"
    dp, tp = f"{name} dp grow", f"{name} tp 1->2"
    times: dict[str, list[float]] = {dp: [], tp: []}
    backs: dict[str, list[float]] = {dp: [], tp: []}
    moved: dict[str, int] = {}
    spec = ModelSpec(model=model, distributed_optimizer=distributed_optimizer)

    async def run() -> None:
        async with LocalWorkers(megatron_trainer_main, ["mt-0", "mt-1"]) as workers:
            pool = MegatronPool(
                config,
                workers=workers.channels,
                model_factory=spec,
                loss_fn=weighted_nll,
            )
            await pool.start()
            try:
                await pool.start_training([0])
                await pool.train_step(minibatch)
                for _ in range(repeats):
                    grow = await pool.resize([0, 1])
                    times[dp].append(grow.elapsed_s)
                    moved[dp] = grow.bytes_moved
                    backs[dp].append((await pool.resize([0])).elapsed_s)
                    change = await pool.reshard([0, 1], tp=2, pp=1)
                    times[tp].append(change.elapsed_s)
                    moved[tp] = change.bytes_moved
                    back = await pool.reshard([0], tp=1, pp=1)
                    backs[tp].append(back.elapsed_s)
            finally:
                await pool.close()

    anyio.run(run)
    params = sum(p.numel() for p in ModelSpec(model=model).hf_model().parameters())
    return [
        {
            "kind": kind,
            "params": params,
            "bytes": moved[kind],
            "reshard_s": min(t),
            "shrink_s": min(backs[kind]),
        }
        for kind, t in times.items()
    ]


def _raw_worker(
    rank: int, store_path: str, sizes: list[int], repeats: int, conn: Connection
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )

    def timed_broadcast(buffer: torch.Tensor) -> float:
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(buffer, src=0)
        dist.barrier()
        return time.perf_counter() - started

    try:
        dist.broadcast(torch.zeros(1024), src=0)  # connect before timing
        results = []
        for num_bytes in sizes:
            source = torch.ones(num_bytes, dtype=torch.uint8) if rank == 0 else None
            fresh, warm = float("inf"), float("inf")
            for _ in range(repeats):
                # like a joiner: the receiver writes into memory it just allocated
                buffer = source if source is not None else torch.empty(num_bytes, dtype=torch.uint8)
                fresh = min(fresh, timed_broadcast(buffer))
                warm = min(warm, timed_broadcast(buffer))  # the same memory again
                del buffer
            results.append((fresh, warm))
            del source
        conn.send(results)
    finally:
        dist.destroy_process_group()
        conn.close()


def measure_raw(sizes: list[int], repeats: int) -> list[tuple[float, float]]:
    """Best times of one gloo broadcast of each of ``sizes`` bytes between two
    processes: into a freshly allocated receive buffer, and into a touched one."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        pipes = [context.Pipe(duplex=False) for _ in range(2)]
        processes = [
            context.Process(
                target=_raw_worker, args=(rank, f"{tmp}/store", sizes, repeats, pipes[rank][1])
            )
            for rank in range(2)
        ]
        try:
            for process in processes:
                process.start()
            results: list[tuple[float, float]] = pipes[0][0].recv()
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
                    process.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M,200M")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--megatron", action="store_true", help="add the Megatron rows")
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="add the Megatron rows with its distributed optimizer",
    )
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for size in sizes:
        rows.append({"kind": "torch dp grow", **measure_reshard(size, args.repeats)})
        if args.megatron:
            rows.extend(measure_megatron(size, args.repeats))
        if args.distributed_optimizer:
            rows.extend(measure_megatron(size, args.repeats, distributed_optimizer=True))
    raw = measure_raw([int(r["bytes"]) for r in rows], args.repeats)
    for row, (raw_s, raw_warm_s) in zip(rows, raw, strict=True):
        row.update(
            raw_s=raw_s,
            ratio=row["reshard_s"] / raw_s,
            raw_warm_s=raw_warm_s,
            ratio_warm=row["reshard_s"] / raw_warm_s,
        )

    header = (
        "kind",
        "params",
        "state MB",
        "reshard s",
        "raw s",
        "ratio",
        "raw warm s",
        "ratio",
        "shrink s",
    )
    print(("{:<20} {:>12} {:>9} {:>10} {:>8} {:>6} {:>11} {:>6} {:>9}").format(*header))
    for row in rows:
        print(
            f"{row['kind']:<20} {row['params']:>12,} {row['bytes'] / 1e6:>9.0f} "
            f"{row['reshard_s']:>10.3f} "
            f"{row['raw_s']:>8.3f} {row['ratio']:>6.2f} {row['raw_warm_s']:>11.3f} "
            f"{row['ratio_warm']:>6.2f} {row['shrink_s']:>9.3f}"
        )
    print(
        "torch dp grow: [0] -> [0, 1] (params + buffers + AdamW state); megatron dp grow: the "
        "same with a Megatron trainer; megatron tp 1->2: TP=1 on [0] -> TP=2 on [0, 1] (worker "
        "0 cuts worker 1's shard of weights and AdamW state and sends it); megatron-do: "
        "the same with Megatron's distributed optimizer; raw: one gloo "
        "broadcast of the same bytes into a fresh (like a joiner) or already touched buffer; "
        "shrink: the way back ([0, 1] -> [0], no state moves; megatron tp: TP=2 -> TP=1 on "
        f"[0], a gather of worker 1's shard). 2 processes, gloo, CPU; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    keys = (
        "kind",
        "params",
        "bytes",
        "reshard_s",
        "raw_s",
        "ratio",
        "raw_warm_s",
        "ratio_warm",
        "shrink_s",
    )
    print(json.dumps({"bench": "reshard", "rows": [{k: row[k] for k in keys} for row in rows]}))


if __name__ == "__main__":
    main()
