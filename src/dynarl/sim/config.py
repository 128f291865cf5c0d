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
from dynarl.core.config import PositiveFloat, PositiveInt, Section


class SimConfig(Section, frozen=True, kw_only=True):
    """A simulated run (``dynarl sim``): hardware, model and workload.

    The simulated engines derive their KV capacity from ``gpu`` memory and the model
    (``rollout.kv_capacity_tokens`` is not used); response lengths are capped at
    ``rollout.max_new_tokens``; ``algorithm.num_prompts`` x ``algorithm.group_size``
    sequences make an iteration.

    Attributes:
        gpu: device profile (``H100``, ``H200``, ``A100``).
        model: model shape, e.g. ``R1-Distill-Qwen-7B`` (see ``dynarl.sim.MODELS``).
        workload: ``math`` (single-turn reasoning) or ``agentic`` (multi-turn with a
            code tool between turns).
        median_output_tokens: (math) median response length before the cap.
        mean_tool_calls: (agentic) mean tool calls per trajectory (>= 1).
        first_turn_median_tokens: (agentic) median tokens of a trajectory's first turn;
            later turns are shorter.
        tool_mean_s: (agentic) mean latency of one tool call.
        tool_timeout_s: (agentic) a tool call returns, failed, after this long.
        request_order: order of the queue in front of each engine: ``fifo``, or
            ``priority`` (more completed tool calls first, then a longer cached
            prefix, with an aging bound so nothing starves).
        warmup_iterations: iterations left out of the reported means.
        stats_period_s: how often every engine reports its load when nothing else
            happens (engines also report whenever a request starts or ends).
    """

    gpu: str = "H100"
    model: str = "R1-Distill-Qwen-1.5B"
    workload: Literal["math", "agentic"] = "math"
    median_output_tokens: PositiveInt = 2000
    mean_tool_calls: Annotated[float, msgspec.Meta(ge=1.0)] = 3.0
    first_turn_median_tokens: PositiveInt = 1200
    tool_mean_s: PositiveFloat = 0.3
    tool_timeout_s: PositiveFloat = 4.0
    request_order: Literal["fifo", "priority"] = "fifo"
    warmup_iterations: Annotated[int, msgspec.Meta(ge=0)] = 1
    stats_period_s: PositiveFloat = 1.0


class SimulatedRun(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A simulated run: the job a real run would run (``job``), on the modelled
    hardware and workload of ``sim``.

    Attributes:
        job: the run's configuration, as a real run would take it.
        sim: the modelled cluster: device and model profiles, workload, request order.
    """

    job: DynaRLConfig = msgspec.field(default_factory=DynaRLConfig)
    sim: SimConfig = msgspec.field(default_factory=SimConfig)


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
