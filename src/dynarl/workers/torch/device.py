"""Which torch device a worker process runs on: the CPU, or the GPU its run device
maps to (``cluster.accelerator``), refused with the fix when this process sees no
CUDA (a Ray worker on a node without GPUs, a torch built without CUDA)."""

import torch

from dynarl.core.config import Accelerator
from dynarl.core.errors import ConfigError


def torch_device(accelerator: Accelerator, device: int) -> torch.device:
    """The device run device ``device`` is in this process: the CPU, or GPU
    ``device % N`` of the ``N`` this process sees (made the current CUDA device).

    Raises:
        ConfigError: ``accelerator`` is ``cuda`` and this process sees no GPU.
    """
    if accelerator == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"cluster.accelerator=cuda, but this worker process sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}): run it on a "
            f"node with GPUs (with Ray: cluster.ray.gpus_per_device > 0) and a CUDA "
            f"torch, or set cluster.accelerator=cpu",
            field="cluster.accelerator",
        )
    gpu = torch.device("cuda", device % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    return gpu
