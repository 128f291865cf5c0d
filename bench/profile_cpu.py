"""Measure the reference CPU workers, for the simulator's CPU profile.

One process, one torch thread (a device slot's size by default), the embedded model
shape unless ``--set model.*=...`` says otherwise:

- rollout decode step time against batch and held context (``RolloutEngine``);
- prefill time against prompt tokens;
- log-prob inference time against micro-batch tokens (``InferenceWorker``);
- one optimizer step against minibatch rows and width (``ElasticTrainer``, one rank).

Each is fitted by least squares and printed as a table and one JSON line whose numbers
are what :data:`dynarl.sim.cpu_profile.CPU_1T` holds (``bench/e2e_cpu.py --sim``
measures them again around its own run). On a shared machine the figures drift with
the other tenants' load, so every coefficient is the median of ``--repeat`` rounds::

    python bench/profile_cpu.py [--repeat 3] [--threads 1] [--set model.hidden_size=128]
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.rl.grpo import GrpoLoss
from dynarl.sim.cpu_profile import CPU_1T, CpuProfile
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.tokenizer import build_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.inference import InferenceWorker
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_config import TrainerConfig


def _fit(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return [float(c) for c in coef]


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode(cfg: DynaRLConfig) -> dict[str, float]:
    """Decode step ``= a + per_request * batch + per_context * context held``."""
    rows, ys = [], []
    for batch in (1, 4, 16, 64):
        for prompt in (8, 64):
            engine = RolloutEngine.from_config(cfg.model, cfg.rollout)
            steps = 48
            for i in range(batch):
                engine.add_request(
                    GenerateRequest(
                        request_id=f"r{i}",
                        prompt_ids=(2,) + (5,) * (prompt - 1),
                        sampling=SamplingParams(max_new_tokens=steps, ignore_eos=True, seed=i),
                    )
                )
            engine.step()  # prefill
            engine.step()
            for k in range(steps - 4):
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                context = batch * (prompt + 2 + k)
                if k % 4 == 0:
                    rows.append((1.0, float(batch), float(context)))
                    ys.append(dt)
    a, per_request, per_context = _fit(rows, ys)
    return {
        "decode_a_s": a,
        "decode_per_request_s": per_request,
        "decode_per_context_s": per_context,
    }


def prefill(cfg: DynaRLConfig) -> dict[str, float]:
    """Prefill of one batch ``= overhead + per_token * padded tokens``."""
    rows, ys = [], []
    for batch in (1, 8, 32):
        for prompt in (8, 32, 96):
            engine = RolloutEngine.from_config(cfg.model, cfg.rollout)

            def run(
                engine: RolloutEngine = engine, batch: int = batch, prompt: int = prompt
            ) -> None:
                for i in range(batch):
                    engine.add_request(
                        GenerateRequest(
                            request_id=f"p{time.perf_counter_ns()}-{i}",
                            prompt_ids=(2,) + (5,) * (prompt - 1),
                            sampling=SamplingParams(max_new_tokens=1, ignore_eos=True, seed=i),
                        )
                    )
                engine.step()

            run()
            rows.append((1.0, float(batch * prompt)))
            ys.append(_median_s(run, 5))
    overhead, per_token = _fit(rows, ys)
    return {"prefill_overhead_s": overhead, "prefill_per_token_s": per_token}


def inference(cfg: DynaRLConfig) -> dict[str, float]:
    """One micro-batch forward ``= overhead + per_token * padded tokens``."""
    worker = InferenceWorker.from_config(cfg.model, cfg.inference)
    rows, ys = [], []
    for batch in (1, 4, 16):
        for length in (16, 64, 200):
            reqs = [
                LogprobRequest(
                    item_id=f"i{i}",
                    token_ids=(2,) + (5,) * (length - 1),
                    response_start=length // 2,
                )
                for i in range(batch)
            ]

            def run(reqs: list[LogprobRequest] = reqs) -> None:
                worker.submit(reqs)
                worker.run()

            run()
            rows.append((1.0, float(batch * length)))
            ys.append(_median_s(run, 5))
    overhead, per_token = _fit(rows, ys)
    return {"inference_overhead_s": overhead, "inference_per_token_s": per_token}


def train(cfg: DynaRLConfig) -> dict[str, float]:
    """One optimizer step on one rank ``= overhead + per_micro_batch * micro-batches +
    per_token * padded tokens``."""
    tc = TrainerConfig(micro_batch_size=cfg.actor.micro_batch_size, seed=0, num_threads=1)
    trainer = ElasticTrainer.build(
        lambda: build_model(cfg.model, seed=0, tokenizer=build_tokenizer()),
        loss_fn=GrpoLoss.from_config(cfg.algorithm),
        config=tc,
        device=torch.device("cpu"),
        group=None,
    )
    rows, ys = [], []
    for num in (8, 32, 64):
        for width in (16, 64, 200):
            batch = {
                "input_ids": torch.full((num, width), 5, dtype=torch.long),
                "attention_mask": torch.ones((num, width), dtype=torch.long),
                "loss_mask": torch.ones((num, width), dtype=torch.float32),
                "old_logprobs": torch.full((num, width), -4.0),
                "advantages": torch.linspace(-1, 1, num),
            }

            def run(batch: dict[str, torch.Tensor] = batch) -> None:
                trainer.train_step(batch)

            run()
            micro = -(-num // tc.micro_batch_size)
            rows.append((1.0, float(micro), float(num * width)))
            ys.append(_median_s(run, 3))
    overhead, per_micro, per_token = _fit(rows, ys)
    return {
        "train_overhead_s": overhead,
        "train_per_micro_batch_s": per_micro,
        "train_per_token_s": per_token,
    }


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


PARTS: tuple[Callable[[DynaRLConfig], dict[str, float]], ...] = (decode, prefill, inference, train)


def measure(cfg: DynaRLConfig, *, repeat: int = 3, threads: int = 1) -> dict[str, float]:
    """Every coefficient, the median over ``repeat`` rounds (a shared machine's speed
    drifts by 2-3x over minutes; the median of interleaved rounds is steadier)."""
    torch.set_num_threads(threads)
    rounds = [{k: v for part in PARTS for k, v in part(cfg).items()} for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def profile_from(measured: dict[str, float], *, name: str = "cpu-measured") -> CpuProfile:
    """A :class:`CpuProfile` with the measured compute costs (fitted terms clipped at
    zero) and :data:`CPU_1T`'s migration and sync costs."""
    m = {k: max(0.0, v) for k, v in measured.items()}
    return msgspec.structs.replace(
        CPU_1T,
        name=name,
        decode_step_s=m["decode_a_s"],
        decode_per_request_s=m["decode_per_request_s"],
        decode_per_context_token_s=m["decode_per_context_s"],
        prefill_overhead_s=m["prefill_overhead_s"],
        prefill_per_token_s=m["prefill_per_token_s"],
        inference_overhead_s=m["inference_overhead_s"],
        inference_per_token_s=m["inference_per_token_s"],
        train_overhead_s=m["train_overhead_s"] + m["train_per_micro_batch_s"],
        train_per_token_s=m["train_per_token_s"],
    )


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
