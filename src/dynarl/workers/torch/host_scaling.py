"""How device slots on this host slow each other down: the simulator's host-sharing
curve (:class:`~dynarl.sim.host.HostSharing`).

``max_slots`` slot processes are started the way the real slots are (``OMP_NUM_THREADS``
set before torch is imported, ``threads`` torch threads each), each with a rollout
engine of the given model and rollout sections. For ``n = 2 .. max_slots``, one slot
decodes alone through a window of wall time, then ``n`` decode together through the
next one (rounds of 16 requests, prefill included); the mean step time of a slot among
``n`` busy ones over that of the slot alone is one ratio, and the curve's ``n``-th
point is the median of ``3 x repeat`` such ratios. Measuring each ratio back to back
keeps a shared machine's drifting load (other tenants) out of it as far as it can be.
"""

import contextlib
import multiprocessing
import multiprocessing.process
import os
import statistics
import time
from multiprocessing.connection import Connection

from dynarl.workers.config import ModelConfig, RolloutConfig

_REQUESTS = 16
_NEW_TOKENS = 48


def _slot(conn: Connection, model: ModelConfig, rollout: RolloutConfig, threads: int) -> None:
    """One slot: on ``(start wall time, window s)``, decode from that time for the
    window and answer ``(steps, seconds)``; on ``None``, leave."""
    import torch

    from dynarl.workers.rollout import GenerateRequest, SamplingParams
    from dynarl.workers.torch.engine import RolloutEngine

    torch.set_num_threads(threads)
    engine = RolloutEngine.from_config(model, rollout)
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


class SlotPool:
    """``num_slots`` idle slot processes (rollout engines of ``model`` and ``rollout``),
    started the way the real slots are, that
    measure the host-sharing curve on demand (:meth:`curve`); idle between
    measurements (blocked on their pipe), so a pool can stay open through a run and
    measure between its iterations. Close it (or use it as a context manager)."""

    def __init__(
        self, model: ModelConfig, rollout: RolloutConfig, num_slots: int, *, threads: int = 1
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: measure at least one slot")
        context = multiprocessing.get_context("spawn")
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the children read it at torch import
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        try:
            for _ in range(num_slots):
                parent, child = context.Pipe()
                proc = context.Process(
                    target=_slot, args=(child, model, rollout, threads), daemon=True
                )
                proc.start()
                self._procs.append(proc)
                self._conns.append(parent)
            for conn in self._conns:
                conn.recv()
            self._step_s(num_slots, 0.25)  # warm-up: every slot's first steps
        except BaseException:
            self.close()
            raise
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def __enter__(self) -> "SlotPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_s(self, n: int, window_s: float) -> float:
        """Mean decode step time of ``n`` slots decoding through one window together."""
        start = time.time() + 0.2
        for conn in self._conns[:n]:
            conn.send((start, window_s))
        answers: list[tuple[int, float]] = [conn.recv() for conn in self._conns[:n]]
        return statistics.mean(seconds / max(steps, 1) for steps, seconds in answers)

    def curve(self, *, window_s: float = 1.0, repeat: int = 1) -> tuple[float, ...]:
        """The slowdown of ``1 .. num_slots`` slots decoding at once, measured now."""
        curve = [1.0]
        for n in range(2, len(self._conns) + 1):
            # one slot alone, then n together, back to back: each ratio sees one load
            ratios = [
                self._step_s(n, window_s) / self._step_s(1, window_s) for _ in range(3 * repeat)
            ]
            curve.append(round(statistics.median(ratios), 3))
        return tuple(curve)

    def close(self) -> None:
        """Stop the slot processes."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []


def host_slowdown(
    model: ModelConfig,
    rollout: RolloutConfig,
    max_slots: int,
    *,
    threads: int = 1,
    window_s: float = 1.0,
    repeat: int = 1,
) -> tuple[float, ...]:
    """The slowdown of ``1 .. max_slots`` slots decoding at once on this host (the first
    point is 1.0): element ``n - 1`` is a slot's mean decode step time while ``n``
    slots decode together, over one slot's alone."""
    with SlotPool(model, rollout, max_slots, threads=threads) as pool:
        return pool.curve(window_s=window_s, repeat=repeat)
