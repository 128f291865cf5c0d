"""Where a run's devices sit on a Ray cluster: placement groups, one bundle per
device.

Devices are taken in consecutive groups of ``group_size`` (the largest model-parallel
group an instance may form on them: a rollout engine's or inference replica's TP
size, an actor replica's TP size); each group is one placement group with the
``STRICT_PACK`` strategy, so Ray puts all its bundles on one node and a TP group
never spans nodes. Different groups may land on different nodes.

A device hosts up to two workers (its device slot and its trainer worker; only one
of them holds the device at a time), so each worker's actor asks for half of its
device's bundle.
"""

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import anyio

from dynarl.workers.errors import LaunchError

logger = logging.getLogger(__name__)

WORKERS_PER_DEVICE = 2
"""Workers that share one device's bundle: its slot and its trainer worker."""


def device_groups(devices: Iterable[int], group_size: int) -> list[list[int]]:
    """``devices`` (sorted) in groups: device ``d`` is in group ``d // group_size``."""
    groups: dict[int, list[int]] = {}
    for device in sorted(set(devices)):
        groups.setdefault(device // group_size, []).append(device)
    return [groups[k] for k in sorted(groups)]


class DevicePlacement:
    """The placement groups that reserve a run's devices on a Ray cluster.

    Args:
        devices: the run's device ids.
        group_size: devices packed on one node together (``STRICT_PACK``).
        bundle: the resources one device reserves (``{"CPU": 1.0}``, ``{"GPU": 1.0, ...}``).
    """

    def __init__(
        self, devices: Sequence[int], *, group_size: int, bundle: dict[str, float]
    ) -> None:
        if group_size < 1:
            raise LaunchError(f"group_size must be >= 1, not {group_size}")
        self.groups = device_groups(devices, group_size)
        self.bundle = {k: v for k, v in bundle.items() if v > 0}
        self._pgs: list[Any] = []
        self._slot: dict[int, tuple[Any, int]] = {}

    async def reserve(self, timeout_s: float) -> None:
        """Create the placement groups and wait until Ray has placed every one.

        Raises :class:`LaunchError` (removing them) if the cluster cannot place them
        within ``timeout_s``: too few resources, or no node with room for a group.
        """
        from ray.util.placement_group import placement_group

        for k, group in enumerate(self.groups):
            pg = placement_group(
                [dict(self.bundle) for _ in group], strategy="STRICT_PACK", name=""
            )
            self._pgs.append(pg)
            for index, device in enumerate(group):
                self._slot[device] = (pg, index)
            logger.debug("placement group %d: devices %s", k, group)
        with anyio.move_on_after(timeout_s):
            for pg in self._pgs:
                await pg.ready()
            return
        import ray

        available = await anyio.to_thread.run_sync(ray.available_resources)
        sizes = sorted({len(g) for g in self.groups})
        self.remove()
        raise LaunchError(
            f"the Ray cluster did not place {len(self.groups)} device groups of {sizes} "
            f"bundles {self.bundle} each (every group on one node) within {timeout_s} s; "
            f"free resources now: {available}. Add nodes, or lower "
            f"cluster.ray.cpus_per_device / cluster.ray.gpus_per_device"
        )

    def strategy(self, device: int) -> Any:
        """The scheduling strategy that puts a worker in ``device``'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            pg, index = self._slot[device]
        except KeyError:
            raise LaunchError(
                f"device {device} has no placement bundle (devices: {sorted(self._slot)})"
            ) from None
        return PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        )

    def worker_resources(self) -> dict[str, Any]:
        """The resources one worker's actor asks of its device's bundle."""
        share = {k: v / WORKERS_PER_DEVICE for k, v in self.bundle.items()}
        out = {"num_cpus": share.pop("CPU", 0.0), "num_gpus": share.pop("GPU", 0.0)}
        return out | ({"resources": share} if share else {})

    def remove(self) -> None:
        """Remove the placement groups (their actors must be gone). Idempotent."""
        from ray.util.placement_group import remove_placement_group

        pgs, self._pgs = self._pgs, []
        self._slot = {}
        for pg in pgs:
            remove_placement_group(pg)
