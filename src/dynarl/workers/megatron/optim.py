"""Megatron's distributed optimizer for one trainer rank, and its state moved in and
out whole.

With ``actor.megatron.distributed_optimizer`` a rank's data-parallel wrapper reduce-
scatters the gradients instead of all-reducing them, and ``get_megatron_optimizer``
builds megatron-core's ``DistributedOptimizer``: each data-parallel rank owns a
contiguous slice of the gradient buffer and keeps AdamW's moments (and, for bf16
parameters, the fp32 main parameters) for that slice only; it steps its slice, and the
parameters are all-gathered over the data-parallel group. The global gradient norm and
the clipping are megatron-core's (the norm's squares summed over every member). One
parameter group, weight decay on every parameter (``config_overrides={}``), as torch's
AdamW of the other path; no learning-rate schedule.

``get_megatron_optimizer`` aligns its parameter groups with an all-gather over the
default group, which megatron-core takes to be the training job. Here the world is the
pool's every worker, members of the layout or not (and a resize builds the next
layout's optimizers while the old one trains): for that one call the optimizer
factory's default group is the layout's members.

Elastic resizes and checkpoints see the state *whole*: :meth:`DistributedAdam.whole`
rebuilds each parameter's moments (and main parameter) from the slices of every
data-parallel rank (one bucketed sum over the data-parallel group: the slices are
disjoint, so the sum is exact), and :meth:`DistributedAdam.load` keeps a rank's own
slice of whole tensors. A checkpoint or a resize therefore carries the same HF-layout
state as with torch's AdamW, whatever the data-parallel size that wrote it.

Every step boundary (after a step, a load, the first build) each rank's slice is also
copied to its buddy, the next data-parallel rank (:meth:`DistributedAdam.keep_copies`,
:mod:`~dynarl.workers.megatron.buddy`), so a lost rank's slice survives it.
"""

