"""A launched server dies with the process that launched it: the tether kills the
server's process group when its launcher is gone without stopping it (SIGKILL), and
otherwise waits for the server and ends as it did."""

import os
import signal
import subprocess
import sys
import time

import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
TETHER = [sys.executable, "-m", "dynarl.workers.sglang.tether"]


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _gone_within(group: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(group):
            return True
        time.sleep(0.05)
    return False


def test_a_server_whose_launcher_is_killed_is_killed_with_it() -> None:
    # A launcher process (a slot's worker) starts the tethered "server" in a group of
    # its own, as ServerProcess does, prints the group's id and waits.
    launch = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen({[*TETHER, *SLEEPER]!r}, start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", launch], stdout=subprocess.PIPE) as launcher:
        assert launcher.stdout is not None
        group = int(launcher.stdout.readline())
        _killed_with(launcher, group)


def _killed_with(launcher: subprocess.Popen[bytes], group: int) -> None:
    try:
        time.sleep(0.5)
        assert _alive(group)
        launcher.kill()  # SIGKILL: it cannot stop its server
        launcher.wait()
        assert _gone_within(group, 5.0), "the server outlived its launcher"
    finally:
        if _alive(group):
            os.killpg(group, signal.SIGKILL)


@pytest.mark.parametrize(("command", "status"), [("raise SystemExit(3)", 3), (None, -15)])
def test_the_tether_waits_for_its_server_and_ends_as_it_did(
    command: str | None, status: int
) -> None:
    server = [sys.executable, "-c", command] if command else SLEEPER
    tether = subprocess.Popen([*TETHER, *server], start_new_session=True)
    try:
        if command is None:  # stopped as ServerProcess.stop does: SIGTERM to the group
            time.sleep(0.5)
            os.killpg(tether.pid, signal.SIGTERM)
        assert tether.wait(timeout=10) == status
        assert _gone_within(tether.pid, 5.0)
    finally:
        if _alive(tether.pid):
            os.killpg(tether.pid, signal.SIGKILL)
