"""The engines' weights in a real run: the weight-sync group and the version it holds.

The group is the trainer's rank 0 (the sender) and every slot that serves a role now. A
slot that switches roles keeps its place when its backend can hand it to the new role,
and rejoins otherwise. The version each engine of a slot holds is tracked apart (a slot
keeps a rollout engine per size, and an inference worker, asleep beside the one it
serves; each starts from the seed's weights, version 0). A slot that takes a role
mid-run gets the weights the engines run (the last synced version) on the engine it
takes before anything is routed to it, and the group is rebuilt
(every member leaving the old one together) whenever its members or its sender change.
A member that dies is not left (leaving is collective and would wait on it until the
group's timeout): the group is abandoned and the next sync builds a new one of the
survivors, whose members replace their old group by joining it.
"""

import logging
from collections.abc import Callable, Sequence

import anyio

from dynarl.core.errors import in_words
from dynarl.workers import sync_group
from dynarl.workers.errors import WeightManifestError
from dynarl.workers.handles import EngineKey, SlotHandle
from dynarl.workers.trainer import Trainer

logger = logging.getLogger(__name__)


class EngineWeights:
    """The run's weight-sync group (see the module docstring).

    Args:
        serving: the slots that serve a role now, in slot order.
        sender_host: where the group's store is, for a trainer (its rank 0's node).
        lost: names of slots whose worker died (the world's set, read here).
    """

    SYNC_ATTEMPTS = 4
    """Tries of one weight sync (the first and its retries)."""
    SYNC_BACKOFF_S = 0.5
    """The wait before the first retry of a weight sync (doubled each time)."""

    def __init__(
        self,
        *,
        serving: Callable[[], list[SlotHandle]],
        sender_host: Callable[[Trainer], str],
        lost: set[str],
    ) -> None:
        self._serving = serving
        self._sender_host = sender_host
        self._lost = lost
        self.trainer: Trainer | None = None
        """The sender (set once the trainer is built)."""
        self.version = 0
        """The weight version the engines run (the last one synced)."""
        self.trainer_ahead = False
        """Whether the trainer's weights moved past :attr:`version` (it is training): a
        slot taking a role now waits for the iteration's closing sync."""
        self.lock = anyio.Lock()
        """Held by every change of the group's membership (a slot must not be
        reconnecting while the group is rebuilt around it)."""
        self._members: list[SlotHandle] = []
        # The version each (slot, engine) holds; one not here holds the seed's: 0.
        self._held: dict[tuple[str, EngineKey], int] = {}
        self._connected = False  # whether a group exists

    def held_version(self, slot: SlotHandle) -> int:
        """The weight version the engine ``slot`` serves with holds."""
        return self._held.get((slot.name, slot.engine), 0)

    def forget_slot(self, name: str) -> None:
        """Slot ``name`` was started again: its engines hold the seed's weights."""
        self._held = {key: v for key, v in self._held.items() if key[0] != name}

    def engine_replaced(self, name: str, devices: tuple[int, ...]) -> None:
        """Slot ``name`` closes its rollout engine on ``devices`` for one of that size
        on other devices: the new one starts from the seed's weights, and the group
        the slot was in is abandoned (the old engine may have been its member, and its
        server is gone, so that group cannot be left together)."""
        self._held.pop((name, ("rollout", devices)), None)
        self.member_died(name)

    def member_died(self, name: str) -> None:
        """Slot ``name``'s worker died: if it was a member, abandon the group."""
        if any(s.name == name for s in self._members):
            self._members = [s for s in self._members if s.name != name]
            self._abandon()

    def trainer_moves_ahead(self) -> None:
        """The trainer is about to step: its weights move past the engines', so a slot
        taking a role from now on waits for the iteration's closing sync."""
        self.trainer_ahead = True

    async def sync_weights(self, version: int) -> int:
        """Broadcast the actor's weights as ``version`` to every serving slot (the
        group is rebuilt first if its members changed); returns the bytes sent.

        A broadcast that fails (a member died under it: gloo reports the reset
        connection) is retried with exponential back-off, up to :attr:`SYNC_ATTEMPTS`
        times, on a group rebuilt from the members alive then (the router reports the
        dead one meanwhile); the trainer keeps its weights throughout. An engine whose
        model does not fit the trainer's weights fails the sync at once
        (:class:`~dynarl.workers.errors.WeightManifestError`: every try would fail
        alike)."""
        delay_s = self.SYNC_BACKOFF_S
        for attempt in range(1, self.SYNC_ATTEMPTS + 1):
            try:
                return await self._sync_once(version)
            except WeightManifestError:
                raise
            except Exception as error:
                if attempt == self.SYNC_ATTEMPTS:
                    raise
                logger.warning(
                    "weight sync of version %d failed (%s); rebuilding the group and "
                    "retrying in %.1f s",
                    version,
                    in_words(error),
                    delay_s,
                )
                self._abandon()
                await anyio.sleep(delay_s)
                delay_s *= 2
        raise AssertionError("unreachable")

    async def bring_up_to_date(self, slots: Sequence[SlotHandle]) -> None:
        """Give ``slots`` (which just built or resumed a role) the weights the engines
        run, in one regroup and broadcast. Call with :attr:`lock` held."""
        trainer = self._trainer()
        need = [s for s in slots if self.held_version(s) != self.version]
        if not need or self.trainer_ahead:
            # Already current (a role resumed within the version it last held), or the
            # trainer is mid-iteration: the iteration's closing sync includes them.
            return
        names = {s.name for s in need}
        members = [s for s in self._serving() if s.name not in names] + need
        await self._regroup(members)
        await sync_group.broadcast(trainer, self.version, members)
        self._held.update({(s.name, s.engine): self.version for s in need})
        logger.info("brought %s to weight version %d", ", ".join(sorted(names)), self.version)

    async def _sync_once(self, version: int) -> int:
        trainer = self._trainer()
        async with self.lock:
            members = self._serving()
            await self._regroup(members)
            sent = await sync_group.broadcast(trainer, version, members)
            self.version = version
            self.trainer_ahead = False
            self._held.update({(s.name, s.engine): version for s in members})
            return sent

    def _abandon(self) -> None:
        """Forget the group without leaving it (a collective its broken or dead members
        cannot take part in); the next sync builds a new one, whose members replace
        their old group by joining it."""
        self._connected = False
        for member in self._members:
            member.in_weight_sync = False

    async def _regroup(self, members: list[SlotHandle]) -> None:
        """Rebuild the group with ``members`` if they or the sender changed, or a
        member's new role did not carry its place over (the old group's members leave
        it together first)."""
        trainer = self._trainer()
        same = [s.name for s in members] == [s.name for s in self._members]
        if same and trainer.weight_sync_ready and all(s.in_weight_sync for s in members):
            return
        await sync_group.connect(
            trainer,
            members,
            leaving=[s for s in self._members if s.name not in self._lost],
            connected=self._connected,
            host=self._sender_host(trainer),
        )
        for slot in self._members:
            slot.in_weight_sync = False
        for slot in members:
            slot.in_weight_sync = True
        self._connected = True
        self._members = list(members)

    def _trainer(self) -> Trainer:
        assert self.trainer is not None, "start the world first"
        return self.trainer
