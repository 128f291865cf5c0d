"""The torch inference worker behind the :class:`~dynarl.workers.inference.InferenceEngine`
protocol: one score call at a time, each run in a worker thread."""

from collections.abc import Sequence

import anyio

from dynarl.workers.inference import InferenceProgress, LogprobRequest, LogprobResult
from dynarl.workers.torch import weight_sync
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.inference import InferenceWorker
from dynarl.workers.weights import WeightManifest, WeightReceiver, WeightSyncGroup


class TorchInference:
    """Drives an :class:`~dynarl.workers.torch.inference.InferenceWorker` from an event
    loop.

    Args:
        worker: the worker.
        name: for error messages.
    """

    def __init__(self, worker: InferenceWorker, *, name: str) -> None:
        self.worker = worker
        self.name = name
        self._lock = anyio.Lock()
        self.sync = weight_sync.Membership()
        """Its place in the weight-sync group."""

    @property
    def weight_version(self) -> int:
        """Version of the policy weights."""
        return self.worker.weight_version

    async def score(self, requests: Sequence[LogprobRequest]) -> list[LogprobResult]:
        """Log-probs of ``requests``, in order (one call at a time)."""
        async with self._lock:
            self.worker.submit(requests)
            return await anyio.to_thread.run_sync(self.worker.run)

    def progress(self) -> InferenceProgress:
        """Samples scored and waiting."""
        return self.worker.progress()

    async def release_memory(self) -> None:
        """Free the models' parameters (a host copy is kept)."""
        async with self._lock:
            self.worker.release_memory_occupation()

    async def resume_memory(self) -> None:
        """Allocate and restore the parameters."""
        async with self._lock:
            self.worker.resume_memory_occupation()

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the trainer's weight-sync group."""
        await self.sync.join(group, device=next(iter(self.worker.policy.parameters())).device)

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Receive the policy weights the trainer broadcasts now, as ``manifest``
        describes them."""
        if self.sync.group is None:
            raise EngineError(f"{self.name} is in no weight-sync group; join one first")
        async with self._lock:
            return await anyio.to_thread.run_sync(
                self.worker.update_weights, self.sync.group, manifest
            )

    def adopt_weight_sync(self, other: WeightReceiver) -> bool:
        """Take ``other``'s membership if it is a torch engine of this process."""
        return self.sync.adopt(getattr(other, "sync", None))

    async def leave_weight_sync(self) -> None:
        """Leave the weight-sync group."""
        await self.sync.leave()
