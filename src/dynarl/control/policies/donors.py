"""The donor signal of a rollout component: engines whose KV cache stays under-used.

A rollout engine is *under-used* once its KV usage has stayed below ``u_low`` for
``donor_window_s`` seconds with nothing queued on it. A rollout component may give up
devices only when more than ``theta`` of its engines are under-used and no request
waits in front of them: its marginal value has fallen (the concave component of the
reference design). Both the bottleneck policy and the return of borrowed devices use
this one signal.
"""

from dynarl.control.config import SchedulerConfig
from dynarl.control.hypergraph import Hypergraph
from dynarl.core.ids import ComponentId


def underused_engines(
    graph: Hypergraph, rollout: ComponentId, cfg: SchedulerConfig, now_s: float
) -> int:
    """How many of ``rollout``'s engines are under-used, or 0 unless more than
    ``cfg.theta`` of them are (and no request waits for a slot)."""
    if graph.queue_depth(rollout):
        # Requests are waiting for a slot: the engines are full, however little KV
        # their (young, short-context) requests hold yet.
        return 0
    active = list(graph.components[rollout].active_instances())
    low = sum(
        1 for n in active if not n.num_queued and graph.low_for(n, now_s) >= cfg.donor_window_s
    )
    return low if low > cfg.theta * len(active) else 0
