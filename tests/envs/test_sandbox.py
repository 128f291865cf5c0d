"""The Python sandbox: whatever the code does, the run ends with a clear result, leaves
no process or directory behind, and the next run still works. Every case runs under
each isolation available here (bwrap only where bubblewrap works)."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from dynarl.core.errors import ConfigError
from dynarl.envs import _sandbox_prelude
from dynarl.envs.environment import EnvironmentFailure
from dynarl.envs.sandbox import Isolation, PythonSandbox, SandboxLimits, SandboxResult

LIMITS = SandboxLimits(
    timeout_s=10.0,  # well above a loaded machine's start-up: only the hasty ones time out
    cpu_s=10,
    memory_bytes=256 << 20,
    max_file_bytes=1 << 20,
    max_output_bytes=4096,
)


def _bwrap_works() -> bool:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


BWRAP = _bwrap_works()
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bubblewrap is not installed or cannot run")
MODES = ["rlimits", pytest.param("bwrap", marks=needs_bwrap)]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Isolation:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def sandbox(mode: Isolation) -> Iterator[PythonSandbox]:
    yield PythonSandbox(LIMITS, isolation=mode)
    assert _sandbox_processes() == [], "a sandboxed process outlived its run"


@pytest.fixture
def hasty(mode: Isolation) -> Iterator[PythonSandbox]:
    """A sandbox whose runs time out after 1 s (for the tests of the timeout)."""
    yield PythonSandbox(msgspec.structs.replace(LIMITS, timeout_s=1.0), isolation=mode)
    assert _sandbox_processes() == [], "a sandboxed process outlived its run"


async def _no_sandbox_processes_left(grace_s: float = 2.0) -> bool:
    """Whether every sandbox process is gone, allowing the kernel ``grace_s`` to tear
    down a killed bwrap's pid namespace (its members die after bwrap itself)."""
    with anyio.move_on_after(grace_s):
        while _sandbox_processes():  # noqa: ASYNC110 (no event announces an exit)
            await anyio.sleep(0.02)
    return not _sandbox_processes()


def _sandbox_processes() -> list[int]:
    """Live processes running the sandbox's prelude (its source is on their command
    line; forked children share it)."""
    marker = Path(_sandbox_prelude.__file__).read_bytes()[:60]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def _assert_still_works(sandbox: PythonSandbox) -> None:
    result = await sandbox.run("print(6 * 7)")
    assert result.ok and result.stdout == "42\n", result.summary


async def test_normal_code_reports_its_output_and_exit_code(
    sandbox: PythonSandbox, mode: Isolation
) -> None:
    code = "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)"
    result = await sandbox.run(code)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.timed_out and result.killed_by is None and not result.ok
    assert result.summary == "exited with code 3"
    assert result.isolation == ("bwrap" if mode == "bwrap" else "rlimits+audit")
    ok = await sandbox.run("print(input()[::-1])", stdin="abc\n")
    assert ok.ok and ok.stdout == "cba\n" and ok.summary == "exited with code 0"


async def test_an_uncaught_exception_shows_the_codes_own_traceback(sandbox: PythonSandbox) -> None:
    result = await sandbox.run("def f():\n    return 1 / 0\nf()")
    assert result.exit_code == 1
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "main.py"')
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.stderr  # the sandbox's own frames are left out
    syntax = await sandbox.run("def f(:\n    pass")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


async def test_an_infinite_loop_times_out_and_its_group_is_killed(hasty: PythonSandbox) -> None:
    result = await hasty.run("print('started', flush=True)\nwhile True: pass")
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.summary == "timed out after 1.0 s"
    assert result.stdout == "started\n"  # what it printed before it hung is kept
    assert 1.0 <= result.duration_s < 3.0
    await _assert_still_works(hasty)


async def test_code_that_closes_its_output_and_hangs_still_times_out(
    hasty: PythonSandbox,
) -> None:
    result = await hasty.run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)")
    assert result.timed_out and result.summary == "timed out after 1.0 s"


