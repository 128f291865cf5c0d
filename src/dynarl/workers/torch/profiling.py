"""A short profiling run of the reference torch workers on this machine: the costs the
simulator needs to model it (``dynarl profile`` writes them to a profile file).

One process with ``threads`` torch threads (one device slot), the run's model section:

- rollout decode step time against batch and context held (``RolloutEngine``);
- prefill time against prompt tokens;
- log-prob inference time against micro-batch tokens (``InferenceWorker``);
- one optimizer step against minibatch rows and width (``ElasticTrainer``, one rank);
- what a step costs on top when the worker's loop drives it (:class:`TorchRollout`
  steps the engine in a worker thread, under a lock, and hands completions to their
  sinks), and what the running batch's KV cache costs when rows join or leave it
  (the left-padded cache is rebuilt: every held token copied);
- transfer bandwidth between two slots: a tensor broadcast over gloo between two
  processes, as weights and optimizer state move;
- how slots sharing this host's cores slow each other down
  (:mod:`dynarl.workers.torch.host_scaling`).

Each cost is fitted by least squares; on a shared machine the figures drift with the
other tenants' load, so every coefficient is the median of ``repeat`` rounds.
"""

import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import numpy as np
import torch

from dynarl.rl.grpo import GrpoLoss
from dynarl.workers.backend_protocols import MachineMeasurement, ProfiledJob
from dynarl.workers.inference import LogprobRequest
from dynarl.workers.rollout import Completion, GenerateRequest, SamplingParams
from dynarl.workers.torch.batch_cache import BatchCache
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.inference import InferenceWorker
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.rollout_server import TorchRollout
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_config import TrainerConfig


def _fit(rows: Sequence[tuple[float, ...]], ys: Sequence[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return [float(c) for c in coef]


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode(cfg: ProfiledJob) -> dict[str, float]:
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


def prefill(cfg: ProfiledJob) -> dict[str, float]:
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


def _requests(num: int, prompt: int, max_new_tokens: int, tag: str) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"{tag}{i}",
            prompt_ids=(2,) + (5,) * (prompt - 1),
            sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=i),
        )
        for i in range(num)
    ]


class _Counter:
    """A request sink that only counts completions and sets ``done`` at the last."""

    def __init__(self, num: int) -> None:
        self.left = num
        self.done_event = anyio.Event()

    def done(self, completion: Completion) -> None:
        self.left -= 1
        if not self.left:
            self.done_event.set()

    def aborted(self, request: GenerateRequest) -> None:
        raise AssertionError("nothing is aborted while profiling")

    async def flush(self) -> None:
        pass

    async def fail(self, error: Exception) -> None:
        raise error


def _direct_s(engine: RolloutEngine, requests: list[GenerateRequest]) -> tuple[float, int]:
    for request in requests:
        engine.add_request(request)
    steps = 0
    t0 = time.perf_counter()
    while engine.num_unfinished:
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


async def _served_s(engine: RolloutEngine, requests: list[GenerateRequest]) -> float:
    server = TorchRollout(engine, name="profile")
    sink = _Counter(len(requests))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        t0 = time.perf_counter()
        await server.submit(requests, sink)
        await sink.done_event.wait()
        elapsed = time.perf_counter() - t0
        tg.cancel_scope.cancel()
    return elapsed


def dispatch(cfg: ProfiledJob, rounds: int = 8) -> dict[str, float]:
    """What an engine step costs on top of :meth:`RolloutEngine.step` when the worker's
    loop (:class:`TorchRollout`) drives it: a hop to a worker thread and back, the
    engine lock, completions handed to their sinks. The same requests run stepped
    directly and served, alternately on one event loop; the median over ``rounds`` of
    the difference per step."""
    engine = RolloutEngine.from_config(cfg.model, cfg.rollout)

    async def alternate() -> list[float]:
        diffs = []
        for r in range(rounds + 1):
            direct_s, steps = _direct_s(engine, _requests(32, 8, 48, f"d{r}-"))
            served_s = await _served_s(engine, _requests(32, 8, 48, f"s{r}-"))
            if r:  # the first round warms both paths up
                diffs.append((served_s - direct_s) / steps)
        return diffs

    return {"step_dispatch_s": statistics.median(anyio.run(alternate))}


