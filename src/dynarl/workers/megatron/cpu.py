"""Running megatron-core on a CPU-only torch: the three ``torch.cuda`` assumptions it
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
3. the pipeline schedules (``forward_backward_*``) allocate their token counter with
   ``device="cuda"``: the schedules module sees a torch whose ``zeros`` maps that to
   the CPU.

:func:`use_cpu` applies them, only when CUDA is absent, once per process (calling it
again does nothing); the backend calls it before it builds a model. Nothing happens
at import time.
"""

import contextlib
import logging
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def cuda_available() -> bool:
    """Whether this process can use CUDA (then nothing is redirected)."""
    return torch.cuda.is_available()


def use_cpu() -> bool:
    """Redirect megatron-core's CUDA assumptions to the CPU when CUDA is absent;
    returns whether the redirections are in place. Idempotent."""
    if cuda_available():
        return False
    if torch.cuda.current_device is _current_device:  # this process is redirected
        return True
    with quiet():
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import random

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    schedules.torch = _CpuTorch()
    logger.info("megatron-core redirected to the CPU (no CUDA here)")
    return True


def _current_device() -> Any:  # megatron passes it on as a device
    return _CPU


def _synchronize(device: object = None) -> None:
    """Nothing to wait for: CPU work is synchronous."""


class _CpuTorch(types.SimpleNamespace):
    """``torch`` as the pipeline schedules see it: every attribute is torch's, except
    that tensors asked for on ``"cuda"`` are made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = _CPU
        return torch.zeros(*size, **kwargs)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """megatron-core warns when its modules load that Apex and Transformer Engine are
    absent (expected: the local spec uses torch's own layers) and that modules it
    imports itself are deprecated; none of it concerns the caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
