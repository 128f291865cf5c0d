"""Per-iteration metrics of a real run: the record, the meters behind it (device-seconds
and migrations; the rollout engines' steps) and the ``metrics.jsonl`` writer (one JSON
object per line, one line per iteration).
"""

import json
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import msgspec

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import InstanceId


class MigrationRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One migration of the iteration: what moved, and what it cost.

    Attributes:
        kind: ``workload``, ``reshard`` or ``reboot``.
        src, dst: components (``None``: the free pool).
        num_devices: devices moved.
        duration_s: wall time from commit to done or failed.
        ok: whether it succeeded.
    """

    kind: str
    src: str | None
    dst: str | None
    num_devices: int
    duration_s: float
    ok: bool


class PartialRolloutStats(msgspec.Struct, frozen=True, kw_only=True):
    """What an iteration's partial rollout (``algorithm.over_sample_prompts``) carried,
    and how stale what it trained was.

    Attributes:
        num_carried_in: samples it took over from the previous iteration (every sample
            of the groups carried over: unfinished ones it resumed, finished ones that
            waited for the rest of their group).
        num_resumed: of those, the unfinished requests it resumed from their partial
            output (and the multi-turn episodes it resumed mid-session).
        num_carried_out: samples it carried over to the next iteration.
        max_times_carried: the most times one of the groups it trained had been
            carried over (at most ``algorithm.max_staleness``).
        max_weight_lag: the most weight versions by which the oldest token of a sample
            it trained lags the weights its engines held (0: it trained only tokens its
            own policy generated).
        stale_token_fraction: the share of its trained samples' response tokens that
            older weights generated, in earlier iterations.
    """

    num_carried_in: int
    num_resumed: int
    num_carried_out: int
    max_times_carried: int
    max_weight_lag: int
    stale_token_fraction: float


class IterationStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one RL iteration of a real run measured (a line of ``metrics.jsonl``).

    Attributes:
        iteration: 0-based index.
        mean_reward: mean verifier reward over the iteration's trained responses.
        solved_fraction: trained responses with reward 1.
        num_samples: responses trained (without partial rollouts, every one generated).
        gen_tokens: tokens the rollout engines generated during the iteration.
        mean_response_tokens: mean length in tokens of the trained responses.
        tokens_per_s: generated tokens per second of the iteration's wall time.
        loss, grad_norm: means over the iteration's optimizer steps.
        weight_version: the weight version the engines hold after the iteration.
        stage_s: wall seconds of each stage (``rollout``, ``score``, ``train``,
            ``sync``); stages may overlap.
        elapsed_s: wall time of the whole iteration.
        device_s: device-seconds each component held during the iteration.
        allocation: devices per component when the iteration ended.
        migrations: the migrations that finished during the iteration.
        restarts: worker processes started again during the iteration (the reboot of
            a device whose worker died), by kind (``slot``, ``trainer``).
        episodes: multi-turn runs: per-episode means of the environment's metrics
            (``turns``, ``tool_calls``, ``tool_errors``, ``parse_errors``, ``tool_s``,
            ...), ``tool_call_rate`` (episodes with a tool call), and the counts
            ``truncated`` and ``aborted`` (infrastructure failures, not scored).
        engine_steps: the rollout engines' steps in the iteration, summed over the
            engines (``prefill_steps``, ``decode_steps``) and the seconds they took
            (``prefill_s``, ``decode_s``; so ``decode_s / decode_steps`` is the mean
            decode step), and of ``prefill_s`` the seconds that re-prefilled requests
            moved to an engine with partial output (``resume_prefill_s``: what
            moving requests cost the engines); empty where the engines do not count
            their steps (SGLang).
            Counted from the engines' load reports, so steps after an engine's last
            report of the iteration count in the next.
        controller_cpu_s: CPU seconds the controller process (the one running the
            event loop: controller, data router, reward threads, result batches; not
            the worker processes) spent on the iteration, what it takes from the
            host's cores beside the slots (``dynarl profile --from-run`` fits it per
            response and per generated token); ``None``: not recorded (a run by an
            older dynarl).
        partial_rollout: what the iteration carried over and how stale its trained
            samples were (:class:`PartialRolloutStats`); ``None`` without partial
            rollouts.
    """

    iteration: int
    mean_reward: float
    solved_fraction: float
    num_samples: int
    gen_tokens: int
    mean_response_tokens: float
    tokens_per_s: float
    loss: float
    grad_norm: float
    weight_version: int
    stage_s: dict[str, float]
    elapsed_s: float
    device_s: dict[str, float] = msgspec.field(default_factory=dict)
    allocation: dict[str, int] = msgspec.field(default_factory=dict)
    migrations: list[MigrationRecord] = msgspec.field(default_factory=list)
    restarts: dict[str, int] = msgspec.field(default_factory=dict)
    episodes: dict[str, float] = msgspec.field(default_factory=dict)
    engine_steps: dict[str, float] = msgspec.field(default_factory=dict)
    controller_cpu_s: float | None = None
    partial_rollout: PartialRolloutStats | None = None


_STEP_FIELDS = ("prefill_steps", "decode_steps", "prefill_s", "decode_s", "resume_prefill_s")


