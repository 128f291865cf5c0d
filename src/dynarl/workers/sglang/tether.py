"""Keeps a launched SGLang server from outliving the process that launched it.

``python -m dynarl.workers.sglang.tether [--remove PATH]... COMMAND...`` runs
``COMMAND`` (the server) as its child, in the process group the launcher made for it,
and waits for it. Should the launcher (a slot's worker process) die without stopping
the server -- a SIGKILL leaves it no chance -- the tether sees itself handed to another
parent, deletes each ``PATH`` (what the launcher would have removed after the server:
the random-init policy it wrote for it) and kills the whole group: the server, the
schedulers it forked and itself. Otherwise an orphaned server would keep its
accelerator's memory and its port, and the slot rebooted on that device would find
both taken (it launches its server on the same port).

A SIGTERM to the group reaches the server itself; the tether ignores it and waits for
the server to finish, then exits with the server's code.
"""

import os
import shutil
import signal
import subprocess
import sys

POLL_S = 0.5
"""How often the tether checks that its launcher is alive."""


def main(argv: list[str]) -> int:
    """Run ``argv`` tied to this process's parent; returns its exit code."""
    remove: list[str] = []
    while len(argv) > 1 and argv[0] == "--remove":
        remove.append(argv[1])
        argv = argv[2:]
    if not argv:
        print(
            "usage: python -m dynarl.workers.sglang.tether [--remove PATH]... COMMAND...",
            file=sys.stderr,
        )
        return 2
    launcher = os.getppid()
    # The group's SIGTERM is the server's to act on. Handled here, not ignored: an
    # ignored signal would stay ignored in the server across exec, a handled one not.
    signal.signal(signal.SIGTERM, _wait_for_the_server)
    server = subprocess.Popen(argv)
    while True:
        try:
            code = server.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if os.getppid() != launcher:
                for path in remove:
                    shutil.rmtree(path, ignore_errors=True)
                os.killpg(0, signal.SIGKILL)
            continue
        if code < 0:  # killed by a signal: end the same way, so the launcher sees it
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        return code


def _wait_for_the_server(signum: int, frame: object) -> None:
    """SIGTERM: nothing to do here (the server got it too; its exit ends the wait)."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
