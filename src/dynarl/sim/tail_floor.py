"""The tail floor: a model estimate of the shortest iteration when the rollout's
longest responses pay for their KV reads and the last minibatch waits for them.

The work-conserving bound (:mod:`dynarl.sim.bound`) spreads every device-second
anywhere, and its critical path decodes the longest request alone. Neither sees two
costs that every schedule pays on a workload whose longest responses are many (the
math workloads: hundreds of responses hit ``max_output_tokens``):

- **The longest requests' engines.** Each of the ``C`` requests of the longest length
  ``L`` needs ``L`` decode steps, and an engine's step costs ``a`` plus ``b`` per token
  of context it reads for *all* its requests. Put the longest requests on ``E_c``
  engines: they run at least ``L * a + W_c / (tp * E_c)`` seconds (``W_c``: their own
  KV reads in device-seconds), and those engines' devices are taken for that long;
  the rest of the work (``W_rest``) fills the other devices (``E_c`` is at most ``C``:
  a request decodes on one engine). In this model the rollout phase lasts at least
  ``min over E_c of max(L*a + W_c/(tp*E_c), (E_c*tp*L*a + W_c + W_rest)/N)``.
- **The last minibatch.** Minibatches of whole groups train as the groups finish, so
  the last optimizer step holds the groups that finish last -- the longest -- and
  starts only after them: its time on every device is added, then the weight sync.

This is an estimate from the simulator's cost model, not a proof: it assumes the
longest requests' lengths are known up front and that they stay on their engines (no
moves, no re-prefill), and it ignores KV capacity. It says how much of a mode's
distance to the lower bound the workload itself imposes; the rest is the schedule's
(devices held elsewhere during the rollout, other requests on the longest ones'
engines, training left until after the rollout).
"""

from collections import defaultdict
from collections.abc import Sequence

import msgspec

from dynarl.core.ids import GroupId
from dynarl.obs.trace_records import Request
from dynarl.sim.bound import work_device_s
from dynarl.sim.cluster import ClusterModel, decode_alone_s
from dynarl.sim.costs import attended_context


def last_step_s(cluster: ClusterModel, requests: Sequence[Request], num_devices: int) -> float:
    """Seconds of the last optimizer step on every device (a multiple of the actor's
    replica): the groups with the longest responses, at least a minibatch's samples."""
    actor = cluster.actor
    unit = actor.replica_devices
    devices = max(unit, num_devices - num_devices % unit)
    per_step = max(1, len(requests) // actor.n_minibatches)
    groups: dict[GroupId, list[Request]] = defaultdict(list)
    for r in requests:
        groups[r.group].append(r)
    longest_first = sorted(
        groups.values(), key=lambda g: (-max(sum(x.output_tokens) for x in g), g[0].group)
    )
    lengths: list[int] = []
    for g in longest_first:
        if len(lengths) >= per_step:
            break
        lengths.extend(x.total_tokens for x in g)
    if not sum(lengths):
        return 0.0
    return actor.step_time_s(sum(lengths), devices, attended_context(lengths))


def tail_floor_s(
    cluster: ClusterModel, requests: Sequence[Request], num_devices: int, *, tail_tp: int = 0
) -> float:
    """The tail floor of one iteration of ``requests`` on ``num_devices`` devices
    (see the module docstring); 0 without requests.

    ``tail_tp`` puts the longest requests on engines of that tensor-parallel size
    instead of the rollout's own (0: the rollout's), the rest of the work staying on
    the rollout's: what engines resharded to a larger ``tp`` for the tail would buy.
    A decode step's fixed part (the weights read, split ``tp`` ways) is most of the
    longest requests' time, so a larger ``tp`` shortens it, while each such engine
    takes that many more devices from the rest for as long."""
    if not requests:
        return 0.0
    eng = cluster.engine
    tp = eng.tp
    raw, _ = eng.step_coefficients()
    length = max(sum(r.output_tokens) for r in requests)
    longest = [r for r in requests if sum(r.output_tokens) == length]
    kv = _reads_device_s(cluster, longest, length)
    work = work_device_s(cluster, requests)
    last = last_step_s(cluster, requests, num_devices)
    unit = cluster.actor.replica_devices
    last_device_s = last * max(unit, num_devices - num_devices % unit)
    # The bound's share of the longest requests' decode (their steps at a full batch
    # and their reads) is counted above instead.
    per_token = raw / eng.max_running_requests + eng.step_per_request_s
    own = tp * len(longest) * length * per_token
    rest = max(0.0, sum(work.values()) - kv - own - last_device_s)
    if tail_tp and tail_tp != tp:
        # The same requests on engines of ``tail_tp`` devices: their steps and reads as
        # those engines decode them.
        wide = msgspec.structs.replace(cluster, engine=msgspec.structs.replace(eng, tp=tail_tp))
        tp = tail_tp
        raw, _ = wide.engine.step_coefficients()
        kv = _reads_device_s(wide, longest, length)
    steps = length * (raw + eng.step_per_request_s)
    num_engines = max(1, num_devices // tp)
    rollout = min(
        max(steps + kv / (tp * e), (e * tp * steps + kv + rest) / num_devices)
        for e in range(1, min(num_engines, len(longest)) + 1)
    )
    return rollout + last + cluster.weight_sync.time_s(cluster.model)


def _reads_device_s(cluster: ClusterModel, longest: Sequence[Request], length: int) -> float:
    """The KV reads of the ``longest`` requests (``length`` tokens each) on the
    cluster's engines, in device-seconds: decoding one alone costs a step's fixed part
    per token plus its reads."""
    eng = cluster.engine
    raw, _ = eng.step_coefficients()
    a = raw + eng.step_per_request_s
    return eng.tp * sum(
        decode_alone_s(cluster, r) - length * a - sum(r.tool_latency_s) for r in longest
    )
