"""The simulator's configuration: a run's job wrapped with what the modelled cluster runs.

A :class:`SimulatedRun` holds the job (a :class:`~dynarl.api.config.DynaRLConfig`,
exactly as a real run takes it: devices, initial placement, parallel sizes, batch
shape, response-length cap, scheduling mode) and :class:`SimConfig`, only what a real
run would learn from its hardware and data: the device and model profiles, the
workload's shape, and the request order in front of each engine.
"""

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.core.config import NonNegativeFloat, PositiveFloat, PositiveInt, Section
from dynarl.core.errors import ConfigError
from dynarl.sim.lengths import LengthDistribution


class SimConfig(Section, frozen=True, kw_only=True):
    """A simulated run (``dynarl sim``): hardware, model and workload.

    The simulated engines derive their KV capacity from ``gpu`` memory and the model
    (``rollout.kv_capacity_tokens`` is not used); response lengths are capped at
    ``rollout.max_new_tokens``; ``algorithm.num_prompts`` x ``algorithm.group_size``
    sequences make an iteration.

    Attributes:
        gpu: device profile: a built-in one (``H100``, ``H200``, ``A100``; ``cpu-1t``,
            the reference CPU workers), or the path of a profile file ``dynarl profile``
            measured (``dynarl sim --profile FILE``).
        model: model shape, e.g. ``R1-Distill-Qwen-7B`` (see ``dynarl.sim.MODELS``);
            with a CPU or measured profile, the job's ``model`` section is simulated.
        workload: ``math`` (single-turn reasoning) or ``agentic`` (multi-turn with a
            code tool between turns); with a ``trace``, the kind its requests are
            (``agentic`` when any makes a tool call).
        trace: the path of a trace file (``trace.jsonl`` of a real run's directory, or
            one written by hand) whose requests are replayed, iteration by iteration,
            instead of drawn (``dynarl sim --workload FILE``); its batch shape must be
            ``algorithm.num_prompts`` x ``algorithm.group_size``.
        median_output_tokens: (math) median response length before the cap.
        output_lengths: (math) the response-length distribution, by ``kind``:
            ``lognormal`` (``median_tokens``, ``group_sigma``, ``sample_sigma``),
            ``mixture`` (``components``: lognormals, ``weights``) or ``histogram``
            (``edges``, ``counts``, ``group_correlation``); unset: the lognormal of
            ``median_output_tokens``.
        mean_tool_calls: (agentic) mean tool calls per trajectory (>= 1).
        max_tool_calls: (agentic) most tool calls a trajectory makes.
        first_turn_median_tokens: (agentic) median tokens of a trajectory's first turn.
        turn_decay: (agentic) turn ``k`` generates about ``turn_decay**k`` times the
            first turn's tokens.
        tool_output_median_tokens: (agentic) median tokens a tool call appends to the
            context.
        tool_mean_s: (agentic) mean latency of one tool call.
        tool_sigma: (agentic) spread of the tool latency's lognormal.
        tool_timeout_s: (agentic) a tool call returns, failed, after this long.
        request_order: order of the queue in front of each engine: ``fifo``, or
            ``priority`` (more completed tool calls first, then a longer cached
            prefix, with an aging bound so nothing starves).
        warmup_iterations: iterations left out of the reported means.
        stats_period_s: how often every engine reports its load (an engine that runs
            out of requests also reports at once), as a real slot's
            ``stats_interval_s``.
    """

    gpu: str = "H100"
    model: str = "R1-Distill-Qwen-1.5B"
    workload: Literal["math", "agentic"] = "math"
    trace: str | None = None
    median_output_tokens: PositiveInt = 2000
    output_lengths: LengthDistribution | None = None
    mean_tool_calls: Annotated[float, msgspec.Meta(ge=1.0)] = 3.0
    max_tool_calls: PositiveInt = 16
    first_turn_median_tokens: PositiveInt = 1200
    turn_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.6
    tool_output_median_tokens: PositiveInt = 80
    tool_mean_s: PositiveFloat = 0.3
    tool_sigma: NonNegativeFloat = 1.0
    tool_timeout_s: PositiveFloat = 4.0
    request_order: Literal["fifo", "priority"] = "fifo"
    warmup_iterations: Annotated[int, msgspec.Meta(ge=0)] = 1
    stats_period_s: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        if self.output_lengths is not None and self.workload != "math":
            raise ConfigError(
                "sim.output_lengths shapes single-turn (math) responses; for "
                "sim.workload=agentic set the turn statistics (sim.first_turn_median_tokens, "
                "sim.turn_decay, sim.mean_tool_calls, ...) instead, or unset it",
                field="sim.output_lengths",
            )
        if self.output_lengths is not None and self.median_output_tokens != 2000:
            raise ConfigError(
                "sim.median_output_tokens is the median of the default lognormal, which "
                "sim.output_lengths replaces: set the median in sim.output_lengths "
                "(kind: lognormal, median_tokens: ...) and drop sim.median_output_tokens",
                field="sim.median_output_tokens",
            )
        if self.trace is not None and self.output_lengths is not None:
            raise ConfigError(
                f"sim.trace={self.trace} replays measured lengths, so sim.output_lengths "
                "would be ignored: unset one of them",
                field="sim.output_lengths",
            )


class SimulatedRun(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A simulated run: the job a real run would run (``job``), on the modelled
    hardware and workload of ``sim``.

    Attributes:
        job: the run's configuration, as a real run would take it.
        sim: the modelled cluster: device and model profiles, workload, request order.
    """

    job: DynaRLConfig = msgspec.field(default_factory=DynaRLConfig)
    sim: SimConfig = msgspec.field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if self.job.scheduler.predictor_profile is not None:
            raise ConfigError(
                "the simulator seeds the scheduler's predictor with a profiling run on "
                "the simulated hardware, so a real run's predictor profile "
                f"({self.job.scheduler.predictor_profile}) would be ignored: unset "
                "scheduler.predictor_profile (set sim.gpu to simulate other hardware)",
                field="scheduler.predictor_profile",
            )


def simulated_run(
    base: DynaRLConfig | SimulatedRun | Mapping[str, Any], overrides: Iterable[str] = ()
) -> SimulatedRun:
    """A :class:`SimulatedRun` from a job (simulated on the default hardware), a
    simulated run, or a tree of builtins of either (a file's: one with a top-level
    ``job`` or ``sim`` key is a simulated run), with dotted ``overrides``:
    ``sim.gpu=H200`` sets the modelled cluster, every other key the job
    (``cluster.num_devices=128``; ``job.cluster.num_devices=128`` also works)."""
    if isinstance(base, DynaRLConfig):
        base = SimulatedRun(job=base)
    elif not isinstance(base, SimulatedRun) and not {"job", "sim"} & base.keys():
        base = {"job": dict(base)}
    keys = [o if o.lstrip().startswith(("sim.", "job.")) else f"job.{o}" for o in overrides]
    return apply_overrides(base, keys, SimulatedRun)
