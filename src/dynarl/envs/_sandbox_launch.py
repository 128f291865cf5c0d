"""Starting a sandbox run's child: its command line under each isolation, the checks
that the interpreter and bubblewrap work here, and the run's temporary directory.

Used by :mod:`dynarl.envs.sandbox`, whose docstring says what each isolation gives.
"""

import os
import shutil
import subprocess
import tempfile

import anyio
import anyio.to_thread

from dynarl.envs.environment import EnvironmentFailure

SANDBOX_DIR = "/sandbox"
"""Where the run's directory appears inside bwrap (and its working directory)."""

PRELUDE_PATH = os.path.join(os.path.dirname(__file__), "_sandbox_prelude.py")
"""The child's first code, passed to ``python -c``."""

_PROBE_TIMEOUT_S = 60.0
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def read_prelude() -> str:
    """The prelude's source."""
    try:
        with open(PRELUDE_PATH, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise EnvironmentFailure(
            f"cannot read the sandbox prelude {PRELUDE_PATH}: {exc}; reinstall dynarl"
        ) from exc


def python_argv(python: str, prelude: str, limit_args: list[str]) -> list[str]:
    """``python`` isolated (``-I``: no user site, ``PYTHON*`` ignored), writing no
    bytecode, unbuffered (output printed before a kill is kept), in UTF-8 mode, running
    the prelude with its arguments."""
    return [python, "-I", "-B", "-u", "-X", "utf8", "-c", prelude, *limit_args]


def bwrap_argv(bwrap: str, python_dirs: tuple[str, ...], workdir: str) -> list[str]:
    """The bwrap command line that runs a command in ``workdir`` (at ``/sandbox``): all
    namespaces unshared, capabilities dropped, killed with its parent, in a new session,
    on a fresh root holding ``/usr``, the interpreter's directories (read-only), its own
    ``/proc`` and a minimal ``/dev``."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for top in _TOP_DIRS:  # merged-/usr systems link these into /usr; older ones bind them
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    bound = ["/usr"]
    for path in python_dirs:  # sorted: a directory comes before those inside it
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
            argv += ["--ro-bind", path, path]
            bound.append(path)
    argv += ["--bind", workdir, SANDBOX_DIR, "--chdir", SANDBOX_DIR]
    return argv


async def python_dirs(python: str) -> tuple[str, ...]:
    """The installation directories of ``python`` (its prefixes and its executable's
    directory, with where symlinks lead), sorted; raises EnvironmentFailure if it does
    not start."""
    script = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sep=chr(10))"
    result = await _probe([python, "-I", "-c", script], what="the sandbox's Python")
    if result.returncode != 0:
        raise EnvironmentFailure(
            f"the sandbox's Python {python!r} does not start (exit status "
            f"{result.returncode}): {result.stderr[-500:]!r}; pass python=... a working "
            "interpreter"
        )
    return _with_targets(result.stdout.decode(), python)


async def bwrap_failure(bwrap: str, dirs: tuple[str, ...], python: str) -> str | None:
    """Why bwrap cannot run ``python`` here, or ``None`` when it can."""
    workdir = make_workdir("dynarl-sandbox-probe-")
    try:
        argv = [*bwrap_argv(bwrap, dirs, workdir), python, "-I", "-c", "pass"]
        result = await _probe(argv, what="bwrap", cwd=workdir)
    finally:
        await anyio.to_thread.run_sync(remove_tree, workdir)
    if result.returncode == 0:
        return None
    return f"exit status {result.returncode}: {result.stderr.decode(errors='replace')[-300:]}"


def make_workdir(prefix: str) -> str:
    """A fresh temporary directory (EnvironmentFailure if none can be made)."""
    try:
        return tempfile.mkdtemp(prefix=prefix)
    except OSError as exc:
        raise EnvironmentFailure(
            f"cannot create the sandbox's temporary directory: {exc}; free disk space "
            "or point TMPDIR at a writable directory"
        ) from exc


def write_code(path: str, code: str) -> None:
    """Write the code to run (EnvironmentFailure if it cannot be written)."""
    try:
        with open(path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
    except OSError as exc:
        raise EnvironmentFailure(
            f"cannot write the code into the sandbox directory: {exc}; free disk space"
        ) from exc


def remove_tree(path: str) -> None:
    """Remove a run's directory, also when the code took its permissions away."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            child = os.path.join(root, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)


async def _probe(
    argv: list[str], *, what: str, cwd: str | None = None
) -> "subprocess.CompletedProcess[bytes]":
    """Run a check to its end, its output collected."""
    try:
        with anyio.fail_after(_PROBE_TIMEOUT_S):
            return await anyio.run_process(argv, check=False, env={}, cwd=cwd)
    except OSError as exc:
        raise EnvironmentFailure(
            f"cannot start {what} ({argv[0]}): {exc}; check that it is installed"
        ) from exc
    except TimeoutError as exc:
        raise EnvironmentFailure(
            f"{what} ({argv[0]}) did not answer in {_PROBE_TIMEOUT_S} s; the machine is "
            "overloaded or the interpreter hangs at start"
        ) from exc


def _with_targets(prefixes_text: str, python: str) -> tuple[str, ...]:
    prefixes = [p for p in prefixes_text.splitlines() if p]
    prefixes.append(os.path.dirname(os.path.realpath(python)))
    return tuple(sorted({*prefixes, *map(os.path.realpath, prefixes)}))
