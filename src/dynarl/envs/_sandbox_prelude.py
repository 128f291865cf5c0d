"""The sandboxed child's first code: limits, an audit hook, then the user's ``main.py``.

:mod:`dynarl.envs.sandbox` runs this file's source with ``python -I -c`` in the sandbox
directory, with argv ``status_fd cpu_s memory_bytes max_processes max_file_bytes``. It
is not imported by dynarl: it only uses the stdlib, and runs only as ``__main__``.

Order matters: resource limits first, then everything the hook will refuse later
(``subprocess`` imported while ``_posixsubprocess`` may still load), then the hook, then
one byte ``R`` on ``status_fd`` (the parent's proof that the sandbox itself worked: what
fails after it is the code's doing), then the code in a fresh ``__main__`` namespace.
See :mod:`dynarl.envs.sandbox` for what the hook refuses and what it cannot.
"""

import os
import sys
from collections.abc import Callable
from types import MappingProxyType, TracebackType
from typing import Any

_REFUSED_MODULES = frozenset(
    {
        "ctypes",
        "_ctypes",
        "cffi",
        "_cffi_backend",
        "_posixsubprocess",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_interpreters",
        "_testcapi",
        "_testinternalcapi",
    }
)
_PROCESS_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.posix_spawnp",
        "os.spawn",
        "os.system",
        "os.startfile",
        "subprocess.Popen",
        "pty.spawn",
    }
)
# Path-changing events: the indices of their path arguments (all must lie in the sandbox
# directory) and of their dir_fd arguments (refused when set: the hook cannot see where
# a descriptor points). A symlink's target is checked apart.
_WRITE_EVENTS = MappingProxyType(
    {
        "os.chmod": ((0,), (2,)),
        "os.chown": ((0,), (3,)),
        "os.link": ((0, 1), (2, 3)),
        "os.mkdir": ((0,), (2,)),
        "os.remove": ((0,), (1,)),
        "os.rename": ((0, 1), (2, 3)),
        "os.rmdir": ((0,), (1,)),
        "os.symlink": ((1,), (2,)),
        "os.truncate": ((0,), ()),
        "os.utime": ((0,), (3,)),
        "os.setxattr": ((0,), ()),
        "os.removexattr": ((0,), ()),
        "shutil.rmtree": ((0,), (1,)),
    }
)
_LIST_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "os.listxattr", "os.getxattr"})
_INTROSPECTION_EVENTS = frozenset({"gc.get_referrers", "gc.get_referents", "gc.get_objects"})
_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"})
# Root powers with no audit event: taken away from the modules that offer them.
_ROOT_POWERS = ("pidfd_open", "mknod", "chroot", "sched_setscheduler", "sched_setparam", "nice")
_DELETED = (
    ("os", _ROOT_POWERS),
    ("posix", _ROOT_POWERS),
    ("signal", ("pidfd_send_signal",)),
    ("time", ("clock_settime", "clock_settime_ns")),
)


def _set_limits(cpu_s: int, memory_bytes: int, max_processes: int, max_file_bytes: int) -> None:
    import resource

    wanted = (
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_NPROC, max_processes, max_processes),
        (resource.RLIMIT_FSIZE, max_file_bytes, max_file_bytes),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, wanted_hard in wanted:
        current_hard = resource.getrlimit(which)[1]
        hard = (
            wanted_hard
            if current_hard == resource.RLIM_INFINITY
            else min(wanted_hard, current_hard)
        )
        resource.setrlimit(which, (min(soft, hard), hard))


def _disarm() -> None:
    """Take process creation and eventless root powers away before the hook goes in."""
    import subprocess

    def refuse_fork_exec(*args: object) -> Any:
        raise PermissionError("sandbox: creating processes is not allowed (subprocess)")

    subprocess._fork_exec = refuse_fork_exec  # type: ignore[attr-defined]
    sys.modules.pop("_posixsubprocess", None)
    for module_name, names in _DELETED:
        module = __import__(module_name)
        for name in names:
            if hasattr(module, name):
                delattr(module, name)


