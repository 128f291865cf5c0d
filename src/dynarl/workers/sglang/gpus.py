"""Which GPUs a launched SGLang server runs on: its engine's run devices, mapped the
way the torch and Megatron backends map theirs (run device ``d`` is GPU ``d % N`` of
the ``N`` the launching process sees), handed to the server as its
``CUDA_VISIBLE_DEVICES``. Without it every server would take GPUs ``0..tp-1``
(SGLang's ``--base-gpu-id`` defaults to 0) and stack on the node's first GPUs.

Under Ray each slot's process sees the GPUs its own bundle reserved
(``cluster.ray.gpus_per_device``), so an engine of ``tp`` > 1 cannot be placed from one
slot: that is refused before the run starts (:func:`check_slot_gpus`), naming the fix."""

import os
from collections.abc import Mapping, Sequence

from dynarl.core.errors import ConfigError


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them (indices or
    UUIDs), or ``0..N-1`` for the ``N`` CUDA reports when it is unset."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is not None:
        return [name.strip() for name in names.split(",") if name.strip()]
    import torch  # SGLang's own dependency; only a server on GPUs asks

    return [str(i) for i in range(torch.cuda.device_count())]


def server_gpus(devices: Sequence[int], visible: Sequence[str]) -> list[str]:
    """The GPUs (as ``visible`` names them) of an engine on run ``devices``: run device
    ``d`` is ``visible[d % len(visible)]``.

    Raises:
        ConfigError: this process sees no GPU, or fewer than the engine's devices
            map to (two of them would share a GPU).
    """
    if not visible:
        raise ConfigError(
            "cluster.accelerator=cuda, but this slot's process sees no GPU to launch its "
            "SGLang server on: run it on a node with GPUs (with Ray: "
            "cluster.ray.gpus_per_device > 0), or set cluster.accelerator=cpu for the "
            "fake server",
            field="cluster.accelerator",
        )
    gpus = [visible[d % len(visible)] for d in devices]
    if len(set(gpus)) < len(gpus):
        raise ConfigError(
            f"rollout.tp={len(devices)}: the SGLang engine on run devices "
            f"{tuple(devices)} needs {len(devices)} GPUs, but its slot's process sees "
            f"{len(visible)} ({','.join(visible)}), so two of them would share one. "
            f"Under Ray each slot sees only its own bundle's GPUs: start the servers "
            f"yourself and attach them (rollout.sglang.urls), run on one node with the "
            f"local launcher, or set rollout.tp=1",
            field="rollout.tp",
        )
    return gpus


def check_slot_gpus(engine_sizes: Mapping[str, int], gpus_per_slot: float) -> None:
    """Refuse, before anything starts, engines wider than the GPUs one slot's process
    sees (under Ray, ``cluster.ray.gpus_per_device``): ``engine_sizes`` maps each field
    that sets an engine size (``rollout.tp``, ``rollout.tail_tp``) to its value (0:
    unused). :func:`server_gpus` refuses the same as a server launches.

    Raises:
        ConfigError: naming the first field too wide, and the fixes.
    """
    for field, size in engine_sizes.items():
        if size > max(1.0, gpus_per_slot):
            raise ConfigError(
                f"{field}={size}: an SGLang server of {size} GPUs is launched by one slot, "
                f"and under Ray each slot's process sees only its own bundle's GPUs "
                f"(cluster.ray.gpus_per_device={gpus_per_slot:g}): start the servers "
                f"yourself and attach them (rollout.sglang.urls; without "
                f"rollout.tail_tp), run on one node with the local launcher, or set "
                f"{field}={'1' if field == 'rollout.tp' else '0'}",
                field=field,
            )


def server_env(devices: Sequence[int], visible: Sequence[str]) -> dict[str, str]:
    """The environment that places a server on ``devices``' GPUs (see
    :func:`server_gpus`)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(server_gpus(devices, visible))}
