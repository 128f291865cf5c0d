"""Modelled compute-bound stages: log-prob inference replicas and the trainer.

Both are driven by :class:`~dynarl.sim.world.SimWorld` on its virtual clock; they keep
only timing state and never emit events themselves.

* :class:`InferenceStage`: each replica (``tp`` devices) takes the samples it was given
  (by :class:`~dynarl.sim.inference.InferenceFleet`) in micro-batches; a micro-batch
  takes its FLOPs at the inference cost model's rate. A drained replica loses the
  micro-batch in progress (it is recomputed elsewhere).
* :class:`ActorStep`: one optimizer step over a minibatch on the actor's devices at the
  actor cost model's rate; the trainer moves only between steps.
"""

import math
from collections import deque
from collections.abc import Callable

from dynarl.core.ids import InstanceId, ItemId
from dynarl.sim.costs import InferenceCost, attended_context


class _Replica:
    __slots__ = ("batch", "busy_s", "done_s", "queue", "started_s")

    def __init__(self) -> None:
        self.queue: deque[ItemId] = deque()
        self.batch: list[ItemId] = []
        self.done_s: float | None = None
        self.started_s = 0.0
        self.busy_s = 0.0


class InferenceStage:
    """Inference replicas working through the samples the data plane gave them.

    Args:
        cost: the inference cost model (its ``tp`` is the replica size).
        micro_batch: samples per forward pass.
        tokens: a sample's length in tokens.
    """

    def __init__(
        self, cost: InferenceCost, micro_batch: int, tokens: Callable[[ItemId], int]
    ) -> None:
        self.cost = cost
        self.micro_batch = micro_batch
        self.tokens = tokens
        self.replicas: dict[InstanceId, _Replica] = {}
        self.busy_device_s = 0.0
        self.slowdown = 1.0  # the host's: a micro-batch takes this many times its alone time

    def add(self, iid: InstanceId) -> None:
        """A new replica."""
        self.replicas.setdefault(iid, _Replica())

    def assign(self, iid: InstanceId, item: ItemId) -> None:
        """Give ``item`` to replica ``iid`` (it runs in one of its next micro-batches)."""
        self.replicas[iid].queue.append(item)

    def start(self, now_s: float) -> None:
        """Idle replicas with samples start their next micro-batch."""
        for r in self.replicas.values():
            if r.done_s is None and r.queue:
                r.batch = [r.queue.popleft() for _ in range(min(self.micro_batch, len(r.queue)))]
                lengths = [self.tokens(i) for i in r.batch]
                total = sum(lengths)
                mean_context = attended_context(lengths)
                r.started_s = now_s
                alone_s = self.cost.time_s(total, self.cost.tp, mean_context)
                r.done_s = now_s + alone_s * self.slowdown

    def set_slowdown(self, factor: float, now_s: float) -> None:
        """From ``now_s`` on, micro-batches take ``factor`` times their alone time
        (the running ones, for what is left of them)."""
        for r in self.replicas.values():
            if r.done_s is not None:
                r.done_s = now_s + (r.done_s - now_s) * factor / self.slowdown
        self.slowdown = factor

    def busy(self) -> list[InstanceId]:
        """The replicas running a micro-batch."""
        return [iid for iid, r in self.replicas.items() if r.done_s is not None]

    def next_time(self) -> float:
        """When the next micro-batch finishes (``inf`` if none runs)."""
        return min(
            (r.done_s for r in self.replicas.values() if r.done_s is not None), default=math.inf
        )

    def finish(self, now_s: float) -> list[tuple[InstanceId, list[ItemId]]]:
        """Micro-batches done by ``now_s``: (replica, samples), in replica order."""
        out = []
        for iid, r in self.replicas.items():
            if r.done_s is not None and r.done_s <= now_s:
                self.busy_device_s += (r.done_s - r.started_s) * self.cost.tp
                out.append((iid, r.batch))
                r.batch, r.done_s = [], None
        return out

    def drain(self, iid: InstanceId, now_s: float) -> list[ItemId]:
        """Remove replica ``iid``; return the samples it held (its running micro-batch
        is lost and counts as busy time)."""
        r = self.replicas.pop(iid, None)
        if r is None:
            return []
        if r.done_s is not None:
            self.busy_device_s += (now_s - r.started_s) * self.cost.tp
        return [*r.batch, *r.queue]


class ActorStep:
    """The optimizer step in progress: its samples (per replica), end and duration."""

    __slots__ = ("devices", "end_s", "items", "start_s")

    def __init__(
        self, items: list[tuple[ItemId, InstanceId]], start_s: float, end_s: float, devices: int
    ) -> None:
        self.items = items
        self.start_s = start_s
        self.end_s = end_s
        self.devices = devices

    def stretch(self, ratio: float, now_s: float) -> None:
        """What is left of the step after ``now_s`` takes ``ratio`` times as long."""
        self.end_s = now_s + (self.end_s - now_s) * ratio

    @property
    def device_s(self) -> float:
        """Device-seconds the step occupies."""
        return (self.end_s - self.start_s) * self.devices