def churn(cfg: ProfiledJob) -> dict[str, float]:
    """What rows joining or leaving the running batch cost per token of KV it holds:
    the reference engine's cache is one left-padded tensor per layer, rebuilt (every
    held token copied) when a prefill appends rows and when finished rows leave.

    Joining: a prefill of two short prompts into a batch of ``rows x width`` held
    tokens, ``= overhead + join_per_held_token * held``. Leaving: the cache keeping
    all rows but one, ``= overhead + leave_per_held_token * held``."""
    join_rows: list[tuple[float, ...]] = []
    join_ys: list[float] = []
    leave_rows: list[tuple[float, ...]] = []
    leave_ys: list[float] = []
    max_rows = max(4, cfg.rollout.max_running_requests - 2)
    for num in sorted({4, min(24, max_rows), max_rows}):
        for width in (16, 96, cfg.model.max_seq_len // 2):
            engine = RolloutEngine.from_config(cfg.model, cfg.rollout)
            for request in _requests(num, width, cfg.model.max_seq_len - width - 1, "r"):
                engine.add_request(request)
            engine.step()  # prefill the batch
            engine.step()
            held = float(num * (width + 1))
            times = []
            for k in range(8):
                for request in _requests(2, 8, 4, f"j{k}-"):
                    engine.add_request(request)
                t0 = time.perf_counter()
                engine.step()  # prefills the two into the running batch
                times.append(time.perf_counter() - t0)
                engine.abort([f"j{k}-0", f"j{k}-1"])
            join_rows.append((1.0, held))
            join_ys.append(statistics.median(times))
            cache = BatchCache(engine.model, pad_token_id=0)
            cache.prefill([(2,) + (5,) * (width - 1)] * num)
            times = []
            for _ in range(min(8, num - 1)):  # a middle row leaves, each time one fewer
                held = float(cache.num_rows * cache.width_tokens)
                rows = [r for r in range(cache.num_rows) if r != cache.num_rows // 2]
                t0 = time.perf_counter()
                cache.keep(rows)
                times.append(time.perf_counter() - t0)
            leave_rows.append((1.0, held))
            leave_ys.append(statistics.median(times))
    _, join = _fit(join_rows, join_ys)
    _, leave = _fit(leave_rows, leave_ys)
    return {"join_per_held_token_s": join, "leave_per_held_token_s": leave}


def inference(cfg: ProfiledJob) -> dict[str, float]:
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


def train(cfg: ProfiledJob) -> dict[str, float]:
    """One optimizer step on one rank ``= overhead + (per_token + per_token_context *
    width / 2) * padded tokens`` (attention makes a token of a wider minibatch dearer;
    widths up to the model's ``max_seq_len``)."""
    tc = TrainerConfig(
        micro_batch_size=cfg.actor.micro_batch_size, seed=0, num_threads=torch.get_num_threads()
    )
    trainer = ElasticTrainer.build(
        lambda: build_model(cfg.model, seed=0),
        loss_fn=GrpoLoss.from_config(cfg.algorithm),
        config=tc,
        device=torch.device("cpu"),
        group=None,
    )
    rows, ys = [], []
    for num in (8, 32, 64):
        for width in sorted({16, 64, min(200, cfg.model.max_seq_len), cfg.model.max_seq_len}):
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
            rows.append((1.0, float(num * width), num * width * width / 2))
            ys.append(_median_s(run, 3))
    overhead, per_token, per_token_context = _fit(rows, ys)
    return {
        "train_overhead_s": overhead,
        "train_per_token_s": per_token,
        "train_per_token_context_s": per_token_context,
    }


def _broadcast_peer(store: str, num_bytes: int, rounds: int) -> None:
    """Rank 1 of :func:`transfer`: receive the broadcasts."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
    try:
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        for _ in range(rounds + 1):
            dist.broadcast(buffer, src=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def transfer(num_bytes: int = 64 * 2**20, rounds: int = 5) -> dict[str, float]:
    """Bandwidth of a ``num_bytes`` broadcast over gloo between two processes (the
    median of ``rounds``, after one warm-up), in bytes per second."""
    import torch.distributed as dist

    if dist.is_initialized():  # this process already belongs to a group: measure nothing
        raise RuntimeError("profile transfers from a process outside torch.distributed")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        context = multiprocessing.get_context("spawn")
        peer = context.Process(target=_broadcast_peer, args=(store, num_bytes, rounds))
        peer.start()
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=2)
            try:
                payload = torch.ones(num_bytes, dtype=torch.uint8)
                dist.broadcast(payload, src=0)  # warm-up: connection setup
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    dist.broadcast(payload, src=0)
                    times.append(time.perf_counter() - t0)
                dist.barrier()
            finally:
                dist.destroy_process_group()
        finally:
            peer.join(timeout=60)
            if peer.is_alive():
                peer.kill()
    return {"transfer_bytes_per_s": num_bytes / statistics.median(times)}


PARTS: tuple[Callable[[ProfiledJob], dict[str, float]], ...] = (
    decode,
    prefill,
    dispatch,
    churn,
    inference,
    train,
)


def measure(cfg: ProfiledJob, *, repeat: int = 3, threads: int = 1) -> dict[str, float]:
    """Every compute coefficient, the median over ``repeat`` rounds (a shared machine's
    speed drifts over minutes; the median of interleaved rounds is steadier)."""
    torch.set_num_threads(threads)
    rounds = [{k: v for part in PARTS for k, v in part(cfg).items()} for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def measure_machine(
    cfg: ProfiledJob,
    *,
    repeat: int = 3,
    threads: int = 1,
    host_slots: int | None = None,
) -> MachineMeasurement:
    """Measure this machine running ``cfg``'s model on slots of ``threads`` threads:
    the costs ``dynarl profile`` writes. ``host_slots`` slots (default: the config's
    ``cluster.num_devices``) measure how slots sharing this host slow each other down
    (:func:`~dynarl.workers.torch.host_scaling.host_slowdown`); 0 or 1 leaves the
    curve out (the simulated slots are then independent)."""
    from dynarl.workers.torch.host_scaling import host_slowdown

    costs = measure(cfg, repeat=repeat, threads=threads)
    costs.update(transfer())
    host = (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {threads} thread(s) per slot"
    )
    slots = cfg.cluster.num_devices if host_slots is None else host_slots
    curve = None
    if slots >= 2:
        curve = host_slowdown(
            cfg.model, cfg.rollout, slots, threads=threads, repeat=max(1, repeat // 2)
        )
    return MachineMeasurement(
        costs=costs, host_slowdown=curve, host=host, threads=threads, name=platform.node()
    )