async def test_a_fork_bomb_ends_clearly_and_leaves_no_process(sandbox: PythonSandbox) -> None:
    result = await sandbox.run("import os\nwhile True: os.fork()")
    assert result.exit_code == 1 and not result.timed_out
    assert "refused by the sandbox: creating processes is not allowed" in result.summary
    assert await _no_sandbox_processes_left()
    spawn = await sandbox.run("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])")
    assert "creating processes is not allowed" in spawn.summary and "hi" not in spawn.stdout
    await _assert_still_works(sandbox)


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**10)", "x = []\nwhile True: x.append(' ' * 10**6)"],
    ids=["one-big-allocation", "growing-list"],
)
async def test_a_memory_hog_hits_the_memory_limit(
    sandbox: PythonSandbox, mode: Isolation, code: str
) -> None:
    # The limit under test is memory, not time: filling 256 MiB can take over the
    # sandbox's 1 s on a loaded machine.
    patient = PythonSandbox(msgspec.structs.replace(LIMITS, timeout_s=30.0), isolation=mode)
    result = await patient.run(code)
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert "memory limit exceeded" in result.summary
    await _assert_still_works(sandbox)


async def test_an_output_flood_is_capped_and_killed(
    sandbox: PythonSandbox, mode: Isolation
) -> None:
    patient = PythonSandbox(msgspec.structs.replace(LIMITS, timeout_s=30.0), isolation=mode)
    result = await patient.run("while True: print('x' * 1000)")
    assert result.stdout_truncated and not result.stderr_truncated
    assert len(result.stdout.encode()) == LIMITS.max_output_bytes
    assert result.killed_by == "SIGKILL" and not result.timed_out
    assert result.summary.startswith("killed: output flood (stdout passed 1048576 bytes)")
    assert result.summary.endswith("stdout truncated at 4096 bytes")
    assert result.duration_s < 10.0  # killed at the flood, long before its timeout
    some = await sandbox.run("print('y' * 5000)")  # over the cap, under a flood: runs to its end
    assert some.ok and some.stdout_truncated and "stdout truncated at 4096 bytes" in some.summary
    await _assert_still_works(sandbox)


@pytest.mark.parametrize(
    "code",
    [
        "print(open('/etc/passwd').read())",
        "import os\nprint(os.listdir('..'))",
        "open('/tmp/dynarl-sandbox-escape', 'w').write('x')",
        "import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())",
        "import os\nos.chdir('/')\nprint(open('etc/passwd').read())",
    ],
    ids=["read-etc", "list-parent", "write-tmp", "symlink-out", "chdir-out"],
)
async def test_files_outside_its_directory_are_refused(sandbox: PythonSandbox, code: str) -> None:
    result = await sandbox.run(code)
    assert result.exit_code == 1 and "root:" not in result.stdout
    assert "PermissionError: sandbox:" in result.stderr
    assert result.summary.startswith("exited with code 1: refused by the sandbox:")
    assert not await anyio.Path("/tmp/dynarl-sandbox-escape").exists()
    await _assert_still_works(sandbox)


async def test_its_own_directory_and_the_stdlib_work(sandbox: PythonSandbox) -> None:
    code = (
        "import json, os, pathlib, tempfile, asyncio, subprocess, random, zoneinfo\n"
        "os.makedirs('a/b')\n"
        "pathlib.Path('a/b/f.json').write_text(json.dumps([1, 2]))\n"
        "print(json.loads(open('a/b/f.json').read()), sorted(os.listdir('.')))\n"
        "asyncio.run(asyncio.sleep(0))\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    print(os.path.isdir(d))\n"
    )
    result = await sandbox.run(code)
    assert result.ok, result.stderr
    assert result.stdout == "[1, 2] ['a', 'main.py']\nTrue\n"


