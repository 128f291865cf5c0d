"""Benchmark: what the distributed optimizer's buddy copies cost a Megatron step.

``--dp`` gloo processes (one CPU thread each) build a Megatron rank of a Qwen2 of the
given width and depth with the distributed optimizer (tp = pp = 1, data parallel over
all of them) and train ``--steps`` optimizer steps on random minibatches. Each step
ends with the buddy copy of the boundary (``DistributedAdam.keep_copies``: this rank's
slice packed to host memory, swapped with its ring neighbours, committed); after each
step the copy is timed once more on its own. Reports the median step (copy included),
the median copy, their ratio, and the host memory the copies hold against the
parameters' bytes. Prints a table, then one JSON line.

    python bench/buddy_copy.py [--dp 2] [--steps 6] [--shapes 64x2,256x6,512x8]
"""

import argparse
import json
import multiprocessing
import queue
import socket
import statistics
import time
from typing import Any

import torch


def _worker(worker: int, port: int, job: tuple[int, str, int], results: Any) -> None:
    import torch.distributed as dist

    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.testing.minibatches import random_minibatch
    from dynarl.workers.config import ModelConfig
    from dynarl.workers.megatron.layout import Layout, build_groups
    from dynarl.workers.megatron.rank import MegatronRank
    from dynarl.workers.megatron.spec import ModelSpec
    from dynarl.workers.torch.trainer_config import TrainerConfig

    world, shape, steps = job
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=worker, world_size=world
    )
    hidden, layers = (int(x) for x in shape.split("x"))
    model = ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=4 * hidden,
        max_seq_len=64,
    )
    spec = ModelSpec(model=model, seed=0, distributed_optimizer=True)
    groups = build_groups(Layout(tuple(range(world)), 1, 1), worker=worker, timeout_s=120)
    assert groups is not None
    rank = MegatronRank.create(
        spec,
        loss_fn=GrpoLoss.from_config(AlgorithmConfig()),
        config=TrainerConfig(micro_batch_size=8, lr=1e-3, timeout_s=120.0),
        groups=groups,
        hf_state=spec.hf_state(),
    )
    adam = rank.distributed
    assert adam is not None
    step_s, copy_s = [], []
    for step in range(steps):
        batch = {k: torch.as_tensor(v) for k, v in random_minibatch(step, num_samples=16).items()}
        dist.barrier()
        started = time.perf_counter()
        rank.train_step(batch)
        step_s.append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        adam.keep_copies(rank.num_steps)  # the same boundary again: the copy alone
        copy_s.append(time.perf_counter() - started)
    params = sum(p.numel() * p.element_size() for p in rank.model.parameters())
    results.put(
        (
            worker,
            {
                "step_s": step_s[1:],
                "copy_s": copy_s[1:],
                "copies_bytes": adam.copies.nbytes,
                "param_bytes": params,
            },
        )
    )
    dist.barrier()
    dist.destroy_process_group()


def run(shape: str, dp: int, steps: int) -> dict[str, Any]:
    """One shape on ``dp`` processes: the medians over the steps after the first, of
    the slowest rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(w, port, (dp, shape, steps), results))
        for w in range(dp)
    ]
    for p in processes:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        while len(got) < dp:
            worker, out = results.get(timeout=600)
            got[worker] = out
    except queue.Empty as exc:
        raise RuntimeError(f"the workers reported only {sorted(got)}") from exc
    finally:
        for p in processes:
            p.join(timeout=60)
    step = max(statistics.median(o["step_s"]) for o in got.values())
    copy = max(statistics.median(o["copy_s"]) for o in got.values())
    return {
        "shape": shape,
        "dp": dp,
        "param_mb": got[0]["param_bytes"] / 1e6,
        "copies_mb": max(o["copies_bytes"] for o in got.values()) / 1e6,
        "step_s": step,
        "copy_s": copy,
        "copy_share": copy / step,
    }


def main() -> None:
    """Parse the arguments, run each shape, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shapes", default="64x2,256x6,512x8", help="hidden x layers, ...")
    args = parser.parse_args()
    rows = [run(shape, args.dp, args.steps) for shape in args.shapes.split(",")]
    header = ("shape", "dp", "params MB", "copies MB", "step s", "copy s", "share")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (8, 3, 10, 10, 8, 8, 6), strict=True)))
    for r in rows:
        print(
            f"{r['shape']:>8} {r['dp']:>3} {r['param_mb']:>10.2f} {r['copies_mb']:>10.2f} "
            f"{r['step_s']:>8.3f} {r['copy_s']:>8.4f} {r['copy_share']:>6.1%}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
