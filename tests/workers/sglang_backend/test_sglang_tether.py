"""A launched server dies with the process that launched it: the tether kills the
server's process group when its launcher is gone without stopping it (SIGKILL), and
removes what the launcher wrote for the server; otherwise it waits for the server and
ends as it did."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_a_server_whose_launcher_is_killed_is_killed_with_it(tmp_path: Path) -> None:
    # A launcher process (a slot's worker) starts the tethered "server" in a group of
    # its own, as ServerProcess does, with the policy it wrote for it, prints the
    # group's id and waits.
    policy = tmp_path / "dynarl-sglang-policy-x"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"weights")
    tethered = [*TETHER, "--remove", str(policy), *SLEEPER]
    launch = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen({tethered!r}, start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", launch], stdout=subprocess.PIPE) as launcher:
        assert launcher.stdout is not None
        group = int(launcher.stdout.readline())
        assert policy.exists()
        _killed_with(launcher, group)
    assert not policy.exists(), "the server's policy outlived its launcher"


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
    command: str | None, status: int, tmp_path: Path
) -> None:
    server = [sys.executable, "-c", command] if command else SLEEPER
    # What it is to remove only for a dead launcher: a live one removes it itself.
    tether = subprocess.Popen([*TETHER, "--remove", str(tmp_path), *server], start_new_session=True)
    try:
        if command is None:  # stopped as ServerProcess.stop does: SIGTERM to the group
            time.sleep(0.5)
            os.killpg(tether.pid, signal.SIGTERM)
        assert tether.wait(timeout=10) == status
        assert _gone_within(tether.pid, 5.0)
        assert tmp_path.exists()
    finally:
        if _alive(tether.pid):
            os.killpg(tether.pid, signal.SIGKILL)
