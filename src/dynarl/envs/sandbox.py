"""A sandboxed Python runner for code tools: run untrusted code, get back what happened.

``await PythonSandbox(limits).run(code)`` runs ``code`` as ``main.py`` in a fresh
``python -I`` (isolated mode: no user site, ``PYTHON*`` variables ignored) with an
empty environment, in its own temporary directory (removed afterwards) and its own
session, and answers a :class:`SandboxResult`. Whatever the code does (hang, fork,
allocate, flood, open sockets, read ``/etc``) ends as a result with a one-line
``summary`` the model can read; the sandbox raises
:class:`~dynarl.envs.environment.EnvironmentFailure` only when it cannot run at all.

Layers, innermost first:

- **Resource limits.** Before the code is even read, the child's prelude sets
  ``RLIMIT_CPU`` (``cpu_s``; SIGXCPU, then SIGKILL a second later), ``RLIMIT_AS``
  (``memory_bytes``: allocations fail with ``MemoryError``), ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE`` (writes past ``max_file_bytes`` fail with ``File too large``) and
  ``RLIMIT_CORE=0``. They are set by the child's first statements rather than a
  ``preexec_fn``: anyio does not expose one, and a ``preexec_fn`` can deadlock a
  threaded parent. ``RLIMIT_NPROC`` counts all processes of the user and is not
  enforced for root at all; process creation is stopped by the audit hook instead.
- **An audit hook** (``sys.addaudithook``), installed in every mode, refuses with a
  ``PermissionError: sandbox: ...``: creating processes (``os.fork``, ``os.exec*``,
  ``os.posix_spawn``, ``os.system``, ``subprocess``, ``pty``; ``_posixsubprocess``
  is made unreachable), signalling other processes, raising resource limits, network
  sockets (``AF_UNIX`` socket pairs stay allowed, so ``asyncio`` works; no connect,
  bind or send-to), writing outside the sandbox directory, reading outside it and the
  Python installation (``sys.path``; the stdlib imports as usual, ``/dev/null``,
  ``/dev/urandom`` and ``/usr/share/zoneinfo`` are readable too), listing or
  ``chdir`` into other directories, opening directories outside it, path operations
  relative to a ``dir_fd``, importing ``ctypes``, ``cffi`` and sub-interpreters, and
  the ``gc`` walks and attribute writes that would reach the hook's own functions
  (it keeps its state in its closure, so rebinding globals or builtins does not change
  it). A few root powers with no audit event (``pidfd_open``, ``mknod``, ``chroot``,
  the real-time scheduler, ``clock_settime``) are deleted from their modules.
- **bubblewrap** (``isolation="bwrap"``, used by ``"auto"`` when ``bwrap`` is on PATH
  and works): the kernel's boundary. ``--unshare-all`` (network, pid, ipc, uts,
  cgroup and user namespaces: no network device but loopback, no other process in
  sight), ``--die-with-parent``, ``--new-session`` (no terminal injection),
  ``--cap-drop ALL``; the filesystem is a fresh root holding read-only binds of
  ``/usr`` and the Python installation, ``/proc`` of its own pid namespace, a minimal
  ``/dev``, and the temporary directory bound read-write at ``/sandbox`` (its cwd);
  nothing else of the host (no ``/etc``, ``/home``, ``/root``, ``/tmp``) exists.
  Killing bwrap tears down the whole pid namespace. Under bwrap an exit status above
  128 is reported as the signal ``status - 128`` (bwrap's convention).

What the fallback (``"rlimits+audit"``) does **not** protect against: an audit hook is
not a security boundary. Code that reaches interpreter internals (closure cells of the
hook, the ``os`` functions its path checks call, loading an extension module by hand, a
bug in a C extension) can switch it off, and then runs with the caller's rights: as
root, with the network and the host's files. ``os.stat`` and friends raise no audit
event, so the existence and metadata of host files can be probed. Use bwrap for code
you must not trust; the fallback stops honest mistakes and casual escapes.

Neither mode caps total disk use in the sandbox directory (only each file's size), and
bwrap does not count processes: code that got past the hook could fork inside its pid
namespace, as root unbounded by ``RLIMIT_NPROC``, until the timeout kills the
namespace. Run as an unprivileged user (where ``RLIMIT_NPROC`` holds) or in a pids
cgroup to bound that too.

Output: stdout and stderr are drained concurrently while the code runs, so a flood
never blocks it; each keeps its first ``max_output_bytes`` (flagged truncated) and
reads and discards the rest, until a stream passes ``max(4 * max_output_bytes, 1 MiB)``:
then the run is killed as a flood. On a timeout, a flood, a cancellation of
:meth:`PythonSandbox.run`, and after every normal exit, the child's whole process group
is killed with SIGKILL, so no process outlives its run.
"""

