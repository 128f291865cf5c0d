"""The work-conserving bound: how fast an iteration could be if no device ever idled.

Every device-second does useful work at its best efficiency: rollout decodes at a full
batch (``max_running_requests``; a token still pays for reading its own context), every
prompt and tool output is prefilled once (prefixes are always cached), inference and
the trainer run as single replicas (no data-parallel loss). The bound is that work
spread over all devices plus the weight sync, which nothing overlaps. No schedule can
beat it; how far a mode stays above it is the waste left to reclaim. The rollout's
critical path (the longest request decoded alone) is reported beside it: when it
exceeds the bound, no schedule can reach the bound either.
"""

from collections.abc import Sequence

import msgspec

from dynarl.sim.cluster import ClusterModel, longest_decode_s
from dynarl.sim.costs import attended_context
from dynarl.sim.workloads import Request


class Bound(msgspec.Struct, frozen=True, kw_only=True):
    """Useful device-seconds per component, the bound on the iteration time and the
    rollout's critical path."""

    device_s: dict[str, float]
    serial_s: float
    iteration_s: float
    critical_path_s: float


def work_device_s(cluster: ClusterModel, requests: Sequence[Request]) -> dict[str, float]:
    """Device-seconds each component needs for ``requests`` at its best efficiency."""
    eng = cluster.engine
    a, b = eng.step_coefficients()
    batch = eng.max_running_requests
    prefill_rate = eng.gpu.bf16_flops_per_s * eng.prefill_mfu
    shape = cluster.model
    decode = prefill = 0.0
    for r in requests:
        context = float(r.prompt_tokens)
        prefill += shape.prefill_flops(r.prompt_tokens) / prefill_rate
        for k, n in enumerate(r.output_tokens):
            decode += n * a / batch + b * (n * context + n * (n - 1) / 2)
            context += n
            if k < r.num_tool_calls:
                out = r.tool_output_tokens[k]
                prefill += shape.prefill_flops(out, context) / prefill_rate
                context += out
    rollout = decode * eng.tp + prefill
    inf = cluster.inference
    inference = sum(
        inf.time_s(r.total_tokens, inf.tp, r.total_tokens / 2) * inf.tp for r in requests
    )
    actor = cluster.actor
    unit = actor.replica_devices
    steps = actor.n_minibatches
    per_step = max(1, len(requests) // steps)
    train = 0.0
    for k in range(steps):
        chunk = requests[k * per_step : (k + 1) * per_step]
        lengths = [r.total_tokens for r in chunk]
        if sum(lengths):
            context = attended_context(lengths)
            train += actor.step_time_s(sum(lengths), unit, context) * unit
    return {"rollout": rollout, "inference": inference, "actor": train}


def work_conserving_bound(
    cluster: ClusterModel, requests: Sequence[Request], num_devices: int
) -> Bound:
    """The bound on one iteration of ``requests`` on ``num_devices`` devices."""
    work = work_device_s(cluster, requests)
    serial = cluster.weight_sync.time_s(cluster.model)
    return Bound(
        device_s=work,
        serial_s=serial,
        iteration_s=sum(work.values()) / num_devices + serial,
        critical_path_s=longest_decode_s(cluster, requests),
    )
