"""The weight-sync group's membership, from the controller's side: the trainer's
sender and the engines that serve a role, built and torn down together, and one
broadcast to every member. Backend-neutral: the trainer is any
:class:`~dynarl.workers.trainer.Trainer`, the engines are typed worker handles."""

from collections.abc import Sequence
from typing import Protocol

import anyio

from dynarl.workers.errors import WeightManifestError, WorkerCallError
from dynarl.workers.trainer import Trainer
from dynarl.workers.weights import WeightManifest, WeightSyncGroup


class Member(Protocol):
    """An engine's side of the group, as a handle reaches it."""

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks it takes in the group (one per tensor-parallel rank)."""
        ...

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join ``group``."""
        ...

    async def leave_weight_sync(self) -> None:
        """Leave the group."""
        ...

    async def update_weights(self, manifest: WeightManifest) -> int:
        """Receive the broadcast ``manifest`` describes now; returns its version."""
        ...


async def connect(
    trainer: Trainer,
    engines: Sequence[Member],
    *,
    leaving: Sequence[Member] = (),
    connected: bool = False,
    host: str = "127.0.0.1",
    timeout_s: float = 120.0,
) -> None:
    """Build the weight-sync group: the trainer's sender (group rank 0, which opens
    the store on a free port of ``host`` before anyone joins) and ``engines`` (ranks
    1.., in order, each taking as many consecutive ranks as it has tensor-parallel
    ranks).

    With ``connected``, a group exists: ``leaving`` (its engines) and its sender leave
    it together first (no sync is in flight then: each broadcast returned on every
    member).
    """
    if connected:
        async with anyio.create_task_group() as tg:
            for engine in leaving:
                tg.start_soon(engine.leave_weight_sync)
            await trainer.leave_weight_sync()
    world_size = 1 + sum(engine.weight_sync_ranks for engine in engines)
    port = await trainer.host_weight_sync(host, world_size, timeout_s)
    async with anyio.create_task_group() as tg:
        rank = 1
        for engine in engines:
            group = WeightSyncGroup(
                host=host,
                port=port,
                rank=rank,
                world_size=world_size,
                timeout_s=timeout_s,
                num_ranks=engine.weight_sync_ranks,
            )
            rank += engine.weight_sync_ranks
            tg.start_soon(engine.join_weight_sync, group)
        await trainer.join_weight_sync(
            WeightSyncGroup(
                host=host, port=port, rank=0, world_size=world_size, timeout_s=timeout_s
            )
        )


async def broadcast(trainer: Trainer, version: int, engines: Sequence[Member]) -> int:
    """Send the trainer's weights tagged ``version`` to ``engines`` (every member of
    the group): the trainer describes what it sends, every engine is handed that
    manifest, then the broadcast runs. Returns the bytes sent.

    Raises:
        WeightManifestError: an engine's model does not fit the manifest (it took the
            broadcast in and threw it away; the others hold the new weights).
    """
    versions: list[int] = []
    manifest = await trainer.weight_manifest(version)
    if manifest.version != version:
        raise WorkerCallError(
            f"the trainer described weights version {manifest.version} when asked for {version}",
            error="WeightSyncError",
        )

    async def receive(engine: Member) -> None:
        try:
            versions.append(await engine.update_weights(manifest))
        except WorkerCallError as error:
            if error.error == WeightManifestError.__name__:
                raise WeightManifestError(str(error)) from error
            raise

    try:
        async with anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(receive, engine)
            sent = await trainer.send_weights(version)
    except BaseExceptionGroup as errors:
        refused = _refusal(errors)
        if refused is not None:
            raise refused from errors
        raise
    if versions != [version] * len(engines):
        raise WorkerCallError(
            f"engines received weight versions {versions}, not {version}: another sync "
            f"ran on the same group; sync one version at a time",
            error="WeightSyncError",
        )
    return sent


def _refusal(errors: BaseExceptionGroup) -> WeightManifestError | None:
    """The first engine's refusal of the manifest among ``errors``' leaves."""
    for error in errors.exceptions:
        found = _refusal(error) if isinstance(error, BaseExceptionGroup) else error
        if isinstance(found, WeightManifestError):
            return found
    return None