class EngineSteps:
    """The rollout engines' steps and their seconds, summed over the engines, from
    their ``EngineStats`` reports (each carries its engine's counts since it started
    serving as that instance); a controller listener.

    An engine whose counts go down started again (a restarted slot): its new counts
    are all new steps.
    """

    def __init__(self) -> None:
        self._last: dict[InstanceId, tuple[float, ...]] = {}
        self._total = [0.0] * len(_STEP_FIELDS)

    def __call__(self, event: ev.Event) -> None:
        """Count the steps an engine report adds."""
        if not isinstance(event, ev.EngineStats):
            return
        counts = tuple(float(getattr(event, name)) for name in _STEP_FIELDS)
        last = self._last.get(event.instance)
        if last is None or counts[0] < last[0] or counts[1] < last[1]:
            last = (0.0,) * len(_STEP_FIELDS)
        for k, (now, before) in enumerate(zip(counts, last, strict=True)):
            self._total[k] += now - before
        self._last[event.instance] = counts

    def take(self) -> dict[str, float]:
        """The steps and seconds counted since the previous call (empty if no engine
        counted a step), and start again."""
        total, self._total = self._total, [0.0] * len(_STEP_FIELDS)
        if not (total[0] or total[1]):
            return {}
        return dict(zip(_STEP_FIELDS, total, strict=True))


class MeterReading(msgspec.Struct, frozen=True, kw_only=True):
    """What a :class:`DeviceMeter` counted since its previous reading."""

    device_s: dict[str, float]
    migrations: list[MigrationRecord]
    engine_steps: dict[str, float]


class DeviceMeter:
    """Device-seconds per component, finished migrations and the rollout engines'
    steps (:class:`EngineSteps`), from the controller's events; a controller listener.

    Args:
        graph: the controller's hypergraph (read only).
        now_s: the clock's time when metering starts.
    """

    def __init__(self, graph: Hypergraph, *, now_s: float) -> None:
        self._graph = graph
        self._last_s = now_s
        self._device_s: dict[str, float] = {}
        self._started: dict[int, tuple[float, MigrationRecord]] = {}
        self._migrations: list[MigrationRecord] = []
        self._steps = EngineSteps()

    def __call__(self, event: ev.Event) -> None:
        """Account the time since the previous event at the placement before ``event``
        (listeners see events after they are applied; the difference is one event)."""
        self.advance(event.time_s)
        if isinstance(event, ev.EngineStats):
            self._steps(event)
        elif isinstance(event, ev.MigrationStarted):
            m = event.migration
            record = MigrationRecord(
                kind=m.kind,
                src=m.src,
                dst=m.dst,
                num_devices=len(m.devices),
                duration_s=0.0,
                ok=False,
            )
            self._started[int(m.id)] = (event.time_s, record)
        elif isinstance(event, ev.MigrationDone | ev.MigrationFailed):
            started = self._started.pop(int(event.migration), None)
            if started is not None:
                t0, record = started
                self._migrations.append(
                    msgspec.structs.replace(
                        record,
                        duration_s=event.time_s - t0,
                        ok=isinstance(event, ev.MigrationDone),
                    )
                )

    def advance(self, now_s: float) -> None:
        """Account device time up to ``now_s``."""
        dt = max(0.0, now_s - self._last_s)
        self._last_s = max(self._last_s, now_s)
        for cid, devices in self.allocation().items():
            self._device_s[cid] = self._device_s.get(cid, 0.0) + dt * devices

    def allocation(self) -> dict[str, int]:
        """Active devices per component on devices now."""
        return {
            str(cid): node.num_active_devices
            for cid, node in self._graph.components.items()
            if node.spec.on_devices
        }

    def take(self, now_s: float) -> MeterReading:
        """What was counted since the previous call, and reset."""
        self.advance(now_s)
        device_s, self._device_s = self._device_s, {}
        migrations, self._migrations = self._migrations, []
        return MeterReading(
            device_s=device_s, migrations=migrations, engine_steps=self._steps.take()
        )


class MetricsWriter:
    """Appends :class:`IterationStats` to ``metrics.jsonl`` in a run directory, one
    flushed line each; ``with`` it or call :meth:`close`.

    Args:
        path: the file to write.
        append: keep the records already there (a resumed run); else the first write
            truncates the file.
    """

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.append = append
        self._file: IO[str] | None = None

    def write(self, stats: IterationStats) -> None:
        """Append one record."""
        if self._file is None:
            self._file = self.path.open("a" if self.append else "w", encoding="utf-8")
        self._file.write(msgspec.json.encode(stats).decode() + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[IterationStats]:
    """The records of a ``metrics.jsonl`` file, in order."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [msgspec.convert(json.loads(line), IterationStats) for line in lines if line.strip()]


def write_metrics(path: str | Path, records: Iterable[IterationStats]) -> None:
    """Replace ``path`` with ``records`` (atomically: a temporary file renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        "".join(msgspec.json.encode(r).decode() + "\n" for r in records), encoding="utf-8"
    )
    os.replace(tmp, path)


FlatValue = float | int | str | bool | None
"""A value of a flat record."""


def flat_record(stats: IterationStats) -> dict[str, FlatValue]:
    """``stats`` as one flat dict a ``pandas.DataFrame`` row can take: nested dicts and
    records become dotted keys (``stage_s.rollout``, ``device_s.actor``,
    ``partial_rollout.max_weight_lag``; none of a record that is absent), and the
    migrations their count (``num_migrations``) and total ``migration_s``."""
    out: dict[str, FlatValue] = {}
    for name in stats.__struct_fields__:
        value = getattr(stats, name)
        if isinstance(value, dict):
            out.update((f"{name}.{key}", v) for key, v in value.items())
        elif isinstance(value, PartialRolloutStats):
            out.update((f"{name}.{key}", getattr(value, key)) for key in value.__struct_fields__)
        elif value is None and name == "partial_rollout":
            continue
        elif name == "migrations":
            out["num_migrations"] = len(value)
            out["migration_s"] = sum(m.duration_s for m in value)
        else:
            out[name] = value
    return out