import logging
import os
import shutil
import signal
import sys
from typing import Literal

import anyio
import anyio.abc
import msgspec

from dynarl.core.errors import ConfigError
from dynarl.envs import _sandbox_launch as launch
from dynarl.envs._sandbox_child import ChildWatch, kill_group
from dynarl.envs.environment import EnvironmentFailure

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "bwrap", "rlimits"]
"""Which isolation to ask for: ``bwrap`` needs bubblewrap, ``rlimits`` is resource
limits plus the audit hook, ``auto`` uses bwrap when it works and falls back otherwise."""

IsolationUsed = Literal["bwrap", "rlimits+audit"]
"""Which isolation a run actually had."""

_FLOOD_FLOOR_BYTES = 1 << 20


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one run may use.

    Attributes:
        timeout_s: wall-clock limit of a run, the interpreter's start (some 50 ms)
            included; past it the process group is killed.
        cpu_s: CPU seconds (``RLIMIT_CPU``): SIGXCPU at ``cpu_s``, SIGKILL a second later.
        memory_bytes: address space of the process (``RLIMIT_AS``); allocations past it
            raise ``MemoryError``. Python itself needs some 30 MiB, numpy some 100 MiB more.
        max_processes: ``RLIMIT_NPROC``; counts all the user's processes and threads and
            is not enforced for root (the audit hook refuses new processes anyway).
        max_file_bytes: largest file the code may write (``RLIMIT_FSIZE``).
        max_output_bytes: bytes of stdout, and of stderr, kept in the result.
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 16 << 20
    max_output_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for field in msgspec.structs.fields(self):
            value = getattr(self, field.name)
            kind = (int, float) if field.name == "timeout_s" else int
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                what = "number" if field.name == "timeout_s" else "whole number"
                raise ConfigError(
                    f"sandbox.{field.name} must be a positive {what}, got {value!r}",
                    field=f"sandbox.{field.name}",
                )


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one run did.

    Attributes:
        exit_code: the code's exit status; ``None`` when a signal ended it.
        stdout, stderr: the first ``max_output_bytes`` of each, decoded as UTF-8
            (undecodable bytes replaced).
        stdout_truncated, stderr_truncated: the stream wrote more than was kept.
        timed_out: the run passed ``timeout_s`` and was killed.
        killed_by: the signal that ended it (``"SIGKILL"``, ``"SIGXCPU"``...), if any.
        duration_s: wall-clock time of the run.
        summary: one line saying what happened, e.g. ``"exited with code 0"``,
            ``"timed out after 2.0 s"``, ``"exited with code 1: memory limit
            exceeded (MemoryError)"``, ``"...; stdout truncated at 65536 bytes"``.
        isolation: ``"bwrap"`` or ``"rlimits+audit"``.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    killed_by: str | None
    duration_s: float
    summary: str
    isolation: IsolationUsed

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out

    def transcript(self, max_chars: int = 8000) -> str:
        """The summary, then stdout and stderr (each under a header, omitted when
        empty), cut to ``max_chars`` in all: what a code tool shows the model."""
        parts = [self.summary]
        for name, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                parts.append(f"--- {name} ---\n{text.rstrip()}")
        out = "\n".join(parts)
        if len(out) > max_chars:
            out = out[:max_chars] + f"\n[... cut at {max_chars} characters]"
        return out


