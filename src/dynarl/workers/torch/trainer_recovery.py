"""The pool's side of surviving a dead trainer worker: which workers died, and the
rebuild of the trainer from the survivors.

A worker that dies makes the pool's call that meets it raise :class:`RankLostError`
(the data router reports the closed connection at once). :class:`Casualties` records
it; the pool then refuses every call but its ``recover()``, which runs
:func:`rebuild`:

1. every survivor leaves the broken world (``LeaveWorld``; a survivor still blocked
   with the dead worker in a resize's ``new_group`` or transfer is interrupted, see
   :mod:`~dynarl.workers.torch.trainer_serve`) and reports the optimizer steps its state
   holds (``-1``: none);
2. the survivors form a new world with fresh ranks (``Rejoin``, at a store the first
   survivor opens);
3. the trainer's ranks become the survivors that hold its state, and the one holding
   the most steps sends its whole state to the others (``Restore``).

A worker whose process the launcher started again (under the same name) is admitted
back by :func:`readmit`, at a step boundary: every worker of the world leaves it (the
ranks keep their state), and they form a new world with the restarted worker, which
joins it from scratch (``Join``); the ranks rebuild their data-parallel group as it
was, nothing moves (``Restore`` without a source). The restarted worker holds no state
and takes no samples until a resize makes it a rank (its state then comes peer to
peer, as any joiner's).

A step the loss interrupted is thereby applied by every rank (if any survivor finished
it: its all-reduce completed, so it holds every rank's gradients) or by none. A resize
the loss interrupted is rolled back: the ranks are the surviving old members (a
survivor drops what it prepared when it leaves the world); if it had already
committed on the survivors, those of them that kept the state (else the new members).
"""

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from dynarl.workers.errors import RankLostError, TrainerError
from dynarl.workers.torch.trainer_commands import (
    Command,
    Done,
    Join,
    LeaveWorld,
    Left,
    Rejoin,
    Reply,
    Restore,
)
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.trainer import Recovery


class Casualties:
    """The pool's dead workers: every one that died (:attr:`dead`, for good), and those
    still in the world until a rebuild removed them (:attr:`unrecovered`)."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.unrecovered: set[int] = set()
        self.rebuilding = False

    def refuse(self) -> None:
        """Raise :class:`RankLostError` while dead workers are still in the world
        (outside a rebuild)."""
        if self.unrecovered and not self.rebuilding:
            raise RankLostError(
                f"trainer workers {sorted(self.unrecovered)} died; recover() first",
                worker=min(self.unrecovered),
            )

    def record(self, workers: set[int]) -> None:
        """``workers`` died."""
        self.dead |= workers
        self.unrecovered |= workers


class PoolCalls(Protocol):
    """What a rebuild needs of the pool: typed calls to its workers."""

    async def call_checked(self, workers: Sequence[int], command: Command) -> list[Reply]:
        """Send ``command`` to ``workers`` at once; their replies, or
        :class:`TrainerError` if one failed."""
        ...

    async def open_world_store(self, worker: int, world_size: int) -> int:
        """Make ``worker`` open the store of a world of ``world_size`` at the pool's
        rendezvous host; returns its port."""
        ...

    async def call_each_checked(
        self, workers: Sequence[int], command: Callable[[int], Command]
    ) -> list[Reply]:
        """Send ``command(w)`` to each worker ``w`` at once; their replies, or
        :class:`TrainerError` if one failed."""
        ...


class RankPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Whom the trainer continues on after a loss (``members``, pool indices in rank
    order) and whose state they restore: ``source``'s, or with model-parallel ranks
    the shards of ``holders`` (see :class:`Restore`)."""

    members: tuple[int, ...]
    source: int
    holders: tuple[int, ...] = ()


PlanRanks = Callable[[Mapping[int, Left], tuple[int, ...]], RankPlan]
"""A backend's choice of the ranks after a loss from what each survivor reported on
leaving the world (by pool index) and the survivors (in world order); raises
:class:`TrainerError` when no consistent state survives."""