import contextlib
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dynarl.workers.megatron import buddy
from dynarl.workers.megatron.cpu import quiet
from dynarl.workers.megatron.layout import RankGroups
from dynarl.workers.torch.trainer_config import TrainerConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter tensors."""

Named = dict[str, torch.Tensor]


class DistributedAdam:
    """megatron-core's distributed AdamW over one rank's shard of the model (wrapped by
    ``ddp``, a ``DistributedDataParallel`` built with ``use_distributed_optimizer``);
    with ``buddy_copies`` it keeps them at every step boundary (see :meth:`keep_copies`)."""

    def __init__(
        self,
        ddp: Any,
        model: torch.nn.Module,
        config: TrainerConfig,
        groups: RankGroups,
        *,
        buddy_copies: bool = True,
    ) -> None:
        with quiet():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        dtype = next(model.parameters()).dtype
        settings = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=config.lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.betas[0],
            adam_beta2=config.betas[1],
            adam_eps=config.eps,
            clip_grad=0.0 if config.grad_clip is None else config.grad_clip,
            use_distributed_optimizer=True,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        )
        with quiet(), _default_group(groups.members):
            self.megatron: Any = get_megatron_optimizer(
                settings,
                [ddp],
                config_overrides={},
                use_gloo_process_groups=False,
                pg_collection=groups.collection,
            )
            """The ``ChainedOptimizer`` ``get_megatron_optimizer`` returns."""
        (self._sharded,) = self.megatron.chained_optimizers
        self.inner: torch.optim.Optimizer = self._sharded.optimizer
        """torch's AdamW over this rank's slices (main parameters)."""
        self.model = model
        self.groups = groups
        self.buddy_copies = buddy_copies
        self.copies = buddy.Copies()
        """This rank's slice at the last step boundaries and its predecessor's copy
        (:mod:`~dynarl.workers.megatron.buddy`; none with one data-parallel rank or
        without ``buddy_copies``)."""
        self._mains: dict[torch.nn.Parameter, torch.Tensor] | None = None

    def step(self, *, num_steps: int) -> float:
        """Megatron's step on the reduce-scattered gradients (already divided by the
        global normaliser): global norm, clipping, AdamW on this rank's slices,
        all-gather of the parameters; then the buddy copies of the boundary
        (:meth:`keep_copies`, ``num_steps``: the rank's step count after this step).
        Returns the gradient norm. If it fails (a peer died), this rank's slice is
        rolled back to the last boundary first. Collective over the members."""
        try:
            ok, grad_norm, _ = self.megatron.step()
            if not ok:  # only a loss scaler skips a step; fp32 and bf16 have none
                raise RuntimeError("megatron's optimizer skipped the step")
            self.megatron.zero_grad(set_to_none=True)
        except BaseException:
            self.roll_back()
            raise
        self.keep_copies(num_steps)
        return float(grad_norm)

    def keep_copies(self, num_steps: int) -> None:
        """A step boundary at ``num_steps``: this rank's slice goes to its buddy, its
        predecessor's comes here, and the boundary is committed (see
        :mod:`~dynarl.workers.megatron.buddy`). If the swap fails the slice rolls back
        to the last boundary; if the commit fails both boundaries' slices are kept.
        Collective over the members (the swap over the data-parallel group); nothing
        with one data-parallel rank or without ``buddy_copies``."""
        if self.groups.layout.dp == 1 or not self.buddy_copies:
            return
        device = _device(self.model)
        mine = self.snapshot(num_steps)
        try:
            theirs = buddy.swap(mine, group=self.groups.dp, device=device)
        except BaseException:
            self.roll_back()
            raise
        self.copies.add(mine, theirs)
        buddy.commit(group=self.groups.members, device=device)
        self.copies.settle()

    def snapshot(self, num_steps: int) -> buddy.Slice:
        """This rank's slice as it is now (a rank of ``num_steps`` steps), in host
        memory."""
        segments: list[tuple[int, int]] = []
        blocks: dict[str, list[torch.Tensor]] = {key: [] for key in buddy.KEYS}
        offset, adam_step, has_moments = 0, 0.0, True
        for _, param, part in self._slices():
            if part is not None:
                segments.append((offset + part.start, part.stop - part.start))
                state = self._state(param)
                blocks["main"].append(state["param"].detach().view(-1).float())
                if "exp_avg" in state:
                    blocks["exp_avg"].append(state["exp_avg"].detach().view(-1).float())
                    blocks["exp_avg_sq"].append(state["exp_avg_sq"].detach().view(-1).float())
                    adam_step = float(state["step"])
                else:
                    has_moments = False
            offset += param.numel()
        if not has_moments:
            blocks["exp_avg"] = blocks["exp_avg_sq"] = [torch.zeros_like(m) for m in blocks["main"]]
        parts = [t for key in buddy.KEYS for t in blocks[key]]
        data = torch.cat(parts) if parts else torch.zeros(0)
        return buddy.Slice(
            dp_rank=self.groups.position.dp_rank,
            num_steps=num_steps,
            adam_step=adam_step,
            has_moments=has_moments and bool(segments),
            segments=torch.tensor(segments, dtype=torch.int64).view(-1, 2),
            data=data.to("cpu", dtype=torch.float32),  # cat made it: no second copy
        )

    def roll_back(self) -> None:
        """Put this rank's slice back as it was at the last step boundary (the newest
        of its own copies; nothing without one). The model's parameters outside the
        slice may hold a failed step's all-gather: a restore rebuilds them."""
        if not self.copies.mine:
            return
        kept = self.copies.mine[-1]
        n, position = kept.length, 0
        for _, param, part in self._slices():
            if part is None:
                continue
            size = part.stop - part.start
            main = self._main(param)
            block = [kept.data[k * n + position : k * n + position + size] for k in range(3)]
            with torch.no_grad():
                main.view(-1).copy_(block[2].to(main.device, main.dtype))
            if kept.has_moments:
                self.inner.state[main] = {
                    "step": torch.tensor(kept.adam_step, dtype=torch.float32),
                    **{
                        key: block[k].to(main.device, main.dtype).view_as(main).clone()
                        for k, key in enumerate(MOMENTS)
                    },
                }
            else:
                self.inner.state.pop(main, None)
            position += size

    def _slices(self) -> list[tuple[str, torch.nn.Parameter, slice | None]]:
        """Each parameter with the slice of its flattened elements this rank owns
        (``None``: none)."""
        owned = self._sharded.model_param_group_index_map
        out: list[tuple[str, torch.nn.Parameter, slice | None]] = []
        for name, param in self.model.named_parameters():
            if param in owned:
                r = self._sharded._get_model_param_range_map(param)["param"]
                out.append((name, param, slice(r.start, r.end)))
            else:
                out.append((name, param, None))
        return out

    def _main(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The main parameter (the inner AdamW's) of this rank's slice of ``param``.

        Read from megatron-core's paired group lists: its ``model_param_group_index_map``
        orders a group's parameters by gradient buffer, the inner optimizer's group lists
        the fp32 ones first, so the two disagree for a model of mixed dtypes (a bf16
        model keeps its norms in fp32)."""
        if self._mains is None:
            sharded = self._sharded
            self._mains = {}
            for models, mains in (
                (sharded.model_fp32_groups, sharded.shard_fp32_groups),
                (sharded.model_float16_groups, sharded.shard_fp32_from_float16_groups),
            ):
                for model_group, main_group in zip(models, mains, strict=True):
                    for model_param, main in zip(model_group, main_group, strict=True):
                        self._mains[model_param] = main
        return self._mains[param]

    def _state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        main = self._main(param)
        return {"param": main, **self.inner.state.get(main, {})}

    def whole(self) -> tuple[dict[str, Named], float]:
        """Whole AdamW moments of this rank's model shard, by megatron name, under
        ``exp_avg``, ``exp_avg_sq`` and (bf16 parameters) ``main`` (fp32 main
        parameters), with the step count; no moments before the first step. Collective
        over the data-parallel group (every rank gets the same)."""
        keys = list(MOMENTS)
        if next(self.model.parameters()).dtype != torch.float32:
            keys.append("main")
        slices = self._slices()
        if all(part == slice(0, p.numel()) for _, p, part in slices):
            return self._own(keys, slices)  # this rank owns every element (DP=1)
        sizes = [p.numel() for _, p, _ in slices]
        total = sum(sizes)
        # [key 0 of every parameter | key 1 ... | step, slices holding a state]
        flat = torch.zeros(len(keys) * total + 2, dtype=torch.float32, device=_device(self.model))
        offset = 0
        for (_, param, part), size in zip(slices, sizes, strict=True):
            if part is not None:
                state = self._state(param)
                if "exp_avg" in state:
                    for k, key in enumerate(keys):
                        source = state["param" if key == "main" else key]
                        start = k * total + offset
                        flat[start + part.start : start + part.stop] = source.detach().view(-1)
                    flat[-2] = float(state["step"])
                    flat[-1] += 1.0
            offset += size
        if self.groups.layout.dp > 1:
            step_and_count = flat[-2:].clone()
            dist.all_reduce(flat, group=self.groups.dp)
            dist.all_reduce(step_and_count, op=dist.ReduceOp.MAX, group=self.groups.dp)
            flat[-2] = step_and_count[0]
        if float(flat[-1]) == 0.0:
            return {}, 0.0
        out: dict[str, Named] = {key: {} for key in keys}
        offset = 0
        for (name, param, _), size in zip(slices, sizes, strict=True):
            for k, key in enumerate(keys):
                start = k * total + offset
                out[key][name] = flat[start : start + size].view(param.shape).clone()
            offset += size
        return out, float(flat[-2])

    def _own(
        self, keys: list[str], slices: list[tuple[str, torch.nn.Parameter, slice | None]]
    ) -> tuple[dict[str, Named], float]:
        """:meth:`whole` of a data-parallel group of one: views of the state."""
        out: dict[str, Named] = {key: {} for key in keys}
        step = 0.0
        for name, param, _ in slices:
            state = self._state(param)
            if "exp_avg" not in state:
                return {}, 0.0
            for key in keys:
                out[key][name] = state["param" if key == "main" else key].detach().view(param.shape)
            step = float(state["step"])
        return out, step

    def load(self, moments: Mapping[str, Named], step: float, *, num_steps: int) -> None:
        """Keep this rank's slices of whole ``moments`` (as :meth:`whole` gives them;
        empty: a fresh optimizer) at ``step``; the main parameters come from
        ``moments["main"]`` when given, else from the model's weights (load those
        first: every rank holds its whole model shard). The result is a step boundary
        at the rank's ``num_steps``: the buddy copies are taken (collective over the
        members, every one of which loads its slices at once)."""
        main = moments.get("main")
        for name, param, part in self._slices():
            if part is None:
                continue
            shard = self._main(param)
            source = main[name] if main is not None else param.detach()
            with torch.no_grad():
                shard.copy_(source.reshape(-1)[part].to(shard.dtype))
            if not all(moments.get(k) for k in MOMENTS):
                self.inner.state.pop(shard, None)
                continue
            self.inner.state[shard] = {
                "step": torch.tensor(step, dtype=torch.float32),
                **{k: moments[k][name].reshape(-1)[part].to(shard.dtype).clone() for k in MOMENTS},
            }
        self.copies = buddy.Copies()
        self.keep_copies(num_steps)


@contextlib.contextmanager
def _default_group(group: dist.ProcessGroup) -> Iterator[None]:
    """While it lasts, megatron-core's optimizer factory sees ``group`` as the default
    group (its world size and all-gathers); nothing else changes."""
    import megatron.core.optimizer as factory

    real = factory.torch
    factory.torch = _TorchOver(group)
    try:
        yield
    finally:
        factory.torch = real


class _TorchOver(types.SimpleNamespace):
    """``torch`` whose ``distributed`` defaults its group to ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(distributed=_DistributedOver(group))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _DistributedOver(types.SimpleNamespace):
    """``torch.distributed`` with ``group`` for the default group of
    ``get_world_size`` and ``all_gather_object``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group=group)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def get_world_size(self, group: dist.ProcessGroup | None = None) -> int:
        return dist.get_world_size(group if group is not None else self.group)

    def all_gather_object(
        self, out: list[Any], obj: Any, group: dist.ProcessGroup | None = None
    ) -> None:
        dist.all_gather_object(out, obj, group=group if group is not None else self.group)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
