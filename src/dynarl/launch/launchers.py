"""The table of launchers ``cluster.launcher`` names, and :func:`build_launcher`, which
makes the one the config names, refusing one whose packages are missing or whose
accelerator this machine lacks.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path

from dynarl.core.errors import ConfigError
from dynarl.data.router import Router
from dynarl.launch.config import ClusterConfig
from dynarl.launch.launcher import Launcher
from dynarl.workers.backends import Backend, check_name
from dynarl.workers.slot import SlotConfig

LAUNCHERS: Mapping[str, Backend] = {
    "local": Backend(requires=(), extra="", built=True),
    "ray": Backend(requires=("ray",), extra="ray", built=True),
}
"""Every launcher, by name."""


def check(cluster: ClusterConfig) -> None:
    """Raise :class:`~dynarl.ConfigError` unless ``cluster.launcher`` can run here with
    ``cluster.accelerator``: the local launcher's workers run on this machine, so
    ``cuda`` needs CUDA here (Ray's workers run on other nodes: each checks its own as
    it builds, and fails naming the field)."""
    check_name("cluster.launcher", cluster.launcher, LAUNCHERS)
    if cluster.accelerator == "cuda" and cluster.launcher == "local":
        check_name("cluster.accelerator", "cuda", {"cuda": Backend(("torch",), "torch", True)})
        import torch  # only for cuda: checking the CPU needs no torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"cluster.accelerator=cuda, but this machine shows no CUDA device to "
                f"torch {torch.__version__} (CUDA build: {torch.version.cuda}), and the "
                f"local launcher runs every worker here: run on a machine with a GPU and "
                f"a CUDA torch, or set cluster.accelerator=cpu",
                field="cluster.accelerator",
            )


def build_launcher(
    cluster: ClusterConfig,
    router: Router,
    *,
    num_slots: int,
    slot: SlotConfig,
    slot_devices: Sequence[int] | None = None,
    worker_devices: Mapping[str, int] | None = None,
    group_size: int = 1,
    log_dir: Path | None = None,
) -> Launcher:
    """The launcher ``cluster.launcher`` names, for ``num_slots`` slots run as ``slot``
    says, connecting to ``router``.

    Where workers are placed (the Ray launcher): ``slot_devices`` (default
    ``0..num_slots-1``) and ``worker_devices`` (by name) are their devices, and each
    ``group_size`` consecutive devices stay on one node. ``log_dir`` receives the
    output of workers that run on other nodes."""
    check(cluster)
    if cluster.launcher == "ray":
        from dynarl.launch.ray import RayLauncher

        return RayLauncher(
            router,
            cluster,
            slot=slot,
            slot_devices=list(range(num_slots)) if slot_devices is None else slot_devices,
            worker_devices=worker_devices,
            group_size=group_size,
            log_dir=log_dir,
        )
    from dynarl.launch.local import LaunchConfig, LocalLauncher

    return LocalLauncher(router, LaunchConfig(num_slots=num_slots, slot=slot))
