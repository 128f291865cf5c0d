"""Measure the reference CPU workers, for the simulator's CPU profile.

One process, one torch thread (a device slot's size by default), the embedded model
shape unless ``--set model.*=...`` says otherwise:

- rollout decode step time against batch and held context (``RolloutEngine``);
- prefill time against prompt tokens;
- log-prob inference time against micro-batch tokens (``InferenceWorker``);
- one optimizer step against minibatch rows and width (``ElasticTrainer``, one rank).

Each is fitted by least squares (:mod:`dynarl.workers.torch.profiling`, which
``dynarl profile`` runs to write a profile file) and printed as a table and one JSON
line whose numbers are what :data:`dynarl.sim.cpu_profile.CPU_1T` holds
(``bench/e2e_cpu.py --sim`` measures them again around its own run). On a shared
machine the figures drift with the other tenants' load, so every coefficient is the
median of ``--repeat`` rounds::

    python bench/profile_cpu.py [--repeat 3] [--threads 1] [--set model.hidden_size=128]
"""

import argparse
import json
import statistics
import time

import torch

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.profiling import measure, profile_from

__all__ = ["host_scaling", "measure", "profile_from"]


def _decode_loop(cfg: DynaRLConfig, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    engine = RolloutEngine.from_config(cfg.model, cfg.rollout)
    for i in range(16):
        engine.add_request(
            GenerateRequest(
                request_id=f"h{i}",
                prompt_ids=(2,) + (5,) * 15,
                sampling=SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, seed=i),
            )
        )
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def host_scaling(cfg: DynaRLConfig, num_slots: int, *, steps: int = 300) -> float:
    """Decode step time of ``num_slots`` engines stepping at once in separate processes,
    over one engine's alone: 1.0 when slots are independent, ``num_slots`` when they
    share one core's worth of CPU."""
    import concurrent.futures
    import multiprocessing

    alone = _decode_loop(cfg, steps, 1)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(num_slots, mp_context=context) as pool:
        list(pool.map(_decode_loop, [cfg] * num_slots, [10] * num_slots, [1] * num_slots))
        together = list(
            pool.map(_decode_loop, [cfg] * num_slots, [steps] * num_slots, [1] * num_slots)
        )
    return statistics.mean(together) / alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--host-scaling",
        type=int,
        metavar="N",
        help="only measure how N slots decoding at once slow each other down",
    )
    args = parser.parse_args()
    cfg = apply_overrides(DynaRLConfig(), args.set)
    if args.host_scaling:
        slowdown = host_scaling(cfg, args.host_scaling)
        print(f"{args.host_scaling} slots decoding at once: each step x{slowdown:.2f}")
        print(
            json.dumps(
                {
                    "bench": "host_scaling",
                    "slots": args.host_scaling,
                    "slowdown": round(slowdown, 3),
                }
            )
        )
        return
    t0 = time.perf_counter()
    out = measure(cfg, repeat=args.repeat, threads=args.threads)
    for key, value in out.items():
        print(f"{key:28s} {value * 1e3:9.4f} ms")
    print(f"({time.perf_counter() - t0:.1f} s)")
    print(json.dumps({"bench": "profile_cpu", "threads": args.threads, **out}))


if __name__ == "__main__":
    main()
