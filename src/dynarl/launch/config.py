"""The cluster's section of the configuration: how many devices, which launcher
starts the workers on them, and where the controller listens for them."""

from typing import Annotated, Literal

import msgspec

from dynarl.core.config import Accelerator, NonNegativeFloat, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError


class RayConfig(Section, frozen=True, kw_only=True):
    """How the Ray launcher (``cluster.launcher=ray``) reaches its cluster and what each
    device asks of it.

    Attributes:
        address: the Ray cluster to join: ``None`` starts a local one on this machine
            (unless this process already called ``ray.init``: then that one);
            ``"auto"`` joins the cluster ``ray start --head`` runs on this machine;
            ``"HOST:PORT"`` the cluster whose head (GCS) listens there.
        cpus_per_device: CPUs one device's placement-group bundle reserves (its device
            slot and its trainer worker share them).
        gpus_per_device: GPUs one device's bundle reserves (1 on a GPU cluster; 0 on
            CPU, where a device is a CPU slot). ``cluster.accelerator=cuda`` needs it
            above 0 (Ray then shows each worker its bundle's GPU).
    """

    address: str | None = None
    cpus_per_device: PositiveFloat = 1.0
    gpus_per_device: NonNegativeFloat = 0.0


class ClusterConfig(Section, frozen=True, kw_only=True):
    """Devices, where workers run, and where they reach the controller.

    Attributes:
        num_devices: accelerators in the job (on CPU: device slots, one process each).
        accelerator: what a device is: ``cpu`` (a CPU slot; gloo) or ``cuda`` (a GPU:
            the trainer, the torch engines and the Megatron inference worker run on it,
            collectives over NCCL; device ``d`` is GPU ``d % N`` of the ``N`` its
            process sees). ``cuda`` needs CUDA where the workers run: the run refuses
            it before any start when the local launcher's machine has none.
        threads_per_device: torch threads per CPU device slot.
        launcher: ``local`` (worker subprocesses here) or ``ray`` (Ray actors in
            placement groups across the nodes of a Ray cluster; see ``docs/cluster.md``).
        bind_host: the interface the controller's data router listens on, over TCP
            (``0.0.0.0``: every interface). ``None``: a private ``ipc://`` socket with
            the local launcher; this machine's network address with ``ray``.
        advertise_host: the address workers dial to reach the controller (behind NAT,
            a load balancer, ...). ``None``: ``bind_host``, or this machine's network
            address when ``bind_host`` is ``0.0.0.0``. Needs a TCP router.
        controller_port: the TCP port the data router listens on; 0: a free port
            (open it in the firewall between nodes if fixed). Needs a TCP router.
        ray: the Ray launcher's settings (used only with ``launcher=ray``).
    """

    num_devices: PositiveInt = 4
    accelerator: Accelerator = "cpu"
    threads_per_device: PositiveInt = 1
    launcher: Literal["local", "ray"] = "local"
    bind_host: str | None = None
    advertise_host: str | None = None
    controller_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    ray: RayConfig = msgspec.field(default_factory=RayConfig)

    @property
    def uses_tcp(self) -> bool:
        """Whether the controller listens over TCP (else on a private ipc socket)."""
        return self.launcher == "ray" or self.bind_host is not None

    def __post_init__(self) -> None:
        if not self.uses_tcp:
            for field, value, default in (
                ("advertise_host", self.advertise_host, None),
                ("controller_port", self.controller_port, 0),
            ):
                if value != default:
                    raise ConfigError(
                        f"cluster.{field}={value!r} needs a TCP controller, but with the local "
                        f"launcher and no cluster.bind_host it listens on a private ipc socket: "
                        f"set cluster.bind_host (e.g. 127.0.0.1) or drop cluster.{field}",
                        field=f"cluster.{field}",
                    )
        if self.launcher != "ray" and self.ray != RayConfig():
            raise ConfigError(
                "cluster.ray.* is set but cluster.launcher is not ray: set "
                "cluster.launcher=ray or drop the cluster.ray settings",
                field="cluster.ray",
            )
        if self.launcher == "ray" and self.accelerator == "cuda" and not self.ray.gpus_per_device:
            # Refused, not defaulted to 1: how many GPUs a device is (a fraction to
            # share one, more for a server of its own) is the user's to say.
            raise ConfigError(
                "cluster.accelerator=cuda, but cluster.ray.gpus_per_device=0 reserves no "
                "GPU for a device's workers (Ray would show them none): set "
                "cluster.ray.gpus_per_device=1 (or the share of a GPU one device is)",
                field="cluster.ray.gpus_per_device",
            )