class Rebuilt(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer rebuilt from the survivors: the new world (pool indices, in rank
    order), the ranks and how they got there."""

    world: tuple[int, ...]
    recovery: Recovery


async def rebuild(
    pool: PoolCalls,
    casualties: Casualties,
    *,
    world: Sequence[int],
    members: Sequence[int],
    resizing_to: Sequence[int] | None,
    known_steps: int | None,
    host: str,
    plan: PlanRanks | None = None,
) -> Rebuilt:
    """Rebuild the trainer of ``members`` (the pool's ranks; during a resize to
    ``resizing_to``, its old ranks) in ``world`` without the dead workers (see the
    module). ``known_steps`` is the trainer's step count before the loss, if the pool
    knows it; the survivors rendezvous at ``host`` (the first survivor's node).
    ``plan`` chooses the new ranks and their state's source (default: the surviving
    members holding the state, from the one with the most steps). Raises
    :class:`TrainerError` if no survivor holds the trainer's state or a survivor fails
    meanwhile."""
    if not casualties.unrecovered:
        raise TrainerError("no trainer worker was lost; nothing to recover")
    started = time.perf_counter()
    lost = tuple(sorted(casualties.unrecovered))
    survivors = tuple(w for w in world if w not in casualties.dead)
    if not survivors:
        raise TrainerError("every trainer worker died", worker=lost[0])
    casualties.rebuilding = True
    try:
        left = await pool.call_checked(survivors, LeaveWorld())
        states = {r.worker: r for r in left if isinstance(r, Left)}
        if plan is None:
            chosen = _plan(states, members=members, resizing_to=resizing_to, lost=lost)
        else:
            chosen = plan(states, survivors)
        ranks, source = chosen.members, chosen.source
        port = await pool.open_world_store(survivors[0], len(survivors))
        await pool.call_checked(survivors, Rejoin(workers=survivors, host=host, port=port))
        restore = Restore(members=ranks, source=source, holders=chosen.holders)
        restored = await pool.call_checked(survivors, restore)
    finally:
        casualties.rebuilding = False
    casualties.unrecovered.clear()
    before = known_steps
    if before is None:  # the step count is not known: the one the ranks began
        before = max(states[m].attempted for m in (*ranks, source) if states[m].num_steps >= 0)
    num_steps = states[source].num_steps
    recovery = Recovery(
        lost=lost,
        members=ranks,
        source=source,
        num_steps=num_steps,
        step_applied=num_steps > before,
        last_step=states[source].last,
        elapsed_s=time.perf_counter() - started,
        bytes_moved=sum(r.bytes_moved for r in restored if isinstance(r, Done)),
    )
    return Rebuilt(world=survivors, recovery=recovery)


def _plan(
    states: Mapping[int, Left],
    *,
    members: Sequence[int],
    resizing_to: Sequence[int] | None,
    lost: tuple[int, ...],
) -> RankPlan:
    """The ranks of a trainer whose every rank holds the whole state (see
    :func:`_ranks`), restored from the one holding the most steps."""
    ranks = _ranks(states, members=members, resizing_to=resizing_to)
    if not ranks:
        raise TrainerError(
            f"every rank of the trainer ({tuple(members)}) died with its state; only "
            "a checkpoint can restore it",
            worker=lost[0],
        )
    steps = [states[m].num_steps for m in ranks]
    if max(steps) - min(steps) > 1:
        raise TrainerError(f"the surviving ranks {ranks} hold steps {steps}")
    return RankPlan(members=ranks, source=max(ranks, key=lambda m: states[m].num_steps))


def _ranks(
    states: Mapping[int, Left], *, members: Sequence[int], resizing_to: Sequence[int] | None
) -> tuple[int, ...]:
    """The survivors the trainer continues on: the surviving ``members`` that still hold
    its state (all of them, unless a resize to ``resizing_to`` committed on the
    survivors and a leaver released it), else the surviving new members that hold it
    (an interrupted resize onto other workers that committed)."""
    holds = {w for w, s in states.items() if s.num_steps >= 0}
    old = tuple(m for m in members if m in holds)
    return old or tuple(m for m in resizing_to or () if m in holds)


class Joining(msgspec.Struct, frozen=True, kw_only=True):
    """What a restarted worker needs to join: the pool's size, its config and the
    pickled ``(model_factory, loss_fn)`` (see :class:`Join`)."""

    num_workers: int
    config: TrainerConfig
    code: bytes


async def readmit(
    pool: PoolCalls,
    casualties: Casualties,
    restarted: Sequence[int],
    *,
    world: Sequence[int],
    members: Sequence[int],
    joining: Joining,
    host: str,
) -> tuple[int, ...]:
    """Admit ``restarted`` (dead workers whose processes were started again) into a
    new world with ``world`` (see the module); the trainer's ranks ``members`` keep
    their state and rebuild their group. Returns the new world. Call at a step
    boundary, after any rebuild (:func:`rebuild`). Raises :class:`TrainerError` if a
    worker was not dead or a worker fails meanwhile (a worker that dies meanwhile
    raises :class:`RankLostError`: the pool rebuilds itself without it)."""
    new = tuple(sorted(set(restarted)))
    if casualties.unrecovered:
        raise TrainerError(f"trainer workers {sorted(casualties.unrecovered)} died; recover first")
    alive = [w for w in new if w not in casualties.dead]
    if alive or not new:
        raise TrainerError(f"trainer workers {alive or list(new)} did not die; nothing to admit")
    everyone = tuple(sorted({*world, *new}))
    if world:
        await pool.call_checked(world, LeaveWorld())
    casualties.dead.difference_update(new)
    port = await pool.open_world_store(everyone[0], len(everyone))

    def rejoin(w: int) -> Command:
        if w in new:
            return Join(
                worker=w,
                num_workers=joining.num_workers,
                host=host,
                port=port,
                config=joining.config,
                code=joining.code,
                workers=everyone,
            )
        return Rejoin(workers=everyone, host=host, port=port)

    await pool.call_each_checked(everyone, rejoin)
    await pool.call_checked(everyone, Restore(members=tuple(members), source=None))
    return everyone
