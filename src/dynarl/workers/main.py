"""The worker process entry: one device slot's process, from start to exit.

:func:`slot_main` is the target the launcher spawns. It is an application boundary, so
it runs its own event loop (``anyio.run``) and owns the process: it sets the torch
thread count (a CPU device slot is a process with a fixed number of threads), connects
a DEALER to the controller's ROUTER, says hello and serves typed calls
(:class:`~dynarl.workers.slot.SlotServer`). When the controller retires the slot after
it assumed a role, the slot reconnects as its new instance on a fresh socket; retired
without a next role, or cut off from the controller, it exits.

Orphan safety (:mod:`~dynarl.workers.process`): a slot never outlives the launcher's
process.
"""

import logging
import os

import anyio

from dynarl.data.endpoint import split_endpoint
from dynarl.data.errors import DataPlaneError, PeerLostError
from dynarl.data.worker_link import open_worker_link
from dynarl.workers.process import exit_process, ignore_interrupts, watch_parent
from dynarl.workers.slot import SlotConfig, SlotServer

logger = logging.getLogger(__name__)


def slot_main(endpoint: str, name: str, config: SlotConfig) -> None:
    """Run slot ``name`` against the controller at ``endpoint`` until it is retired
    without a next role, loses the controller, or its parent dies.

    After a clean exit the process leaves with ``os._exit``: tearing down an
    interpreter that imported torch takes seconds and frees nothing the OS would not.
    """
    watch_parent()
    ignore_interrupts()
    # Before torch is imported: OpenMP reads it once.
    os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
    code = 0
    try:
        anyio.run(_run, endpoint, name, config)
    except BaseException:
        logger.exception("slot %s failed", name)
        code = 1
    exit_process(code)


async def _run(endpoint: str, name: str, config: SlotConfig) -> None:
    server = SlotServer(name, config)
    try:
        await _serve(server, endpoint, name, config)
    finally:
        server.close()  # a launched SGLang server ends with its slot, however it ends


async def _serve(server: SlotServer, endpoint: str, name: str, config: SlotConfig) -> None:
    from dynarl.data.zmq_transport import ZmqTransport

    address, token = split_endpoint(endpoint)
    async with anyio.create_task_group() as tg:
        if config.preload_modules:
            tg.start_soon(server.preload)
        identity = server.identity
        while True:
            transport = ZmqTransport.connect(address)
            reconnect = False  # as the role switch's new identity; else the slot stops
            try:
                async with open_worker_link(
                    transport,
                    instance=identity[0],
                    component=identity[1],
                    capacity=config.capacity,
                    slots=server.slots,
                    hello_timeout_s=config.hello_timeout_s,
                    token=token,
                ) as link:
                    await server.serve(link)
            except PeerLostError as e:
                logger.info("slot %s: link as %s ended: %s", name, identity[0], e)
                reconnect = e.reconnect
            except DataPlaneError:
                logger.exception("slot %s: link as %s failed", name, identity[0])
                break
            finally:
                await transport.aclose()
            # A role built but never connected (a prebuilt one) leaves an identity
            # behind: only a role switch's retirement connects as it.
            next_identity = server.take_next_identity()
            if next_identity is None or not reconnect:
                break
            identity = next_identity
        server.stop()
        tg.cancel_scope.cancel()
