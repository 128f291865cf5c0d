"""The SGLang backend's section of the configuration (``rollout.sglang``) and what
the backend table checks of it before a run starts. No httpx here: the table imports
this module to check a config."""

from typing import Literal

from dynarl.core.config import Accelerator, NonNegativeInt, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError


class SGLangConfig(Section, frozen=True, kw_only=True):
    """How rollout engines reach their SGLang servers.

    With ``urls`` empty, each rollout engine launches its own server
    (``launch_command`` plus SGLang's flags for the model, the port, ``rollout.tp``,
    ``rollout.max_running_requests``, ``rollout.kv_capacity_tokens``, the run's seed,
    the memory saver, CPU weight backup and priority scheduling, and ``extra_args``;
    see docs/sglang.md) and stops it with the engine;
    otherwise engines attach to servers the user runs, engine ``i`` to
    ``urls[i % len(urls)]`` (``i`` from the slot's name, ``slot-i``).

    Attributes:
        urls: servers to attach to (``http://host:port``); empty to launch them.
        launch_command: the server's command line before its flags; a first word
            ``python`` is this interpreter. SGLang's launcher by default; a wrapper of
            your own that takes the same flags; or, for tests and CPU-only trials,
            ``["python", "-m", "dynarl.testing.fake_sglang"]`` (a fake server backed
            by the torch reference engine).
        host: the address launched servers listen on.
        port_base: launched server ``i`` listens on ``port_base + i`` (``i``: its
            slot's index; for an engine of ``rollout.tail_tp``, the number of slots
            plus it).
        mem_fraction_static: ``--mem-fraction-static`` (unset: SGLang's default).
        extra_args: more flags for launched servers.
        startup_timeout_s: how long a launched server may take to answer ``/health``.
        request_timeout_s: how long one call may wait for its answer (a stream: for
            its next chunk).
        connect_timeout_s: how long connecting to a server may take.
        max_retries: retries of a call that timed out or got a 5xx (with back-off).
        retry_backoff_s: the first retry's delay; each next one doubles it.
        stats_interval_s: how often the engine reads the server's load.
        weight_sync_backend: the collective backend of the weight-sync group;
            ``None`` (default) follows ``cluster.accelerator`` (``nccl`` on ``cuda``,
            ``gloo`` on ``cpu``, as the trainer's sender), and a value that disagrees
            with it is refused. A real SGLang server needs ``nccl``, so
            ``cluster.accelerator=cuda``; ``gloo`` is for the fake server.
    """

    urls: tuple[str, ...] = ()
    launch_command: tuple[str, ...] = ("python", "-m", "sglang.launch_server")
    host: str = "127.0.0.1"
    port_base: PositiveInt = 30000
    mem_fraction_static: float | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: PositiveFloat = 900.0
    request_timeout_s: PositiveFloat = 600.0
    connect_timeout_s: PositiveFloat = 10.0
    max_retries: NonNegativeInt = 3
    retry_backoff_s: PositiveFloat = 0.5
    stats_interval_s: PositiveFloat = 1.0
    weight_sync_backend: Literal["nccl", "gloo"] | None = None

    def __post_init__(self) -> None:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"rollout.sglang.urls has {url!r}; give each as http://host:port",
                    field="rollout.sglang.urls",
                )
        if not self.launch_command:
            raise ConfigError(
                "rollout.sglang.launch_command is empty; give the server's command, "
                "e.g. ['python', '-m', 'sglang.launch_server']",
                field="rollout.sglang.launch_command",
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(
                f"rollout.sglang.mem_fraction_static={self.mem_fraction_static} must lie in (0, 1)",
                field="rollout.sglang.mem_fraction_static",
            )

    def sync_backend(self, accelerator: Accelerator) -> Literal["nccl", "gloo"]:
        """The weight-sync group's backend when the run's devices are ``accelerator``."""
        if self.weight_sync_backend is not None:
            return self.weight_sync_backend
        return "nccl" if accelerator == "cuda" else "gloo"

    @property
    def launches(self) -> bool:
        """Whether engines launch their own servers (no ``urls`` given)."""
        return not self.urls


def check_launch(config: SGLangConfig, *, installed: bool, tail_tp: int = 0) -> None:
    """Refuse a launch that cannot work here, before anything starts: servers launched
    with SGLang's own launcher while ``sglang`` is not ``installed``, or engines
    regrouped for the tail (``rollout.tail_tp``) on servers dynarl attaches to (it
    cannot start them at another size).

    Raises:
        ConfigError: naming the extra to install, or ``urls`` to attach instead.
    """
    if tail_tp and not config.launches:
        raise ConfigError(
            f"rollout.tail_tp={tail_tp} regroups the engines into servers of {tail_tp} "
            "GPUs for the rollout's tail, which dynarl can do only with servers it "
            "launches; leave rollout.sglang.urls empty, or unset rollout.tail_tp",
            field="rollout.tail_tp",
        )
    if config.launches and "sglang.launch_server" in config.launch_command and not installed:
        raise ConfigError(
            "rollout.backend='sglang' launches its servers with sglang.launch_server, "
            "but sglang is not installed here: pip install 'dynarl[sglang]' on a GPU "
            "machine, or attach to running servers with rollout.sglang.urls",
            field="rollout.sglang.urls",
        )
