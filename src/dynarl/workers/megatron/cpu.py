"""Running megatron-core on a CPU-only torch: the ``torch.cuda`` assumptions it
makes, redirected to the CPU in one place.

megatron-core 0.16 runs on the CPU with gloo once these are redirected:

1. ``torch.cuda.current_device()`` names the device of buffers it allocates on the
   fly (attention's global memory buffer, rotary frequencies, pipeline p2p shapes):
   it answers the CPU device, and ``torch.cuda.synchronize()`` (pipeline p2p) does
   nothing;
2. its model-parallel RNG tracker keeps CUDA generator states: the inference tracker
   (whose ``fork`` does not touch any RNG) is installed instead, which is exact for the
   dropout-free models this backend builds (:mod:`~dynarl.workers.megatron.model`
   refuses dropout);
3. the pipeline schedules (``forward_backward_*``) allocate their token counter, and
   the optimizer modules (``optimizer``, ``distrib_optimizer``, ``clip_grads``, and
   ``utils``' local multi-tensor norm) their loss scale, overflow flag and norm
   buffers, with ``device="cuda"``: those modules
   see a torch whose tensor factories map that to the CPU;
4. the optimizers tell fp32 parameters from fp16/bf16 ones by their legacy type name
   (``param.type() == "torch.cuda.FloatTensor"``, else a ``TypeError``) when
   ``DistributedOptimizer`` is built and when ``clip_grad_by_total_norm_fp32`` clips:
   inside those two calls only, a CPU tensor answers the CUDA spelling of its type (the
   accelerator here is the CPU; the dtype part of the name is unchanged).

With them, ``get_megatron_optimizer`` builds Megatron's distributed optimizer on the
CPU (gloo groups), and it runs as on a GPU: the same sharding of main parameters and
moments, reduce-scatter of gradients, all-gather of parameters, norm and clipping.

:func:`use_cpu` applies them when CUDA is absent, or when the process runs Megatron on
the CPU although it sees a GPU (``cluster.accelerator=cpu`` on a GPU machine), once per
process (calling it again does nothing); the backend calls it before it builds a model.
Nothing happens at import time.
"""

import contextlib
import functools
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def cuda_available() -> bool:
    """Whether this process can use CUDA (then nothing is redirected)."""
    return torch.cuda.is_available()


def use_cpu(*, force: bool = False) -> bool:
    """Redirect megatron-core's CUDA assumptions to the CPU when CUDA is absent, or with
    ``force`` (this process runs Megatron on the CPU although it sees a GPU:
    ``cluster.accelerator=cpu`` on a GPU machine); returns whether the redirections are
    in place. Idempotent."""
    if cuda_available() and not force:
        return torch.cuda.current_device is _current_device
    if torch.cuda.current_device is _current_device:  # this process is redirected
        return True
    with quiet():
        from megatron.core import utils
        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import random

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    for module in (schedules, optimizer, distrib_optimizer, clip_grads, utils):
        module.torch = _CpuTorch()
    optimized = distrib_optimizer.DistributedOptimizer
    optimized.__init__ = _cuda_type_names(optimized.__init__)
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip
    logger.info("megatron-core redirected to the CPU (no CUDA here)")
    return True


def _current_device() -> Any:  # megatron passes it on as a device
    return _CPU


def _synchronize(device: object = None) -> None:
    """Nothing to wait for: CPU work is synchronous."""


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = _CPU
    return kwargs


class _CpuTorch(types.SimpleNamespace):
    """``torch`` as megatron-core's schedules and optimizer modules see it: every
    attribute is torch's, except that tensors asked for on ``"cuda"`` are made on the
    CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, **_on_cpu(kwargs))

    @staticmethod
    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*size, **_on_cpu(kwargs))

    @staticmethod
    def tensor(data: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, **_on_cpu(kwargs))


_F = TypeVar("_F", bound=Callable[..., Any])


def _cuda_type_names(function: _F) -> _F:
    """``function`` run while ``Tensor.type()`` (no argument) answers a CPU tensor's
    legacy type name in its CUDA spelling (``torch.FloatTensor`` ->
    ``torch.cuda.FloatTensor``); every other call of ``type`` is torch's."""
    legacy = torch.Tensor.type

    def cuda_spelling(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = legacy(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu" or not isinstance(name, str):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        torch.Tensor.type = cuda_spelling  # type: ignore[method-assign,assignment]
        try:
            return function(*args, **kwargs)
        finally:
            del torch.Tensor.type

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """megatron-core warns when its modules load that Apex and Transformer Engine are
    absent (expected: the local spec uses torch's own layers) and that modules it
    imports itself are deprecated; none of it concerns the caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