class PythonSandbox:
    """Runs Python code in a sandbox, one fresh process and directory per run.

    Args:
        limits: what each run may use.
        isolation: ``"auto"`` (bwrap when it works, else ``"rlimits"``, logged once),
            ``"bwrap"`` (refused if bubblewrap is not on PATH) or ``"rlimits"``.
        python: the interpreter to run (default: the one running dynarl). Its
            installation is bound read-only into a bwrap sandbox.

    Runs are independent: one sandbox may run many codes at once. The first run checks
    the interpreter (and bwrap), once per sandbox.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: Isolation = "auto",
        python: str | None = None,
    ) -> None:
        if isolation not in ("auto", "bwrap", "rlimits"):
            raise ConfigError(
                f"unknown sandbox isolation {isolation!r}; use 'auto', 'bwrap' or 'rlimits'",
                field="sandbox.isolation",
            )
        self._bwrap = shutil.which("bwrap") if isolation != "rlimits" else None
        if isolation == "bwrap" and self._bwrap is None:
            raise ConfigError(
                "isolation='bwrap' needs bubblewrap on PATH (apt-get install bubblewrap); "
                "or use isolation='auto' to fall back to rlimits and an audit hook",
                field="sandbox.isolation",
            )
        self.limits = limits or SandboxLimits()
        self._isolation: Isolation = isolation
        self._python = python or sys.executable
        self._dirs: tuple[str, ...] | None = None
        self._used: IsolationUsed | None = None
        self._prelude: str | None = None

    @property
    def isolation(self) -> IsolationUsed | None:
        """The isolation runs get (``None`` until the first run or :meth:`prepare`)."""
        return self._used

    async def prepare(self) -> IsolationUsed:
        """Check the interpreter and bwrap now (the first run does it otherwise); the
        isolation runs will get. Raises EnvironmentFailure if Python cannot run."""
        if self._used is None:
            if self._dirs is None:
                self._dirs = await launch.python_dirs(self._python)
            used: IsolationUsed = "rlimits+audit"
            if self._bwrap is None and self._isolation == "auto":
                logger.warning(
                    "bwrap is not on PATH; code runs with rlimits and an audit hook only, "
                    "which is no security boundary (apt-get install bubblewrap)"
                )
            if self._bwrap is not None:
                failure = await launch.bwrap_failure(self._bwrap, self._dirs, self._python)
                if failure is None:
                    used = "bwrap"
                elif self._isolation == "bwrap":
                    raise EnvironmentFailure(
                        f"bubblewrap cannot start a sandbox here: {failure}; fix bwrap "
                        "(user namespaces must be allowed) or use isolation='auto'"
                    )
                else:
                    logger.warning(
                        "bwrap cannot start a sandbox (%s); code runs with rlimits and an "
                        "audit hook only, which is no security boundary",
                        failure,
                    )
            self._used = used
        return self._used

    async def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        """Run ``code`` (as ``main.py``) with ``stdin`` on its standard input.

        Never raises for what the code does; raises EnvironmentFailure when the sandbox
        itself cannot run (no interpreter, no temporary directory, bwrap failing)."""
        isolation = await self.prepare()
        workdir = launch.make_workdir("dynarl-sandbox-")
        try:
            launch.write_code(os.path.join(workdir, "main.py"), code)
            return await self._run_in(workdir, isolation, stdin)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(launch.remove_tree, workdir)

    async def _run_in(self, workdir: str, isolation: IsolationUsed, stdin: str) -> SandboxResult:
        read_fd, write_fd = os.pipe()
        try:
            argv = self._argv(isolation, workdir, write_fd)
            try:
                process = await anyio.open_process(
                    argv, cwd=workdir, env={}, start_new_session=True, pass_fds=(write_fd,)
                )
            except OSError as exc:
                raise EnvironmentFailure(
                    f"cannot start the sandbox ({argv[0]}): {exc}; check that it is installed"
                ) from exc
            finally:
                os.close(write_fd)
            limits = self.limits
            watch = ChildWatch(
                process,
                timeout_s=limits.timeout_s,
                max_output_bytes=limits.max_output_bytes,
                flood_bytes=_flood_bytes(limits),
            )
            start = anyio.current_time()
            try:
                await watch.play(stdin.encode("utf-8", errors="replace"))
            finally:
                kill_group(process.pid)  # also after an exit: no process outlives its run
                with anyio.CancelScope(shield=True):
                    await process.aclose()
            duration_s = anyio.current_time() - start
            if not _started(read_fd):
                raise EnvironmentFailure(
                    f"the sandbox ({isolation}) failed before running the code, exit status "
                    f"{process.returncode}: {watch.stderr.tail_text()[-800:]!r}; check the "
                    "interpreter and the limits (memory_bytes, timeout_s)"
                )
        finally:
            os.close(read_fd)
        assert process.returncode is not None
        return _result(watch, process.returncode, self.limits, isolation, duration_s)

    def _argv(self, isolation: IsolationUsed, workdir: str, status_fd: int) -> list[str]:
        limits = self.limits
        if self._prelude is None:
            self._prelude = launch.read_prelude()
        limit_args = [str(status_fd), str(limits.cpu_s), str(limits.memory_bytes)]
        limit_args += [str(limits.max_processes), str(limits.max_file_bytes)]
        python = launch.python_argv(self._python, self._prelude, limit_args)
        if isolation == "rlimits+audit":
            return python
        assert self._bwrap is not None and self._dirs is not None
        return launch.bwrap_argv(self._bwrap, self._dirs, workdir) + python


def _result(
    watch: ChildWatch,
    returncode: int,
    limits: SandboxLimits,
    isolation: IsolationUsed,
    duration_s: float,
) -> SandboxResult:
    """The result of a child that ended with exit status ``returncode``."""
    exit_code: int | None = returncode
    killed_by = None
    signal_number = -returncode if returncode < 0 else 0
    if isolation == "bwrap" and returncode > 128:
        signal_number = returncode - 128
    if signal_number in signal.valid_signals():
        killed_by = signal.Signals(signal_number).name
        exit_code = None
    return SandboxResult(
        exit_code=exit_code,
        stdout=watch.stdout.text(),
        stderr=watch.stderr.text(),
        stdout_truncated=watch.stdout.truncated,
        stderr_truncated=watch.stderr.truncated,
        timed_out=watch.timed_out,
        killed_by=killed_by,
        duration_s=duration_s,
        summary=_summary(watch, exit_code, killed_by, limits),
        isolation=isolation,
    )


def _summary(
    watch: ChildWatch, exit_code: int | None, killed_by: str | None, limits: SandboxLimits
) -> str:
    """One line saying what happened, then which output was truncated."""
    cause = _cause(watch.stderr.tail_text(), limits)
    if watch.timed_out:
        what = f"timed out after {float(limits.timeout_s)} s"
    elif watch.flooded is not None:
        what = f"killed: output flood ({watch.flooded} passed {_flood_bytes(limits)} bytes)"
    elif killed_by == "SIGXCPU":
        what = f"CPU time limit exceeded ({limits.cpu_s} s of CPU)"
    elif killed_by == "SIGXFSZ":
        what = f"file size limit exceeded ({limits.max_file_bytes} bytes)"
    elif killed_by is not None:
        what = f"killed by {killed_by}" + (f": {cause}" if cause else "")
    else:
        what = f"exited with code {exit_code}" + (f": {cause}" if cause and exit_code else "")
    for name, capture in (("stdout", watch.stdout), ("stderr", watch.stderr)):
        if capture.truncated:
            what += f"; {name} truncated at {capture.limit} bytes"
    return what


def _flood_bytes(limits: SandboxLimits) -> int:
    return max(4 * limits.max_output_bytes, _FLOOD_FLOOR_BYTES)


def _cause(stderr_tail: str, limits: SandboxLimits) -> str | None:
    """Why the code failed, read from the end of its stderr, when it is a limit or a
    refusal of the sandbox's."""
    lines = [line for line in stderr_tail.splitlines() if line.strip()][-4:]
    if any("MemoryError" in line or "Cannot allocate memory" in line for line in lines):
        return f"memory limit exceeded (MemoryError, limit {limits.memory_bytes} bytes)"
    last = lines[-1] if lines else ""
    if "File too large" in last:
        return f"file size limit exceeded ({limits.max_file_bytes} bytes)"
    marker = "PermissionError: sandbox: "
    if last.startswith(marker):
        return f"refused by the sandbox: {last[len(marker) :]}"
    return None


def _started(status_fd: int) -> bool:
    """The child's prelude reported that it is about to run the code."""
    os.set_blocking(status_fd, False)
    try:
        return os.read(status_fd, 1) == b"R"
    except BlockingIOError:
        return False
