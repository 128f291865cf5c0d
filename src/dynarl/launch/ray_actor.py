"""The Ray actor that hosts one dynarl worker process on a node of the cluster.

:class:`WorkerHost` is a plain class; the Ray launcher makes it an actor
(``ray.remote(WorkerHost)``) placed in a device's placement-group bundle. Its
:meth:`~WorkerHost.run` starts the same worker main a local launcher runs (a device
slot's :func:`~dynarl.workers.main.slot_main`, a backend's trainer worker entry) in a
child process of the actor, and returns that process's exit code when it ends: the
worker is an ordinary dynarl worker process that dials the controller's data router
over ZeroMQ TCP. A child process, rather than the actor's own, because a worker owns
its process (it sets its thread count before torch loads, leaves with ``os._exit``,
ignores Ctrl-C); it watches its parent, so killing the actor (``ray.kill``, its node
lost) ends the worker too.

The child's output (and its log records, from INFO up) go to a file on the node,
which the launcher reads back through :meth:`~WorkerHost.read_log` into the run
directory. The actor is threaded (several calls at once): ``run`` blocks while the
worker lives and the other methods answer beside it.
"""

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec

MAX_LOG_READ_BYTES = 1 << 20
"""Most log bytes one :meth:`WorkerHost.read_log` call returns."""


class Whereabouts(msgspec.Struct, frozen=True, kw_only=True):
    """Where an actor runs: its node's address and id, its host name and process."""

    ip: str
    node_id: str
    hostname: str
    pid: int


def child_main(entry: Callable[..., None], args: tuple[Any, ...], log_path: str) -> None:
    """A worker process's start under Ray: send its output to ``log_path``, log INFO
    and up there, leave when the actor goes, then run ``entry(*args)``."""
    from dynarl.workers.process import watch_parent

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The worker's process is its own application: it may configure logging.
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    watch_parent()
    entry(*args)


class WorkerHost:
    """Hosts one worker process on the node Ray placed it on.

    Args:
        name: the worker's name (its first instance id at the data router).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"dynarl-{name}-"))
        self.log_path = self._log_dir / "worker.log"
        self._process: BaseProcess | None = None
        self._started = threading.Event()

    def where(self) -> Whereabouts:
        """Where this actor runs."""
        import ray

        return Whereabouts(
            ip=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def run(self, entry: Callable[..., None], args: tuple[Any, ...]) -> int:
        """Run ``entry(*args)`` in a child process until it ends; returns its exit code
        (negative: the signal that ended it)."""
        if self._process is not None:
            raise RuntimeError(f"worker {self.name} was already started")
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=child_main,
            args=(entry, args, str(self.log_path)),
            name=f"dynarl-{self.name}",
            daemon=True,
        )
        process.start()
        self._process = process
        self._started.set()
        process.join()
        code = process.exitcode
        assert code is not None, "a joined process has an exit code"
        return code

    def pid(self, timeout_s: float = 60.0) -> int | None:
        """The worker process's id, once :meth:`run` started it (``None`` if it did not
        within ``timeout_s``)."""
        self._started.wait(timeout_s)
        return None if self._process is None else self._process.pid

    def read_log(self, offset: int) -> bytes:
        """The worker's output from byte ``offset`` on (at most
        :data:`MAX_LOG_READ_BYTES`)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                return f.read(MAX_LOG_READ_BYTES)
        except FileNotFoundError:
            return b""

    def stop(self, timeout_s: float) -> int | None:
        """End the worker process if it still runs: SIGTERM, then SIGKILL after
        ``timeout_s``; returns its exit code (``None``: never started)."""
        process = self._process
        if process is None:
            return None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if process.exitcode is not None or process.pid is None:
                break
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                break
            # run() is blocked reaping the process in another thread: poll, not join.
            deadline_s = time.monotonic() + timeout_s
            while process.exitcode is None and time.monotonic() < deadline_s:
                time.sleep(0.05)
        return process.exitcode

    def close(self) -> None:
        """Remove the worker's log file from the node (read it first)."""
        shutil.rmtree(self._log_dir, ignore_errors=True)
