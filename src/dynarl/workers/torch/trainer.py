"""One rank of the elastic data-parallel trainer: the policy model, its AdamW optimizer,
the current data-parallel group, and the optimizer step.

The step is data parallel by hand rather than through ``DistributedDataParallel``: each
rank runs its shard of the global minibatch in micro-batches, accumulating gradients of
the loss *sums*; one bucketed all-reduce then sums the gradients, the loss and the
normaliser over ranks, and the gradient is divided by the *global* normaliser. The
update therefore equals the single-rank update whatever the data-parallel size, and a
group can be swapped between steps without rebuilding a DDP wrapper (whose averaging
and construction-time broadcast assume a fixed group).
"""

import logging
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.torch.buckets import Staging, all_reduce_tensors, broadcast_tensors
from dynarl.workers.torch.train_batch import micro_batches, shard
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.trainer import LossFn, StepMetrics

logger = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
"""Builds the policy model (a ``transformers``-style causal LM whose call returns an
object with ``.logits``). Must be picklable: it is sent to the workers once at start.
Called under a seeded RNG for the first members, and under ``torch.device("meta")`` for
joiners, whose weights then arrive from a running rank."""

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
"""Minibatch fields passed to the model; every field reaches the loss."""


class ElasticTrainer:
    """The training state of one data-parallel rank.

    Build the first ranks with :meth:`build` and joiners with :meth:`skeleton` (their
    tensors are then filled by :mod:`~dynarl.workers.torch.reshard`). ``group`` is the
    data-parallel process group, or ``None`` for a single rank without torch.distributed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        group: dist.ProcessGroup | None,
        num_steps: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.group = group
        self.num_steps = num_steps
        self.staging = Staging()
        """Bucket buffers reused by this rank's collectives."""

    @classmethod
    def build(
        cls,
        model_factory: ModelFactory,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> "ElasticTrainer":
        """A fresh trainer with weights initialised from ``config.seed``; with a group,
        rank 0's weights are broadcast so every rank starts identical."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = model_factory()
        model.to(device)
        trainer = cls(model, _adamw(model, config), loss_fn=loss_fn, config=config, group=group)
        if group is not None:
            broadcast_tensors(
                trainer.model_tensors(),
                group=group,
                group_src=0,
                bucket_bytes=config.bucket_bytes,
                staging=trainer.staging,
            )
        return trainer

    @classmethod
    def skeleton(
        cls,
        model_factory: ModelFactory,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        device: torch.device,
    ) -> "ElasticTrainer":
        """A trainer whose tensors are allocated but not initialised (built on the meta
        device, so nothing is computed); fill them before use. It has no group yet."""
        with torch.device("meta"):
            model = model_factory()
        model.to_empty(device=device)
        return cls(model, _adamw(model, config), loss_fn=loss_fn, config=config, group=None)

    @property
    def rank(self) -> int:
        """This rank's index in the data-parallel group."""
        return 0 if self.group is None else int(self.group.rank())

    @property
    def world_size(self) -> int:
        """Data-parallel size."""
        return 1 if self.group is None else int(self.group.size())

    @property
    def device(self) -> torch.device:
        """Where the model lives."""
        return next(self.model.parameters()).device

    def named_model_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters then buffers, in module order: the model's whole state."""
        params = [(name, p.data) for name, p in self.model.named_parameters()]
        return params + [(name, b.data) for name, b in self.model.named_buffers()]

    def model_tensors(self) -> list[torch.Tensor]:
        """The tensors of :meth:`named_model_tensors`."""
        return [t for _, t in self.named_model_tensors()]

    def train_step(
        self, minibatch: Mapping[str, torch.Tensor], *, local: bool = False
    ) -> StepMetrics:
        """One optimizer step on this rank's shard of the global ``minibatch`` (with
        ``local``: ``minibatch`` is that shard already).

        Collective: every rank of the group calls it, with the same minibatch (or each
        with its own shard).
        """
        started = time.perf_counter()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        mine = dict(minibatch) if local else shard(minibatch, self.rank, self.world_size)
        # A rank with no sample (a local shard can be empty) still joins the all-reduce.
        for micro in micro_batches(mine, self.config.micro_batch_size) if mine else ():
            inputs = {k: v for k, v in micro.items() if k in MODEL_INPUTS}
            logits = self.model(**inputs, use_cache=False).logits
            loss_sum, normaliser = self.loss_fn(logits, micro)
            loss_sum.backward()  # type: ignore[no-untyped-call]
            totals[0] += loss_sum.detach().to(torch.float64)
            totals[1] += torch.as_tensor(normaliser, dtype=torch.float64)
        for p in params:
            if p.grad is None:  # no sample on this rank, or unused by the loss
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        if self.group is not None:
            all_reduce_tensors(
                [*grads, totals],
                group=self.group,
                bucket_bytes=self.config.bucket_bytes,
                staging=self.staging,
            )
        loss_total, normaliser_total = (float(x) for x in totals.tolist())
        if normaliser_total <= 0.0:
            raise TrainerError(
                "the minibatch's loss normaliser summed to "
                f"{normaliser_total}; send samples with a positive loss weight"
            )
        torch._foreach_div_(grads, normaliser_total)
        grad_norm = float(torch.nn.utils.get_total_norm(grads))
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(
                params, self.config.grad_clip, torch.tensor(grad_norm)
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        logger.debug(
            "step %d on rank %d/%d in %.3f s",
            self.num_steps,
            self.rank,
            self.world_size,
            time.perf_counter() - started,
        )
        return StepMetrics(
            loss=loss_total / normaliser_total,
            normaliser=normaliser_total,
            grad_norm=grad_norm,
            num_steps=self.num_steps,
        )

    def checkpoint(self) -> dict[str, object]:
        """Model and optimizer state dicts, the step count and torch's CPU RNG state,
        for ``torch.save``; :meth:`load_checkpoint` restores them."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "num_steps": self.num_steps,
            "torch_rng": torch.get_rng_state(),
        }

    def load_checkpoint(self, state: Mapping[str, object]) -> None:
        """Continue from ``state`` (a :meth:`checkpoint` of a trainer of the same model
        and optimizer settings): weights, AdamW moments, step count and RNG."""
        try:
            self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        except (KeyError, RuntimeError, ValueError) as exc:
            raise TrainerError(
                f"the checkpoint does not fit this trainer ({exc}); resume with the "
                "model and actor settings of the run that wrote it"
            ) from exc
        self.num_steps = int(state.get("num_steps", 0))  # type: ignore[call-overload]
        rng = state.get("torch_rng")
        if isinstance(rng, torch.Tensor):
            torch.set_rng_state(rng)


def _adamw(model: torch.nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    """The optimizer every rank builds identically (its state arrives by transfer)."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