def _make_hook(home: str, read_roots: tuple[str, ...]) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook. Everything it uses is bound here, in its closure, so that code
    rebinding this module's globals or the builtins does not change what it checks."""
    import socket

    af_unix = socket.AF_UNIX
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    realpath, join, dirname, isabs = os.path.realpath, os.path.join, os.path.dirname, os.path.isabs
    fspath, isdir, getpid = os.fspath, os.path.isdir, os.getpid
    is_a, any_of, denied = isinstance, any, PermissionError
    refused_modules, process_events, list_events = _REFUSED_MODULES, _PROCESS_EVENTS, _LIST_EVENTS
    write_events, introspection, devices = dict(_WRITE_EVENTS), _INTROSPECTION_EVENTS, _DEVICES
    homes, readable = (home,), (home, *read_roots)

    def refuse(what: str) -> None:
        raise denied(f"sandbox: {what}")

    def inside(path: str, roots: tuple[str, ...]) -> bool:
        return any_of(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    def resolve(path: Any) -> str | None:
        if path is None:
            return realpath(".")
        if is_a(path, int):
            return None  # an open descriptor: it was checked when it was opened
        raw = fspath(path)
        text: str = raw.decode(errors="surrogateescape") if is_a(raw, bytes) else raw
        return realpath(text)

    def check_open(path: Any, mode: Any, flags: Any) -> None:
        real = resolve(path)
        if real is None or inside(real, homes) or real in devices:
            return
        writing = is_a(mode, str) and any_of(c in mode for c in "wax+")
        if writing or (is_a(flags, int) and flags & write_flags):
            refuse(f"writing {real!r} is not allowed: only the sandbox directory is writable")
        if not inside(real, readable):
            refuse(f"reading {real!r} is not allowed: it is outside the sandbox directory")
        if isdir(real):
            refuse(f"opening the directory {real!r} is not allowed")

    def check_write(event: str, args: tuple[Any, ...]) -> None:
        path_indices, dir_fd_indices = write_events[event]
        if any_of(is_a(args[i], int) and args[i] >= 0 for i in dir_fd_indices):
            refuse(f"{event} relative to a directory descriptor is not allowed")
        for index in path_indices:
            real = resolve(args[index])
            if real is not None and not inside(real, homes):
                refuse(f"{event} of {real!r} is not allowed: only the sandbox directory")
        if event == "os.symlink":
            target = fspath(args[0])
            target = target.decode(errors="surrogateescape") if is_a(target, bytes) else target
            link = fspath(args[1])
            link = link.decode(errors="surrogateescape") if is_a(link, bytes) else link
            real = realpath(target if isabs(target) else join(dirname(realpath(link)), target))
            if not inside(real, homes):
                refuse(f"a symlink to {real!r} is not allowed: it is outside the sandbox")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            check_open(*args[:3])
        elif event in list_events:
            real = resolve(args[0])
            if real is not None and not inside(real, readable):
                refuse(f"{event} of {real!r} is not allowed: it is outside the sandbox directory")
        elif event in write_events:
            check_write(event, args)
        elif event.startswith("socket."):
            if event == "socket.__new__" and args[1] == af_unix:
                return  # socket pairs, for asyncio; connecting anywhere is refused below
            refuse(f"network access is not allowed ({event})")
        elif event == "import":
            if args[0].partition(".")[0] in refused_modules:
                refuse(f"importing {args[0]} is not allowed")
        elif event in process_events:
            refuse(f"creating processes is not allowed ({event})")
        elif event in ("os.kill", "os.killpg"):
            if event == "os.kill" and args[0] == getpid():
                return
            refuse(f"signalling other processes is not allowed ({event})")
        elif event in ("resource.setrlimit", "resource.prlimit"):
            refuse(f"changing resource limits is not allowed ({event})")
        elif event in introspection:
            refuse(f"{event} is not allowed")
        elif event == "object.__setattr__" and any_of(args[0] is f for f in own):
            refuse("changing the sandbox's audit hook is not allowed")

    own = (hook, refuse, inside, resolve, check_open, check_write)
    return hook


def _run_main(source: str) -> None:
    """Run ``source`` as ``main.py`` in a fresh ``__main__`` namespace; an uncaught
    exception prints its traceback (without this prelude's frames) and exits 1."""
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        sys.excepthook(type(exc), exc, _user_frames(exc))
        sys.exit(1)


def _user_frames(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback without this prelude's frames (the outer ``_run_main`` and
    the hook's own, innermost): the traceback of ``main.py``."""
    prelude = globals()
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals is prelude:
        tb = tb.tb_next
    last_user, walk = None, tb
    while walk is not None:
        if walk.tb_frame.f_globals is not prelude:
            last_user = walk
        walk = walk.tb_next
    if last_user is not None:
        last_user.tb_next = None
    exc.__traceback__ = tb
    return tb


def _main() -> None:
    status_fd, cpu_s, memory_bytes, max_processes, max_file_bytes = map(int, sys.argv[1:6])
    _set_limits(cpu_s, memory_bytes, max_processes, max_file_bytes)
    os.environ.clear()  # the interpreter's locale coercion and bwrap's PWD
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    _disarm()
    home = os.path.realpath(os.getcwd())
    read_roots = {os.path.realpath(p) for p in sys.path if p} | {"/usr/share/zoneinfo"}
    sys.addaudithook(_make_hook(home, tuple(sorted(read_roots))))
    os.write(status_fd, b"R")
    os.close(status_fd)
    _run_main(source)


if __name__ == "__main__":
    _main()
