"""What every worker process (a device slot, a trainer worker) does for itself: it
never outlives its launcher, leaves Ctrl-C to the controller, and exits without the
interpreter's slow teardown.

Orphan safety: a daemon thread watches the parent process (the end of the pipe
``multiprocessing`` keeps to it, and ``os.getppid()``), and ends this process with
``os._exit`` as soon as the parent is gone, however it died.
"""

import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import wait

PARENT_POLL_S = 0.2
"""How often the parent watch re-checks the parent's pid (besides the pipe)."""

EXIT_PARENT_GONE = 3
"""Exit code of a slot whose parent process died."""


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
