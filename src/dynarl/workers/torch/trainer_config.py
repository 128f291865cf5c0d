"""The elastic trainer's section of the configuration: optimisation and transport knobs.

Field names follow :class:`dynarl.api.config.ActorConfig` where they mean the same
thing, so the actor section maps onto this one field by field.
"""

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from dynarl.core.config import Accelerator
from dynarl.workers.config import ActorConfig

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one elastic data-parallel trainer trains and moves its state.

    Attributes:
        micro_batch_size: samples per forward/backward on one rank. Keep it fixed when
            resizing: each rank then sees the same micro-batches a single rank would.
        lr, betas, eps, weight_decay: AdamW settings.
        grad_clip: clip the global gradient norm to this value; ``None`` never clips.
        seed: seeds the initial model; the first members build identical weights.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; worker ``i`` uses GPU
            ``device_ids[i] % device_count``, or ``i % device_count`` without them).
        device_ids: the run's device of each worker, in worker order (``cuda``: the
            GPU it maps to); empty: worker ``i`` is device ``i``.
        num_threads: torch intra-op threads per worker process (a CPU device slot).
        bucket_bytes: tensors smaller than this are coalesced into buckets of this
            size for broadcasts and all-reduces; larger ones travel on their own.
        timeout_s: limit on one collective of the training group, and on one command
            to a worker process.
        reshard_timeout_s: limit on one collective of a resize; a joiner that does not
            answer within it fails the resize and the old group keeps training.
    """

    micro_batch_size: PositiveInt = 8
    lr: PositiveFloat = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    grad_clip: PositiveFloat | None = 1.0
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    device_ids: tuple[Annotated[int, msgspec.Meta(ge=0)], ...] = ()
    num_threads: PositiveInt = 1
    bucket_bytes: PositiveInt = 32 * 1024 * 1024
    timeout_s: PositiveFloat = 120.0
    reshard_timeout_s: PositiveFloat = 30.0

    @classmethod
    def of_actor(
        cls,
        actor: ActorConfig,
        *,
        seed: int,
        accelerator: Accelerator = "cpu",
        devices: Sequence[int] = (),
        num_threads: int = 1,
    ) -> "TrainerConfig":
        """The trainer config of a run's ``actor`` section (its optimisation fields),
        seeded by ``seed``, its workers on ``accelerator`` as the run's ``devices``
        (empty: worker ``i`` is device ``i``), ``num_threads`` each; the transport
        knobs keep their defaults."""
        return cls(
            micro_batch_size=actor.micro_batch_size,
            lr=actor.lr,
            weight_decay=actor.weight_decay,
            grad_clip=actor.grad_clip,
            seed=seed,
            device=accelerator,
            device_ids=tuple(devices),
            num_threads=num_threads,
        )
