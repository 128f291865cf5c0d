"""The run's weight-sync policy (:class:`~dynarl.api.engine_weights.EngineWeights`):
a sync that fails because a member died is retried on a rebuilt group; one an engine
refuses because its model does not fit the trainer's weights is not. The trainer and
the engines here are scripted stand-ins for worker processes (the real collective and
its drain are tested in tests/workers/test_worker_process.py)."""

import anyio
import pytest

from dynarl.api.engine_weights import EngineWeights
from dynarl.workers.errors import WeightManifestError, WorkerCallError
from dynarl.workers.weights import WeightBucket, WeightManifest, WeightSyncGroup

pytestmark = pytest.mark.anyio


class Trainer:
    """A sender that records the syncs it takes part in."""

    def __init__(self) -> None:
        self.sends: list[int] = []
        self.groups = 0
        self.weight_sync_ready = False

    async def host_weight_sync(self, host: str, world_size: int, timeout_s: float) -> int:
        return 29500

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        self.groups += 1
        self.weight_sync_ready = True

    async def leave_weight_sync(self) -> None:
        self.weight_sync_ready = False

    async def weight_manifest(self, version: int) -> WeightManifest:
        bucket = WeightBucket(names=("w",), dtypes=("float32",), shapes=((2,),))
        return WeightManifest(version=version, buckets=(bucket,))

    async def send_weights(self, version: int) -> int:
        self.sends.append(version)
        return 8


class Engine:
    """A member whose next updates fail with ``errors`` (then succeed)."""

    def __init__(self, name: str, errors: list[Exception]) -> None:
        self.name = name
        self.role = "rollout"
        self.engine: tuple[str, tuple[int, ...]] = ("rollout", (int(name[-1]),))
        self.in_weight_sync = False
        self.weight_sync_ranks = 1
        self.errors = errors
        self.updates = 0
        self.leaves = 0

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        pass

    async def leave_weight_sync(self) -> None:
        self.leaves += 1

    async def update_weights(self, manifest: WeightManifest) -> int:
        self.updates += 1
        if self.errors:
            raise self.errors.pop(0)
        return manifest.version


def weights(engines: list[Engine], trainer: Trainer) -> EngineWeights:
    held = EngineWeights(
        serving=lambda: list(engines),  # type: ignore[arg-type]
        sender_host=lambda _: "127.0.0.1",
        lost=set(),
    )
    held.trainer = trainer  # type: ignore[assignment]
    held.SYNC_BACKOFF_S = 0.0
    return held


async def test_a_sync_a_dead_member_broke_is_retried_on_a_new_group() -> None:
    trainer = Trainer()
    reset = WorkerCallError("Connection reset by peer", error="RuntimeError")
    engines = [Engine("slot-0", [reset]), Engine("slot-1", [])]
    held = weights(engines, trainer)
    assert await held.sync_weights(3) == 8
    assert held.version == 3
    assert engines[0].updates == 2 and trainer.groups == 2


async def test_an_engine_refusing_the_manifest_fails_the_sync_without_retries() -> None:
    trainer = Trainer()
    refusal = WorkerCallError(
        "the weight manifest has w as float32[2]; this engine's model has float32[3]",
        error="WeightManifestError",
    )
    engines = [Engine("slot-0", [refusal, refusal, refusal, refusal]), Engine("slot-1", [])]
    held = weights(engines, trainer)
    with anyio.fail_after(5), pytest.raises(WeightManifestError, match=r"float32\[3\]"):
        await held.sync_weights(3)
    assert engines[0].updates == 1 and trainer.sends == [3]
    assert held.version == 0


async def test_an_engine_replaced_for_other_devices_gets_the_weights_and_leaves_nothing() -> None:
    """A slot closes its engine for one on other devices while the old one is still in
    the group (no sync since it stopped serving): the old server is gone, so the group
    is abandoned, not left (leaving is collective), and the new engine, which starts
    from the seed's weights, is brought to the version the engines run."""
    trainer = Trainer()
    engines = [Engine("slot-0", []), Engine("slot-1", [])]
    held = weights(engines, trainer)
    await held.sync_weights(2)
    async with held.lock:
        await held.bring_up_to_date(engines)  # current: nothing to send
    assert trainer.sends == [2] and trainer.groups == 1
    held.engine_replaced("slot-0", (0,))
    async with held.lock:
        await held.bring_up_to_date([engines[0]])
    assert trainer.sends == [2, 2] and trainer.groups == 2
    assert engines[0].leaves == engines[1].leaves == 0  # abandoned, not left


async def test_each_engine_of_a_slot_holds_its_own_version() -> None:
    """A slot keeps a rollout engine of each size: the wide one takes a sync while the
    narrow one sleeps, so when the slot serves with the narrow one again it is brought
    to the version, and the wide one is current when the slot goes back to it."""
    trainer = Trainer()
    engines = [Engine("slot-0", []), Engine("slot-1", [])]
    held = weights(engines, trainer)
    await held.sync_weights(1)
    engines[0].engine = ("rollout", (0, 1))  # the slot regroups; slot-1 sleeps
    async with held.lock:
        await held.bring_up_to_date([engines[0]])  # a new engine: seed weights
    assert trainer.sends == [1, 1]
    await held.sync_weights(2)
    engines[0].engine = ("rollout", (0,))  # back to the narrow engine, asleep at 1
    async with held.lock:
        await held.bring_up_to_date(engines)
    assert trainer.sends == [1, 1, 2, 2]
    assert held.held_version(engines[0]) == 2  # type: ignore[arg-type]
    engines[0].engine = ("rollout", (0, 1))  # the wide one took version 2 itself
    async with held.lock:
        await held.bring_up_to_date([engines[0]])
    assert trainer.sends == [1, 1, 2, 2]