async def test_no_connection_reaches_a_listening_socket(sandbox: PythonSandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))\nprint('connected')"
        result = await sandbox.run(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.exit_code == 1 and "connected" not in result.stdout
    assert "refused by the sandbox: network access is not allowed" in result.summary
    await _assert_still_works(sandbox)


async def test_a_big_file_hits_the_file_size_limit(sandbox: PythonSandbox) -> None:
    result = await sandbox.run("open('big', 'wb').write(b'x' * (4 << 20))")
    assert result.exit_code == 1 and "File too large" in result.stderr
    assert result.summary == "exited with code 1: file size limit exceeded (1048576 bytes)"
    await _assert_still_works(sandbox)


async def test_cpu_time_is_limited(mode: Isolation) -> None:
    limited = PythonSandbox(SandboxLimits(timeout_s=5.0, cpu_s=1), isolation=mode)
    result = await limited.run("while True: pass")
    assert result.killed_by == "SIGXCPU" and not result.timed_out
    assert result.summary == "CPU time limit exceeded (1 s of CPU)"


async def test_the_environment_is_empty(sandbox: PythonSandbox) -> None:
    result = await sandbox.run("import os\nprint(dict(os.environ))")
    assert result.ok and result.stdout == "{}\n"


async def test_the_sandbox_directory_is_removed_afterwards(sandbox: PythonSandbox) -> None:
    pattern = os.path.join(tempfile.gettempdir(), "dynarl-sandbox-*")
    before = set(glob.glob(pattern))
    code = "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d', 0)"
    result = await sandbox.run(code)
    assert result.ok, result.stderr
    assert set(glob.glob(pattern)) <= before


async def test_many_runs_at_once_all_complete(sandbox: PythonSandbox) -> None:
    results: dict[int, SandboxResult] = {}

    async def one(i: int) -> None:
        results[i] = await sandbox.run(f"print({i} * {i})")

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n" for i in range(8)}
    assert all(r.ok for r in results.values())


async def test_a_cancelled_run_kills_its_process_and_removes_its_directory(
    mode: Isolation,
) -> None:
    pattern = os.path.join(tempfile.gettempdir(), "dynarl-sandbox-*")
    before = set(glob.glob(pattern))
    patient = PythonSandbox(SandboxLimits(timeout_s=60.0), isolation=mode)
    with anyio.move_on_after(0.5):
        await patient.run("while True: pass")
    assert await _no_sandbox_processes_left()
    assert set(glob.glob(pattern)) <= before


@needs_bwrap
async def test_under_bwrap_the_host_filesystem_does_not_exist(tmp_path: Path) -> None:
    sandbox = PythonSandbox(LIMITS, isolation="bwrap")
    host_file = tmp_path / "host-secret"  # beside the test, not the Python installation
    host_file.write_text("secret")
    paths = ("/etc/passwd", "/home", str(host_file), "/var")
    code = f"import os\nprint(os.getcwd(), [os.path.exists(p) for p in {paths}])"
    result = await sandbox.run(code)
    assert (
        result.isolation == "bwrap" and result.stdout == "/sandbox [False, False, False, False]\n"
    )


async def test_auto_uses_bwrap_where_it_works() -> None:
    assert await PythonSandbox(isolation="auto").prepare() == (
        "bwrap" if BWRAP else "rlimits+audit"
    )
    assert await PythonSandbox(isolation="rlimits").prepare() == "rlimits+audit"


async def test_a_missing_interpreter_is_an_environment_failure() -> None:
    sandbox = PythonSandbox(LIMITS, isolation="rlimits", python="/nonexistent/python3")
    with pytest.raises(EnvironmentFailure, match="python3"):
        await sandbox.run("print(1)")


async def test_limits_too_small_for_python_to_start_are_an_environment_failure() -> None:
    sandbox = PythonSandbox(SandboxLimits(memory_bytes=1 << 20), isolation="rlimits")
    with pytest.raises(EnvironmentFailure, match="before running the code"):
        await sandbox.run("print(1)")


def test_bad_configuration_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"sandbox\.timeout_s must be a positive number"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ConfigError, match=r"sandbox\.cpu_s must be a positive whole number"):
        SandboxLimits(cpu_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'auto', 'bwrap' or 'rlimits'"):
        PythonSandbox(isolation="docker")  # type: ignore[arg-type]
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="apt-get install bubblewrap"):
        PythonSandbox(isolation="bwrap")


def test_the_transcript_shows_the_summary_and_both_streams() -> None:
    result = SandboxResult(
        exit_code=1,
        stdout="out\n",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        timed_out=False,
        killed_by=None,
        duration_s=0.1,
        summary="exited with code 1",
        isolation="rlimits+audit",
    )
    assert result.transcript() == "exited with code 1\n--- stdout ---\nout"
    assert result.transcript(max_chars=10).startswith("exited wit\n[... cut at 10 characters]")
