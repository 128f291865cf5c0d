"""This process's connection to a Ray cluster, for the Ray launcher.

:class:`RayConnection` joins the cluster ``cluster.ray.address`` names (or starts a
local one) and leaves it at the end. If this process is already connected (the
application called ``ray.init``), that connection is used as it is and left open.

A local cluster it starts offers at least the logical CPUs the run's placement
bundles ask for (on a 2-core machine, a 4-device run's four 1-CPU bundles): Ray's CPU
counts are scheduling tokens, the workers' threads are set by the run.

``ray.init`` runs in a thread the connection keeps until it closes: a local cluster's
processes are tied to the life of the thread that starts them (Ray sets their parent
death signal, which Linux sends when that *thread* ends), so starting it from a pooled
worker thread would stop the cluster as soon as that thread retires.
"""

import logging
import math
import os
import threading

import anyio

from dynarl.launch.config import RayConfig
from dynarl.workers.errors import LaunchError

logger = logging.getLogger(__name__)


class RayConnection:
    """Joins (or starts) a Ray cluster; :meth:`aclose` leaves it.

    Args:
        config: the Ray launcher's section.
        timeout_s: most time to connect.
        local_num_cpus: the logical CPUs a local cluster it starts offers at least
            (the run's bundles), beyond this machine's cores.
    """

    def __init__(
        self, config: RayConfig, *, timeout_s: float = 120.0, local_num_cpus: float = 0.0
    ) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self.local_num_cpus = local_num_cpus
        self.owned = False
        """Whether this connection called ``ray.init`` (and so leaves at the end)."""
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._leave = threading.Event()
        self._error: BaseException | None = None

    async def open(self) -> None:
        """Connect, unless this process already is. Raises :class:`LaunchError` if
        Ray cannot connect, or if the process is connected and ``address`` is set."""
        import ray

        if ray.is_initialized():
            if self.config.address is not None:
                raise LaunchError(
                    f"this process is already connected to a Ray cluster (ray.init was "
                    f"called), so cluster.ray.address={self.config.address!r} cannot be "
                    f"honoured: drop cluster.ray.address to use that cluster, or do not "
                    f"call ray.init"
                )
            logger.info("using this process's Ray connection")
            return
        self._thread = threading.Thread(target=self._hold, name="dynarl-ray", daemon=True)
        self._thread.start()
        with anyio.fail_after(self.timeout_s):
            await anyio.to_thread.run_sync(self._ready.wait, abandon_on_cancel=True)
        if self._error is not None:
            where = self.config.address or "a new local cluster"
            raise LaunchError(f"cannot connect to Ray ({where}): {self._error}") from self._error
        self.owned = True

    def _hold(self) -> None:
        import ray

        local = self.config.address is None
        try:
            ray.init(
                # "local": a new cluster, even if one already runs on this machine.
                address="local" if local else self.config.address,
                # Logical CPUs only count bundles: room for the run's on a small machine.
                num_cpus=max(os.cpu_count() or 1, math.ceil(self.local_num_cpus))
                if local
                else None,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            logger.info("connected to Ray (%s)", self.config.address or "a new local cluster")
        except BaseException as e:  # reported by open()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._leave.wait()
        ray.shutdown()

    async def aclose(self) -> None:
        """Leave the cluster if this connection joined it (a local cluster it started
        stops). Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._leave.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(thread.join, 60.0)
        self.owned = False
