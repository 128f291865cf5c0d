"""The local launcher starts real slot processes and leaves none behind: not after a
shutdown, and not after its own process is killed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from dynarl.core.ids import ComponentId, EdgeId, InstanceId
from dynarl.data import Router
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.local import LaunchConfig, LocalLauncher
from dynarl.workers.errors import WorkerCallError
from dynarl.workers.slot import SlotConfig

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("launch_and_wait.py")
CONSUMERS = {EdgeId("prompts"): [ComponentId("rollout")]}
LIGHT = LaunchConfig(num_slots=2, slot=SlotConfig(), stop_timeout_s=5.0)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (for ipc sockets)."""
    path = Path(tempfile.mkdtemp(prefix="dyn-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


async def test_shutdown_leaves_no_process(short_tmp: Path) -> None:
    transport = ZmqTransport.bind(f"ipc://{short_tmp}/r.sock")
    try:
        async with (
            Router(transport, consumers=CONSUMERS) as router,
            LocalLauncher(router, LIGHT) as launcher,
        ):
            pids = [slot.pid for slot in launcher.slots]
            assert sorted(router.instances) == ["slot-0", "slot-1"]
            assert all(alive(p) for p in pids)
            stats = await launcher.slots[0].handle.stats()
            assert (stats.state, stats.role, stats.pid) == ("ready", None, pids[0])
            with pytest.raises(WorkerCallError, match="cannot generate while ready"):
                from dynarl.workers.handles import RolloutHandle

                await RolloutHandle(router, InstanceId("slot-0")).generate([])
            with pytest.raises(WorkerCallError, match="cannot release memory while ready"):
                await launcher.slots[1].handle.release_memory()
        assert launcher.slots == []
        assert router.instances == []
    finally:
        await transport.aclose()
    assert wait_gone(pids, 5.0) == []


def test_killing_the_launcher_process_leaves_no_orphan(short_tmp: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, str(SCRIPT), f"ipc://{short_tmp}/r.sock", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        pids: list[int] = json.loads(line)
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        # Within 3 s: the liveness timeout (5 s) would be too late, so the parent watch did it.
        assert wait_gone(pids, 3.0) == [], "a slot outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if launcher.stdout is not None:
            launcher.stdout.close()


async def test_a_slot_that_dies_at_start_is_reported(short_tmp: Path) -> None:
    """A slot whose process exits before hello fails the launch in words."""
    from dynarl.workers.errors import LaunchError

    transport = ZmqTransport.bind(f"ipc://{short_tmp}/r.sock")
    try:
        async with Router(transport, consumers=CONSUMERS) as router:
            bad = LaunchConfig(num_slots=1, slot=SlotConfig(hello_timeout_s=0.5))
            with pytest.raises(LaunchError, match="exited before it connected"):
                async with LocalLauncher(router, bad, endpoint=f"ipc://{short_tmp}/nobody"):
                    pass
    finally:
        await transport.aclose()


def test_handles_and_launcher_import_without_torch() -> None:
    code = (
        "import sys, dynarl.workers.handles, dynarl.workers.main, dynarl.launch.local\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_slot_leaves_ctrl_c_to_the_controller(short_tmp: Path) -> None:
    """A terminal's Ctrl-C reaches every process of the group; the slots ignore it (the
    controller stops them in order), so an interrupted run never has a worker die
    under a collective."""
    transport = ZmqTransport.bind(f"ipc://{short_tmp}/r.sock")
    try:
        async with (
            Router(transport, consumers=CONSUMERS) as router,
            LocalLauncher(router, LIGHT) as launcher,
        ):
            slot = launcher.slots[0]
            os.kill(slot.pid, signal.SIGINT)
            await anyio.sleep(0.5)  # time to die of it, were it not ignored
            stats = await slot.handle.stats()  # still serving
            assert stats.pid == slot.pid and alive(slot.pid)
    finally:
        await transport.aclose()
