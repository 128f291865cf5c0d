"""One Megatron trainer rank: its shard of the GPT model (a tensor-parallel rank of a
pipeline stage) inside Megatron's ``DistributedDataParallel`` wrapper, its optimizer
(torch's AdamW, or Megatron's distributed optimizer: :mod:`~dynarl.workers.megatron.optim`),
its process groups, and the optimizer step.

The step runs megatron-core's own schedule (``forward_backward_no_pipelining``, or
the 1F1B ``forward_backward_pipelining_without_interleaving`` across stages) over the
replica's micro-batches with ``calculate_per_token_loss``: each micro-batch adds the
gradient of its loss *sum* to the wrapper's buffers and its normaliser to a count, as
the torch trainer does. The wrapper sums the buffers over the data-parallel group
(``finish_grad_sync``, gradient scaling 1), and a model with tied embeddings split over
stages sums its two copies' gradients over the embedding group (first and last stage);
every member learns the global loss,
normaliser and gradient norm (each shard counted once: tensor-parallel duplicates only
on tensor rank 0); the gradients are divided by the global normaliser and clipped, and
AdamW steps on them. With the distributed optimizer the wrapper reduce-scatters
instead, and after the division Megatron's optimizer computes the norm, clips and
steps each rank's slice, then keeps the step boundary's buddy copies
(:mod:`~dynarl.workers.megatron.buddy`). The update is therefore the single-rank update
whatever the (dp, tp, pp) layout. A resize rebuilds the wrapper on the new layout's groups
(:meth:`MegatronRank.regroup`) and retires the old one (with the distributed
optimizer, whose slices depend on the data-parallel size, a resize builds new ranks).

It subclasses the torch backend's :class:`~dynarl.workers.torch.trainer.ElasticTrainer`
for what is the same (the state's tensors, the peer-to-peer state transfer of
:mod:`dynarl.workers.torch.reshard`) and replaces the step.
"""

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from dynarl.workers.errors import TrainerError
from dynarl.workers.megatron import convert
from dynarl.workers.megatron.cpu import quiet
from dynarl.workers.megatron.layout import RankGroups
from dynarl.workers.megatron.model import Architecture, build_gpt, causal_mask
from dynarl.workers.megatron.optim import DistributedAdam
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.torch.train_batch import TensorBatch, micro_batches, num_samples, shard
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_config import TrainerConfig
from dynarl.workers.trainer import LossFn, StepMetrics

logger = logging.getLogger(__name__)


