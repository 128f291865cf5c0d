"""The worker process entry: one device slot's process, from start to exit.

:func:`slot_main` is the target the launcher spawns. It is an application boundary, so
it runs its own event loop (``anyio.run``) and owns the process: it sets the torch
thread count (a CPU device slot is a process with a fixed number of threads), connects
a DEALER to the controller's ROUTER, says hello and serves typed calls
(:class:`~dynarl.workers.slot.SlotServer`). When the controller retires the slot after
it assumed a role, the slot reconnects as its new instance on a fresh socket; retired
without a next role, or cut off from the controller, it exits.

Orphan safety: a daemon thread watches the parent process (the end of the pipe
``multiprocessing`` keeps to it, and ``os.getppid()``), and ends this process with
``os._exit`` as soon as the parent is gone, however it died; a slot never outlives the
launcher's process.
"""

import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import wait

import anyio

from dynarl.data.endpoint import split_endpoint
from dynarl.data.errors import DataPlaneError, PeerLostError
from dynarl.data.worker_link import open_worker_link
from dynarl.workers.slot import SlotConfig, SlotServer

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.2
"""How often the parent watch re-checks the parent's pid (besides the pipe)."""

EXIT_PARENT_GONE = 3
"""Exit code of a slot whose parent process died."""


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


def exit_process(code: int) -> None:
    """Leave the process now with ``code``, after flushing logs and output."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ignore_interrupts() -> None:
    """Leave Ctrl-C to the controller: a terminal sends SIGINT to the whole process
    group, and the controller then stops every worker in order (a worker that died
    of it would break the collectives its peers are in). A worker still exits if the
    controller dies (:func:`watch_parent`) or cuts it off."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_parent() -> None:
    """Start a daemon thread that ends this process when its parent process dies."""
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    ppid = os.getppid()

    def watch() -> None:
        while True:
            if sentinel is not None:
                if wait([sentinel], timeout=PARENT_POLL_S):
                    break
            else:
                threading.Event().wait(PARENT_POLL_S)
            if os.getppid() != ppid:
                break
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="dynarl-parent-watch", daemon=True).start()


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
            try:
                async with open_worker_link(
                    transport,
                    instance=identity[0],
                    component=identity[1],
                    capacity=config.capacity,
                    hello_timeout_s=config.hello_timeout_s,
                    token=token,
                ) as link:
                    await server.serve(link)
            except PeerLostError as e:
                logger.info("slot %s: link as %s ended: %s", name, identity[0], e)
            except DataPlaneError:
                logger.exception("slot %s: link as %s failed", name, identity[0])
                break
            finally:
                await transport.aclose()
            next_identity = server.take_next_identity()
            if next_identity is None:
                break
            identity = next_identity
        server.stop()
        tg.cancel_scope.cancel()
