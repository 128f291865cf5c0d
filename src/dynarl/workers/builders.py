"""Building a slot's roles: a rollout engine over the data plane's request queue, an
inference worker. Called in a worker thread; torch is imported here, on first use."""

import time
from typing import TYPE_CHECKING

import anyio

from dynarl.workers import protocol as p

if TYPE_CHECKING:
    from dynarl.workers.rollout_host import RolloutHost
    from dynarl.workers.torch.inference import InferenceWorker


def build_rollout(role: p.RolloutRole, name: str, num_threads: int) -> "RolloutHost":
    """Build a rollout engine whose waiting queue is the data plane's request queue."""
    import torch

    from dynarl.data.request_order import FifoOrder, ToolCallPriorityOrder
    from dynarl.data.request_queue import RequestQueue
    from dynarl.workers.rollout_host import RolloutHost
    from dynarl.workers.torch.engine import RolloutEngine
    from dynarl.workers.torch.sequence import Sequence

    torch.set_num_threads(num_threads)
    order = ToolCallPriorityOrder() if role.order == "priority" else FifoOrder()
    queue = RequestQueue[Sequence](
        order, max_size=role.max_queued_requests, clock=_MonotonicClock(), aging=role.aging
    )
    engine = RolloutEngine.from_config(role.model, role.rollout, seed=role.seed, queue=queue)
    return RolloutHost(engine, name=name)


def build_inference(role: p.InferenceRole, num_threads: int) -> "InferenceWorker":
    """An inference worker for ``role``."""
    import torch

    from dynarl.workers.torch.inference import InferenceWorker

    torch.set_num_threads(num_threads)
    return InferenceWorker.from_config(role.model, role.inference, seed=role.seed)


class _MonotonicClock:
    """Wall-clock time for the engine's queue (the engine's own clock): the queue is
    read from the stepping thread, where the event loop's clock is not available."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)
