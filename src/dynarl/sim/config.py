"""The simulator's section of the configuration: what the modelled cluster runs.

Devices, initial placement, parallel sizes, batch shape, response-length cap and the
scheduling mode come from the rest of the configuration tree (``cluster``,
``rollout``, ``inference``, ``actor``, ``algorithm``, ``scheduler``); this section
adds only what a real run would learn from its hardware and data: the device and
model profiles, the workload's shape, and the request order in front of each engine.
"""

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
