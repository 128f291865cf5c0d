"""What a backend implements: the protocols of a rollout, inference and trainer backend
(the rows of :data:`~dynarl.workers.backends.BACKENDS` load one of each), a worker
process's entry, and the reference profiler's.

Here, below the table, so that a backend's module imports what it implements without
importing the table that loads it.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from dynarl.core.config import Accelerator
from dynarl.envs.environment import ChatMessage
from dynarl.rl.config import AlgorithmConfig
from dynarl.workers.config import ActorConfig, InferenceConfig, ModelConfig, RolloutConfig
from dynarl.workers.handles import CallChannel
from dynarl.workers.inference import InferenceEngine
from dynarl.workers.protocol import InferenceRole, RolloutRole
from dynarl.workers.rollout import RolloutEngine
from dynarl.workers.trainer import LossFn, Trainer

WorkerEntry = Callable[[str, str, int], None]
"""A worker process's main: ``entry(endpoint, name, num_threads)``, where ``endpoint``
is the data router's address (a module-level function, so a new process can import
it); the process says hello to the router as ``name``."""


class _Devices(Protocol):
    @property
    def num_devices(self) -> int: ...


class ProfiledJob(Protocol):
    """The sections of a run's configuration a profiling run reads."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def inference(self) -> InferenceConfig: ...
    @property
    def actor(self) -> ActorConfig: ...
    @property
    def algorithm(self) -> AlgorithmConfig: ...
    @property
    def cluster(self) -> _Devices: ...


class MachineMeasurement(msgspec.Struct, frozen=True, kw_only=True):
    """What a profiling run measured on this machine: fitted ``costs`` by name, how
    slots sharing the host slow each other down (``None``: not measured), the host
    described, the threads per slot, and the machine's name."""

    costs: dict[str, float]
    host_slowdown: tuple[float, ...] | None
    host: str
    threads: int
    name: str


class ReferenceProfiler(Protocol):
    """Measures the reference (torch) workers on this machine (``dynarl profile``)."""

    def measure_machine(
        self, cfg: ProfiledJob, *, repeat: int, threads: int, host_slots: int | None
    ) -> MachineMeasurement:
        """Costs, the host-sharing curve and the host, measured now."""
        ...


class RolloutBackend(Protocol):
    """What a rollout backend provides: its engine, built in a slot's worker thread."""

    def build_rollout(self, role: RolloutRole, *, name: str, num_threads: int) -> RolloutEngine:
        """A rollout engine serving ``role`` (not yet running)."""
        ...


class InferenceBackend(Protocol):
    """What an inference backend provides: its worker, built in a slot's thread."""

    def build_inference(
        self, role: InferenceRole, *, name: str, num_threads: int
    ) -> InferenceEngine:
        """An inference worker serving ``role``."""
        ...


class TrainerBackend(Protocol):
    """What a trainer backend provides: the main of its worker processes (a launcher
    starts them; each connects to the data router), and the elastic trainer over them."""

    @property
    def trainer_worker_entry(self) -> WorkerEntry:
        """``entry(endpoint, name, num_threads)``: a trainer worker process's main."""
        ...

    def build_trainer(
        self,
        *,
        model: ModelConfig,
        actor: ActorConfig,
        loss: LossFn,
        seed: int,
        workers: Sequence[CallChannel],
        num_threads: int,
        rendezvous_host: str = "127.0.0.1",
        accelerator: Accelerator = "cpu",
        devices: Sequence[int] = (),
    ) -> Trainer:
        """A trainer over the started ``workers``, training ``model`` with ``loss``;
        its process group's rendezvous is hosted by worker 0, which the other workers
        reach at ``rendezvous_host`` (worker 0's node address). Its workers run on
        ``accelerator``, worker ``i`` on the run's device ``devices[i]`` (empty:
        ``i``)."""
        ...

    def warm_start(
        self,
        model: ModelConfig,
        demonstrations: Sequence[Sequence[ChatMessage]],
        *,
        tools: Sequence[dict[str, object]],
        steps: int,
        lr: float,
        seed: int,
        out_dir: Path,
    ) -> list[float]:
        """Train the random-init policy of ``model`` (``seed``) for ``steps``
        supervised steps on ``demonstrations`` (their assistant tokens), in this
        process, and save it with its tokenizer to ``out_dir`` (a checkpoint
        ``model.path`` can name); the loss of each step."""
        ...
