"""The donor signals of a rollout component: how many engines it can give up.

* **Under-used engines** (the reference design's signal): an engine is under-used once
  its KV usage has stayed below ``u_low`` for ``donor_window_s`` seconds with nothing
  queued on it. The component may give them up only when more than ``theta`` of its
  engines are under-used and no request waits in front of them: its marginal value
  has fallen. Both the bottleneck policy and the return of borrowed devices use it.
* **Spare engines**: those beyond what its running requests need if packed onto the
  others, each kept engine at most ``_PACK_FILL`` full in request slots and in KV
  cache (the room their contexts grow into). Packing makes each step read more KV;
  whether that pays is the predictor's call, whose decode step has a cost per token
  of context. The bottleneck policy offers these too: on a simulated 7B rollout's
  tail, each engine holds tens of long-context requests (~40% of its KV) for
  minutes, and the under-used signal never fires.
"""

import math

from dynarl.control.config import SchedulerConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import ComponentId

_PACK_FILL = 0.7


def underused_engines(
    graph: Hypergraph, rollout: ComponentId, cfg: SchedulerConfig, now_s: float
) -> int:
    """How many of ``rollout``'s engines are under-used, or 0 unless more than
    ``cfg.theta`` of them are (and no request waits for a slot)."""
    if graph.waiting_for_slot(rollout):
        # Requests are waiting for a slot: the engines are full, however little KV
        # their (young, short-context) requests hold yet.
        return 0
    active = list(graph.components[rollout].active_instances())
    low = sum(
        1 for n in active if not n.num_queued and graph.low_for(n, now_s) >= cfg.donor_window_s
    )
    return low if low > cfg.theta * len(active) else 0


def spare_engines(graph: Hypergraph, rollout: ComponentId) -> int:
    """How many of ``rollout``'s engines its requests do not need: 0 while a request
    waits for a slot or a session is out on a tool call (it comes back to its
    engine's KV prefix), else the engines beyond those that hold its requests at
    ``_PACK_FILL`` of their slots and of their KV cache (its engines are alike: their
    KV usages add up)."""
    if graph.waiting_for_slot(rollout) or any(e.num_in_tool for e in graph.edges_into(rollout)):
        return 0
    node = graph.components[rollout]
    active = list(node.active_instances())
    if not active:
        return 0
    running = sum(len(n.items) for n in active)
    need = 1
    slots = node.spec.max_load_per_instance
    if slots:
        need = max(need, math.ceil(running / (_PACK_FILL * slots)))
    need = max(need, math.ceil(sum(n.kv_usage for n in active) / _PACK_FILL - 1e-9))
    return max(0, len(active) - need)