class MegatronRank(ElasticTrainer):
    """The training state of one worker of a Megatron layout.

    Build the first ranks with :meth:`create` (weights from the HF model of the spec)
    and joiners with :meth:`empty` (tensors filled by a transfer).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        groups: RankGroups,
        arch: Architecture,
        distributed_optimizer: bool = False,
        buddy_copies: bool = True,
        num_steps: int = 0,
    ) -> None:
        ddp = _wrap(model, groups, distributed=distributed_optimizer)
        self.distributed = (
            DistributedAdam(ddp, model, config, groups, buddy_copies=buddy_copies)
            if distributed_optimizer
            else None
        )
        """Megatron's distributed optimizer (``None``: torch's AdamW steps the whole
        shard on every data-parallel rank)."""
        optimizer = _adamw(model, config) if self.distributed is None else self.distributed.inner
        super().__init__(
            model, optimizer, loss_fn=loss_fn, config=config, group=groups.dp, num_steps=num_steps
        )
        self.groups = groups
        self.arch = arch
        self.ddp = ddp
        """Megatron's data-parallel wrapper of ``model`` on ``groups``: gradients
        accumulate in its buffers (``param.main_grad``) and are summed (reduce-scattered
        with the distributed optimizer) over the data-parallel group there."""

    def regroup(self, groups: RankGroups) -> None:
        """Move this rank to another layout's ``groups`` (a resize kept it): its
        data-parallel wrapper is rebuilt on them and the old one retired. Not with the
        distributed optimizer (its slices depend on the group: a resize builds new
        ranks)."""
        if self.distributed is not None:
            raise TrainerError("a rank with the distributed optimizer cannot change groups")
        _retire(self.ddp)
        self.groups = groups
        self.group = groups.dp
        self.ddp = _wrap(self.model, groups, distributed=False)

    def release(self) -> None:
        """Retire the wrapper (its gradient buffers go) and the distributed optimizer
        before the tensors are freed."""
        _retire(self.ddp)
        self.distributed = None

    @classmethod
    def create(
        cls,
        spec: ModelSpec,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        groups: RankGroups,
        hf_state: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> "MegatronRank":
        """A rank on ``device`` whose shard is cut from ``hf_state`` (the HF model's
        tensors)."""
        arch = spec.architecture()
        model = build_gpt(arch, groups.collection, device=device)
        p = groups.position
        convert.load_into(
            model,
            convert.to_megatron(
                hf_state, arch, tp_rank=p.tp_rank, tp=spec.tp, pp_rank=p.pp_rank, pp=spec.pp
            ),
        )
        rank = cls(
            model,
            loss_fn=loss_fn,
            config=config,
            groups=groups,
            arch=arch,
            distributed_optimizer=spec.distributed_optimizer,
            buddy_copies=spec.buddy_copies,
        )
        if rank.distributed is not None:  # the first step boundary: buddy copies
            rank.distributed.keep_copies(rank.num_steps)
        return rank

    @classmethod
    def empty(
        cls,
        spec: ModelSpec,
        *,
        loss_fn: LossFn,
        config: TrainerConfig,
        groups: RankGroups,
        device: torch.device | str = "cpu",
    ) -> "MegatronRank":
        """A rank on ``device`` whose tensors are allocated but not filled (a joiner)."""
        arch = spec.architecture()
        model = build_gpt(arch, groups.collection, device=device)
        return cls(
            model,
            loss_fn=loss_fn,
            config=config,
            groups=groups,
            arch=arch,
            distributed_optimizer=spec.distributed_optimizer,
            buddy_copies=spec.buddy_copies,
        )

    @property
    def rank(self) -> int:
        """This rank's data-parallel index."""
        return self.groups.position.dp_rank

    @property
    def world_size(self) -> int:
        """Data-parallel size."""
        return self.groups.layout.dp

    def named_shard(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by megatron name (the shard of ``position``)."""
        return {name: p.data for name, p in self.model.named_parameters()}

    def train_step(
        self,
        minibatch: Mapping[str, torch.Tensor],
        *,
        local: bool = False,
        guard: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> StepMetrics:
        """One optimizer step on this replica's samples (the replica's shard of the
        global ``minibatch``, or with ``local`` that shard itself; every worker of the
        replica passes the same). Collective over the members. The update runs inside
        ``guard()`` (which may refuse it: the worker left the world meanwhile)."""
        groups = self.groups
        mine = dict(minibatch) if local else shard(minibatch, self.rank, self.world_size)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.model.train()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        loss_sum, normaliser = self.accumulate(mine if mine and num_samples(mine) > 0 else {})
        if groups.is_loss_rank:
            totals[0], totals[1] = loss_sum, normaliser
        grads = [p.grad for p in params if p.grad is not None]
        if self.distributed is None:
            totals[2] = self._local_grad_square(params)
        dist.all_reduce(totals, group=groups.members)
        loss_total, normaliser_total = float(totals[0]), float(totals[1])
        if normaliser_total <= 0.0:
            raise TrainerError(
                "the minibatch's loss normaliser summed to "
                f"{normaliser_total}; send samples with a positive loss weight"
            )
        with guard():
            if self.distributed is not None:
                self.ddp.scale_gradients(1.0 / normaliser_total)
                grad_norm = self.distributed.step(num_steps=self.num_steps + 1)
            else:
                # Every replica added the same squares: count the model once.
                grad_norm = float(totals[2] / groups.layout.dp) ** 0.5 / normaliser_total
                torch._foreach_div_(grads, normaliser_total)
                if self.config.grad_clip is not None:
                    torch.nn.utils.clip_grads_with_norm_(
                        params, self.config.grad_clip, torch.tensor(grad_norm)
                    )
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.num_steps += 1
        return StepMetrics(
            loss=loss_total / normaliser_total,
            normaliser=normaliser_total,
            grad_norm=grad_norm,
            num_steps=self.num_steps,
        )

    def accumulate(self, batch: TensorBatch) -> tuple[float, float]:
        """Forward and backward over this replica's ``batch`` (empty: none), then the
        wrapper's gradient sum over the data-parallel group, without stepping: the
        summed gradients of the loss *sum* are left in ``.grad`` (views of the
        wrapper's buffers; with the distributed optimizer only in the wrapper's
        buffers, each rank's slice summed); returns this replica's loss sum and
        normaliser (on the last stage; zeros elsewhere). Collective over the
        data-parallel group."""
        self.optimizer.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()
        totals = self._forward_backward(batch) if batch else (0.0, 0.0)
        self.ddp.finish_grad_sync()
        self._sum_tied_embedding_grads()
        if self.distributed is None:
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = p.main_grad  # type: ignore[attr-defined]
        return totals

    def _sum_tied_embedding_grads(self) -> None:
        """With tied embeddings split over stages, add the gradient of the last stage's
        output layer to the first stage's embedding's and back (an all-reduce over the
        embedding group, as megatron-core's ``finalize_model_grads`` does): both copies
        then take the single-stage model's gradient and stay equal. With the
        distributed optimizer the copy has a gradient bucket of its own, sliced the same
        way on both stages, so the sum of the reduce-scattered slices is exact."""
        embedding = self.groups.embedding
        if embedding is None or not self.arch.tied_embeddings:
            return
        weight = self.model.shared_embedding_or_output_weight()  # type: ignore[operator]
        dist.all_reduce(weight.main_grad, group=embedding)

    def _forward_backward(self, batch: TensorBatch) -> tuple[float, float]:
        """Forward and backward over ``batch`` in micro-batches with megatron-core's
        schedule; returns the summed loss and normaliser (meaningful on the last
        stage)."""
        if "input_ids" not in batch:
            raise TrainerError("the minibatch has no input_ids")
        size = self.config.micro_batch_size
        micros = [_padded(m, size) for m in micro_batches(batch, size)]
        width = int(batch["input_ids"].shape[1])
        from megatron.core.pipeline_parallel import schedules

        run = (
            schedules.forward_backward_no_pipelining
            if self.groups.layout.pp == 1
            else schedules.forward_backward_pipelining_without_interleaving
        )
        step = functools.partial(_forward_step, vocab=self.arch.vocab_size, loss_fn=self.loss_fn)
        reports = run(
            forward_step_func=step,
            data_iterator=iter(micros),
            model=self.ddp,
            num_microbatches=len(micros),
            seq_length=width,
            micro_batch_size=size,
            forward_only=False,
            **self._schedule_groups(),
        )
        return _sum_losses(reports if isinstance(reports, list) else [])

    def _schedule_groups(self) -> dict[str, object]:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        collection = self.groups.collection
        if self.groups.layout.pp == 1:
            return {"pg_collection": collection}
        communicator = P2PCommunicator(pp_group=collection.pp, config=self.model.config)
        return {"pg_collection": collection, "p2p_communicator": communicator}

    def _local_grad_square(self, params: list[torch.nn.Parameter]) -> float:
        """Sum of squared gradients of this shard's parameters, tensor-parallel
        duplicates (norms) counted on tensor rank 0 only, and a tied embedding's copy
        on the last stage (megatron-core marks it ``shared``) not at all."""
        first = self.groups.position.tp_rank == 0
        total = 0.0
        for p in params:
            if p.grad is None or getattr(p, "shared", False):
                continue
            if first or getattr(p, "tensor_model_parallel", False):
                total += float(p.grad.detach().double().pow(2).sum())
        return total


def _wrap(model: torch.nn.Module, groups: RankGroups, *, distributed: bool) -> Any:
    """Megatron's ``DistributedDataParallel`` around ``model`` on ``groups``: no
    overlap, sums (``calculate_per_token_loss`` sets the gradient scaling to 1),
    reduce-scattered for the ``distributed`` optimizer, else all-reduced."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with quiet():
        return DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(
                overlap_grad_reduce=False,
                use_distributed_optimizer=distributed,
                grad_reduce_in_fp32=False,
            ),
            model,
            pg_collection=groups.collection,
        )


def _retire(ddp: Any) -> None:
    """Disconnect a wrapper that will not be used again. Its gradient hooks stay on the
    parameters (it does not keep their handles) but find no parameter of theirs any
    more, and its buffers are dropped."""
    ddp.param_to_bucket_group = {}
    ddp.buffers = []
    ddp.bucket_groups = []
    ddp.expert_parallel_buffers = []
    ddp.expert_parallel_bucket_groups = []


def _forward_step(
    data: Iterator[TensorBatch], model: torch.nn.Module, *, vocab: int, loss_fn: LossFn
) -> tuple[torch.Tensor, object]:
    """megatron-core's ``forward_step_func``: one micro-batch through this stage."""
    micro = next(data)
    ids = micro["input_ids"]
    mask = micro.get("attention_mask")
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    attention = causal_mask(mask if mask is not None else torch.ones_like(ids))
    output = model(ids, positions, attention)
    return output, functools.partial(_loss, micro=micro, vocab=vocab, loss_fn=loss_fn)


def _loss(
    logits: torch.Tensor, *, micro: TensorBatch, vocab: int, loss_fn: LossFn
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch on the last stage, in the ``(loss, num_tokens,
    reported)`` form of ``calculate_per_token_loss``: the sum is backpropagated as is."""
    loss_sum, normaliser = loss_fn(logits[..., :vocab], micro)
    reported = {
        "loss_sum": loss_sum.detach().to(torch.float64),
        "normaliser": torch.as_tensor(normaliser, dtype=torch.float64).detach(),
    }
    return loss_sum, torch.zeros((), dtype=torch.int), reported


def _sum_losses(reports: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    loss = sum(float(r["loss_sum"]) for r in reports)
    normaliser = sum(float(r["normaliser"]) for r in reports)
    return loss, normaliser


def _padded(micro: TensorBatch, size: int) -> TensorBatch:
    """``micro`` with all-zero rows appended up to ``size`` (every micro-batch of a
    pipeline has one shape; a zero row has no real token and no loss weight)."""
    rows = num_samples(micro)
    if rows == size:
        return micro
    return {
        name: torch.cat([t, t.new_zeros(size - rows, *t.shape[1:])]) for name, t in micro.items()
    }


def _adamw(model: torch.nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
