"""Messages between a :class:`~dynarl.workers.torch.trainer_pool.TrainerPool` and its
worker processes: commands in, replies out. Definitions only, no logic.

They are tagged ``msgspec.Struct``s encoded as msgpack that ride the data plane as the
body of a typed call (the workers are the router's peers, as device slots are). Model
state never rides them: weights and optimizer state move over torch.distributed.
"""

from typing import Annotated, Literal

import msgspec

from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.trainer import Array, StepMetrics
from dynarl.workers.weights import WeightManifest


class ReshardFault(msgspec.Struct, frozen=True, kw_only=True):
    """Fault injection for resizes: worker ``worker`` raises
    :class:`~dynarl.workers.torch.trainer_errors.InjectedFault` after it has received
    ``after_buckets`` buckets of the state transfer (a joiner failing mid-receive)."""

    worker: int
    after_buckets: Annotated[int, msgspec.Meta(ge=1)] = 1


class _Command(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of the commands a worker accepts."""


class OpenStore(_Command, frozen=True, kw_only=True):
    """One worker: open a torch.distributed store as its master, on a port of ``host``
    the operating system picks (answered with :class:`StoreOpened`), for the group of
    ``world_size`` that ``purpose`` names; the worker's next :class:`Join`
    (``"world"``, sent to worker 0 before any ``Join``), :class:`Rejoin` (``"world"``,
    to the new world's first worker) or :class:`ConnectWeightSync`
    (``"weight_sync"``, to the sender) rendezvouses there.

    The port is bound before anyone is told it: choosing a free port first and binding
    it later races every other process on the machine for it."""

    worker: int
    purpose: Literal["world", "weight_sync"]
    host: str
    world_size: int
    timeout_s: float


class Join(_Command, frozen=True, kw_only=True):
    """Every worker, first: join the trainer's world process group as pool worker
    ``worker`` of ``num_workers``, rendezvousing at ``host:port`` (the store the
    world's first worker opened there, see :class:`OpenStore`), and keep ``config``
    and the model factory and loss it trains with.

    ``workers`` are the world's pool indices (world rank ``r`` is ``workers[r]``):
    empty for every worker (``0..num_workers-1``); a worker restarted after its
    process died joins the world of the others with them (see :class:`Rejoin`).

    ``code`` is the pickled ``(model_factory, loss_fn)`` pair: callables cross to the
    workers as torch.multiprocessing and Ray ship them, from the controller only."""

    worker: int
    num_workers: int
    host: str
    port: int
    config: TrainerConfig
    code: bytes
    workers: tuple[int, ...] = ()

    @property
    def world(self) -> tuple[int, ...]:
        """The world's pool indices, in world-rank order."""
        return self.workers or tuple(range(self.num_workers))


class StartTraining(_Command, frozen=True, kw_only=True):
    """Every worker: build the data-parallel group of ``members`` (pool indices, in DP
    rank order); members build the model from the seed."""

    members: tuple[int, ...]


class TrainStep(_Command, frozen=True, kw_only=True):
    """Members: one optimizer step on the global ``minibatch``; each rank takes its own
    contiguous shard of the samples."""

    minibatch: dict[str, Array]


class TrainOnItems(_Command, frozen=True, kw_only=True):
    """A member: one optimizer step (with the others) on the samples the data router
    delivered to it, ``item_ids`` in order (its data-parallel shard; each item's payload
    is a :class:`~dynarl.workers.trainer.SampleRow`); it completes them afterwards. A
    step that fails keeps them, for a re-run. Without ``apply`` the step already
    happened (a lost rank's recovery found it applied): the member only completes
    them."""

    item_ids: tuple[str, ...]
    apply: bool = True


class PrepareResize(_Command, frozen=True, kw_only=True):
    """Every worker: create the groups of a resize ``old_members -> new_members``;
    joiners receive the state from ``source``. Nothing switches yet."""

    epoch: int
    old_members: tuple[int, ...]
    new_members: tuple[int, ...]
    source: int
    fault: ReshardFault | None = None


class PrepareReshard(_Command, frozen=True, kw_only=True):
    """Every worker of a backend that shards a replica (Megatron): like
    :class:`PrepareResize`, and the replicas' tensor- and pipeline-parallel sizes
    become ``tp`` and ``pp``; the new members take their shards of the state the
    source replica holds. Committed and aborted as a resize."""

    epoch: int
    old_members: tuple[int, ...]
    new_members: tuple[int, ...]
    source: int
    tp: int
    pp: int


class CommitResize(_Command, frozen=True, kw_only=True):
    """Every worker: switch to the prepared group of ``epoch``; leavers release memory."""

    epoch: int


class AbortResize(_Command, frozen=True, kw_only=True):
    """Every worker: drop what ``epoch`` prepared; the old group stays as it was."""

    epoch: int


class SaveCheckpoint(_Command, frozen=True, kw_only=True):
    """One member: write model and optimizer state to ``path`` with ``torch.save``
    (atomically: a temporary file renamed into place)."""

    path: str


class LoadCheckpoint(_Command, frozen=True, kw_only=True):
    """Members: continue from the model and optimizer state a :class:`SaveCheckpoint`
    wrote to ``path`` (every member reads the same file, so the ranks stay identical)."""

    path: str


class ConnectWeightSync(_Command, frozen=True, kw_only=True):
    """One member: join the weight-sync group at ``host:port`` as its rank 0 (hosting
    the group's store: the one :class:`OpenStore` opened, or one it binds at ``port``
    now), beside ``world_size - 1`` rollout engines."""

    host: str
    port: int
    world_size: int
    timeout_s: float


class DescribeWeights(_Command, frozen=True, kw_only=True):
    """The member in the weight-sync group: describe what :class:`SyncWeights` of
    ``version`` broadcasts (answered with :class:`WeightsDescribed`)."""

    version: int


class SyncWeights(_Command, frozen=True, kw_only=True):
    """The member in the weight-sync group: broadcast the weights, tagged ``version``,
    as :class:`DescribeWeights` described them."""

    version: int


class LeaveWeightSync(_Command, frozen=True, kw_only=True):
    """The sender of the weight-sync group: leave it (after the last sync; the engines
    leave too)."""


class LeaveWorld(_Command, frozen=True, kw_only=True):
    """Every surviving worker, after a worker died: drop a prepared resize, leave the
    world process group and every group built on it (a collective with the dead worker
    cannot complete), keep the trainer state, and say how many optimizer steps it holds
    (answered with :class:`Left`)."""


class Rejoin(_Command, frozen=True, kw_only=True):
    """Every surviving worker: form a new world process group of ``workers`` (pool
    indices; world rank ``r`` is ``workers[r]``), rendezvousing at the store
    ``workers[0]`` opened at ``host:port`` (see :class:`OpenStore`); a restarted
    worker among them joins it with :class:`Join` at the same time."""

    workers: tuple[int, ...]
    host: str
    port: int


class Restore(_Command, frozen=True, kw_only=True):
    """Every worker of the new world: build the data-parallel group of ``members``
    (pool indices, in rank order); ``source`` (a member) sends its whole trainer state
    to the others, so every rank continues from one consistent state. Without a
    ``source`` the members already hold one state (the world was rebuilt to admit a
    restarted worker, at a step boundary): nothing moves. With model-parallel ranks
    (Megatron's tensor and pipeline parallel shards) ``holders`` names the survivor
    that sends each model shard, in shard order (pipeline stage major, tensor rank
    fastest), ``source`` among them; empty: ``source`` holds the whole state."""

    members: tuple[int, ...]
    source: int | None
    holders: tuple[int, ...] = ()


class Shutdown(_Command, frozen=True, kw_only=True):
    """Every worker: tear down its process groups and exit."""


Command = (
    OpenStore
    | Join
    | StartTraining
    | TrainStep
    | TrainOnItems
    | PrepareResize
    | PrepareReshard
    | CommitResize
    | AbortResize
    | SaveCheckpoint
    | LoadCheckpoint
    | ConnectWeightSync
    | DescribeWeights
    | SyncWeights
    | LeaveWeightSync
    | LeaveWorld
    | Rejoin
    | Restore
    | Shutdown
)
"""Everything a worker accepts."""


class _Reply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of a worker's replies; ``worker`` is its index in the pool."""

    worker: int


class Done(_Reply, frozen=True, kw_only=True):
    """The command succeeded after ``elapsed_s`` seconds in the worker, which sent
    ``bytes_moved`` bytes of tensors over torch.distributed for it."""

    elapsed_s: float
    bytes_moved: int = 0


class StepDone(_Reply, frozen=True, kw_only=True):
    """An optimizer step finished after ``elapsed_s`` seconds in the worker."""

    metrics: StepMetrics
    elapsed_s: float


class StoreOpened(_Reply, frozen=True, kw_only=True):
    """The store :class:`OpenStore` asked for listens on ``port``."""

    port: int


class WeightsDescribed(_Reply, frozen=True, kw_only=True):
    """What a weight sync broadcasts (the answer to :class:`DescribeWeights`)."""

    manifest: WeightManifest


class Left(_Reply, frozen=True, kw_only=True):
    """The worker left the world (the answer to :class:`LeaveWorld`): it holds a
    trainer state of ``num_steps`` optimizer steps (``-1``: none), the last step it
    began started from ``attempted`` steps (``-1``: none), and ``last`` is the metrics
    of its last applied step."""

    num_steps: int
    attempted: int
    last: StepMetrics | None = None


class Failed(_Reply, frozen=True, kw_only=True):
    """The command raised ``error`` (exception type name) with ``message``."""

    error: str
    message: str


Reply = Done | StepDone | StoreOpened | WeightsDescribed | Left | Failed
"""Everything a worker answers."""
