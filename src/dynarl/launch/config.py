"""The cluster's section of the configuration: how many devices, and which launcher
starts the workers on them."""

from typing import Literal

from dynarl.core.config import PositiveInt, Section


class ClusterConfig(Section, frozen=True, kw_only=True):
    """Devices and where workers run.

    Attributes:
        num_devices: accelerators in the job (on CPU: device slots, one process each).
        threads_per_device: torch threads per CPU device slot.
        launcher: ``local`` (worker subprocesses here) or ``ray`` (Ray actors; not
            built yet: refused).
    """

    num_devices: PositiveInt = 4
    threads_per_device: PositiveInt = 1
    launcher: Literal["local", "ray"] = "local"
