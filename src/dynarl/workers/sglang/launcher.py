"""Starting and stopping one SGLang server process (``python -m
sglang.launch_server``), synchronously: an engine launches its server while it is
built, in its slot's worker thread, and stops it when it closes.

The server runs in a process group of its own (it forks a scheduler and a
detokenizer per rank), so stopping it signals the whole group: SIGTERM, then SIGKILL
after a grace period. It runs under a tether (:mod:`dynarl.workers.sglang.tether`,
the group's leader) that kills the group should the launching process die without
stopping it. Its output goes to a log file next to nothing else, named in
every error.
"""

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx

from dynarl.data.request_order import OrderName
from dynarl.workers.config import RolloutConfig
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.errors import LaunchFailedError

logger = logging.getLogger(__name__)


def server_command(
    config: SGLangConfig,
    *,
    model_path: str,
    rollout: RolloutConfig,
    context_length: int,
    dtype: str,
    seed: int,
    port: int,
    tp: int,
    kv_tokens: int,
    order: OrderName = "fifo",
) -> list[str]:
    """The command line of one server: ``config.launch_command`` and SGLang's flags
    for the model, its tensor-parallel size ``tp`` (its engine's devices), the
    engine's limits (``rollout.max_running_requests``; ``--max-total-tokens``: its
    ``kv_tokens``, ``RolloutRole.kv_capacity_tokens``), the run's seed, and
    the memory saver, CPU weight backup, priority scheduling and metrics (the step
    counters :mod:`~dynarl.workers.sglang.step_metrics` reads) dynarl relies on;
    with the ``priority`` request order, SGLang's ``lpm`` schedule policy (longest
    cached prefix first among equal priorities)."""
    command = list(config.launch_command)
    if command[0] == "python":
        command[0] = sys.executable
    command += [
        "--model-path",
        model_path,
        "--host",
        config.host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--context-length",
        str(context_length),
        "--dtype",
        dtype,
        "--random-seed",
        str(seed),
        "--max-running-requests",
        str(rollout.max_running_requests),
        "--max-total-tokens",
        str(kv_tokens),
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-priority-scheduling",
        "--enable-metrics",
    ]
    if order == "priority":
        command += ["--schedule-policy", "lpm"]
    if config.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(config.mem_fraction_static)]
    return command + list(config.extra_args)


class ServerProcess:
    """One launched server; :meth:`start` it, then :meth:`stop` it.

    Args:
        command: its command line.
        url: where it answers once healthy.
        env: extra environment variables.
        owned: paths that exist for the server alone (the random-init policy written
            for it): its tether deletes them should the launcher die without stopping
            it. Otherwise they are the caller's to delete after :meth:`stop` (the
            backend's :class:`~dynarl.workers.sglang.checkpoint.PolicyCheckpoint`).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        url: str,
        env: dict[str, str] | None = None,
        owned: Sequence[str] = (),
    ):
        self.command = list(command)
        self.url = url
        self.owned = list(owned)
        self._env = {**os.environ, **(env or {})}
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    @property
    def pid(self) -> int | None:
        """The id of the server's process group (its tether's pid; ``None`` before
        start)."""
        return None if self._process is None else self._process.pid

    def start(self, *, timeout_s: float) -> None:
        """Start the server and wait until ``/health`` answers 200.

        Raises:
            LaunchFailedError: it exited, or was not healthy within ``timeout_s``
                (it is stopped then).
        """
        with tempfile.NamedTemporaryFile(prefix="sglang-", suffix=".log", delete=False) as log:
            self.log_path = log.name
            logger.info("starting SGLang server: %s (log %s)", " ".join(self.command), log.name)
            removes = [arg for path in self.owned for arg in ("--remove", path)]
            self._process = subprocess.Popen(
                [sys.executable, "-m", "dynarl.workers.sglang.tether", *removes, *self.command],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self._process.poll()
                if code is not None:
                    raise LaunchFailedError(
                        f"the SGLang server exited with code {code} while starting; see its "
                        f"log {self.log_path}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise LaunchFailedError(
            f"the SGLang server at {self.url} was not healthy within {timeout_s} s; see "
            f"its log {self.log_path}, or raise rollout.sglang.startup_timeout_s"
        )

    def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                logger.warning("SGLang server %d ignored %s", process.pid, sig.name)

    def kill(self) -> None:
        """SIGKILL the server's process group now (tests: a server dying)."""
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
