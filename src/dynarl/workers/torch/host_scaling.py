"""How device slots on this host slow each other down: the simulator's host-sharing
curve (:class:`~dynarl.sim.host.HostSharing`).

``max_slots`` slot processes are started the way the real slots are (``OMP_NUM_THREADS``
set before torch is imported, ``threads`` torch threads each), each with a rollout
engine of the run's model. For ``n = 1 .. max_slots``, ``n`` of them decode together
through the same window of wall time (rounds of 16 requests, prefill included), and
the mean step time of a slot among ``n`` busy ones over that of a slot alone is the
curve's ``n``-th point. Every point is the median of ``repeat`` passes; a pass goes up
and back down the curve, so slow drift of a shared machine's load hits both ends alike.
"""

import multiprocessing
import os
import statistics
import time
from multiprocessing.connection import Connection

from dynarl.api.config import DynaRLConfig

_REQUESTS = 16
_NEW_TOKENS = 48


def _slot(conn: Connection, cfg: DynaRLConfig, threads: int) -> None:
    """One slot: on ``(start wall time, window s)``, decode from that time for the
    window and answer ``(steps, seconds)``; on ``None``, leave."""
    import torch

    from dynarl.workers.rollout import GenerateRequest, SamplingParams
    from dynarl.workers.torch.engine import RolloutEngine

    torch.set_num_threads(threads)
    engine = RolloutEngine.from_config(cfg.model, cfg.rollout)
    serial = 0

    def refill() -> None:
        nonlocal serial
        for _ in range(_REQUESTS):
            serial += 1
            engine.add_request(
                GenerateRequest(
                    request_id=f"h{serial}",
                    prompt_ids=(2,) + (5,) * 15,
                    sampling=SamplingParams(
                        max_new_tokens=_NEW_TOKENS, ignore_eos=True, seed=serial
                    ),
                )
            )

    conn.send("ready")
    while (order := conn.recv()) is not None:
        start, window_s = order
        time.sleep(max(0.0, start - time.time()))
        t0 = time.perf_counter()
        steps = 0
        while (elapsed := time.perf_counter() - t0) < window_s:
            if not engine.num_unfinished:
                refill()
            engine.step()
            steps += 1
        conn.send((steps, elapsed))


def host_slowdown(
    cfg: DynaRLConfig,
    max_slots: int,
    *,
    threads: int = 1,
    window_s: float = 2.0,
    repeat: int = 1,
) -> tuple[float, ...]:
    """The slowdown of ``1 .. max_slots`` slots decoding at once on this host (the first
    point is 1.0): element ``n - 1`` is a slot's mean decode step time while ``n``
    slots decode together, over one slot's alone."""
    if max_slots < 1:
        raise ValueError(f"max_slots={max_slots}: measure at least one slot")
    context = multiprocessing.get_context("spawn")
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the children read it at torch import
    procs, conns = [], []
    try:
        for _ in range(max_slots):
            parent, child = context.Pipe()
            proc = context.Process(target=_slot, args=(child, cfg, threads), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            conn.recv()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    try:

        def step_s(n: int, window: float) -> float:
            start = time.time() + 0.2
            for conn in conns[:n]:
                conn.send((start, window))
            answers: list[tuple[int, float]] = [conn.recv() for conn in conns[:n]]
            return statistics.mean(seconds / max(steps, 1) for steps, seconds in answers)

        step_s(max_slots, window_s / 4)  # warm-up: every slot's first steps
        sizes = list(range(1, max_slots + 1))
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeat):
            for n in sizes + sizes[::-1]:
                samples[n].append(step_s(n, window_s))
        alone = statistics.median(samples[1])
        return tuple(
            1.0 if n == 1 else round(statistics.median(samples[n]) / alone, 3) for n in sizes
        )
    finally:
        for conn in conns:
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
