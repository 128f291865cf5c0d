"""The work-conserving bound: how fast an iteration could be if no device ever idled.

Every device-second does useful work at its best efficiency: rollout decodes at a full
batch (``max_running_requests``; a token still pays for reading its own context), every
prompt and tool output is prefilled once (prefixes are always cached), inference and
the trainer run as single replicas (no data-parallel loss). The bound is that work
spread over all devices plus the weight sync, which nothing overlaps. No schedule can
beat it; how far a mode stays above it is the waste left to reclaim. The rollout's
critical path (the longest request decoded alone) is reported beside it: when it
exceeds the bound, no schedule can reach the bound either.

The **lower bound** of an iteration is the larger of the work-conserving bound and the
iteration's critical path (:func:`critical_path_s`): the longest request decoded alone,
then scored, then trained in a last optimizer step, then the weight sync. No schedule
beats either, so none beats the larger.

Where the rollout's engines may be regrouped into a wider size for the tail
(``rollout.tail_tp``), each bound is the smaller of the two sizes' (narrow engines
decode a full batch for fewer device-seconds, wide ones a request alone sooner).
"""

from collections.abc import Sequence

import msgspec

from dynarl.obs.trace_records import Request
from dynarl.sim.cluster import ClusterModel, decode_alone_s, longest_decode_s
from dynarl.sim.costs import attended_context


class Bound(msgspec.Struct, frozen=True, kw_only=True):
    """Useful device-seconds per component, the work-conserving bound on the iteration
    time (``iteration_s``), the rollout's critical path (``critical_path_s``: the
    longest request decoded alone), the iteration's (``path_s``: that request also
    scored and trained, and the weight sync) and the lower bound, the larger of
    ``iteration_s`` and ``path_s``."""

    device_s: dict[str, float]
    serial_s: float
    iteration_s: float
    critical_path_s: float
    path_s: float

    @property
    def lower_bound_s(self) -> float:
        """No schedule's iteration is shorter: the larger of the two bounds."""
        return max(self.iteration_s, self.path_s)


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
            decode += n * (a / batch + eng.step_per_request_s)
            decode += b * (n * context + n * (n - 1) / 2)
            context += n
            if k < r.num_tool_calls:
                out = r.tool_output_tokens[k]
                prefill += shape.prefill_flops(out, context) / prefill_rate
                context += out
    rollout = decode * eng.tp + prefill
    inf = cluster.inference
    inference = sum(
        inf.time_s(r.total_tokens, inf.tp, r.total_tokens / 2) * inf.tp
        for r in (requests if inf.num_forwards else ())
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
    cluster: ClusterModel, requests: Sequence[Request], num_devices: int, *, tail_tp: int = 0
) -> Bound:
    """The bound on one iteration of ``requests`` on ``num_devices`` devices, engines of
    ``tail_tp`` devices allowed beside the cluster's own (0: none; see the module
    docstring)."""
    own = _bound(cluster, requests, num_devices)
    if not tail_tp or tail_tp == cluster.engine.tp:
        return own
    engine = msgspec.structs.replace(cluster.engine, tp=tail_tp)
    wide = _bound(msgspec.structs.replace(cluster, engine=engine), requests, num_devices)
    best = own if own.iteration_s <= wide.iteration_s else wide
    return msgspec.structs.replace(
        best,
        critical_path_s=min(own.critical_path_s, wide.critical_path_s),
        path_s=min(own.path_s, wide.path_s),
    )


def _bound(cluster: ClusterModel, requests: Sequence[Request], num_devices: int) -> Bound:
    work = work_device_s(cluster, requests)
    serial = cluster.weight_sync.time_s(cluster.model)
    return Bound(
        device_s=work,
        serial_s=serial,
        iteration_s=sum(work.values()) / num_devices + serial,
        critical_path_s=longest_decode_s(cluster, requests),
        path_s=critical_path_s(cluster, requests, num_devices),
    )


def critical_path_s(cluster: ClusterModel, requests: Sequence[Request], num_devices: int) -> float:
    """The iteration's critical path: the longest chain of work no device count
    shortens. A request is decoded alone (every step pays the engine's fixed cost;
    its tool calls included), then scored on one inference replica, then trained in
    an optimizer step that cannot start before it is scored -- at least a minibatch's
    worth of samples (it and the shortest others), on every device -- and then the
    weights are synced. The longest such chain over the requests."""
    if not requests:
        return 0.0
    inf, actor = cluster.inference, cluster.actor
    unit = actor.replica_devices
    devices = max(unit, num_devices - num_devices % unit)
    per_step = max(1, len(requests) // actor.n_minibatches)
    # The step holds r and the per_step - 1 shortest others: the per_step shortest
    # if r is among them, else those less the longest of them, plus r.
    head = sorted(r.total_tokens for r in requests)[:per_step]
    total, squares, last = sum(head), sum(n * n for n in head), head[-1]
    sync = cluster.weight_sync.time_s(cluster.model)
    worst = 0.0
    for r in requests:
        n = r.total_tokens
        tokens, sq = total, squares
        if n > last:
            tokens, sq = total - last + n, squares - last * last + n * n
        train = actor.step_time_s(tokens, devices, sq / (2 * tokens) if tokens else 0.0)
        score = inf.time_s(n, inf.tp, n / 2) if inf.num_forwards else 0.0
        worst = max(worst, decode_alone_s(cluster, r) + score + train)
    return worst + sync
