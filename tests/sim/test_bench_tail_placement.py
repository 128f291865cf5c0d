"""``bench/tail_placement.py``'s segregation hook keeps each class of request on its own
engines (it patches the router and the balancer, so a change to either can silently
undo it: the balancer once grew a peers table the hook did not restrict)."""

import asyncio
import sys
from pathlib import Path

from recipes.paper import paper_setting

from dynarl.control import events as ev
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import simulated_run
from dynarl.sim.run import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import tail_placement


def test_segregated_routing_keeps_the_longest_requests_on_their_engines() -> None:
    cfg = paper_setting("math", "1.5b", 64, mode="static-colocated", num_iterations=1)
    run = simulated_run(cfg, [f"run.seed={cfg.job.run.seed}"])
    num_engines = 64 // build_cluster(run).engine.tp
    e_c = num_engines // 2
    long_ids = tail_placement.longest_ids(run, 1)
    log: list[ev.Event] = []
    with (
        tail_placement.segregated(long_ids, num_engines, e_c),
        asyncio.Runner(loop_factory=VirtualTimeLoop) as runner,
    ):
        runner.run(simulate(run, on_event=log.append))
    done = [
        e for e in log if isinstance(e, ev.ItemCompleted) and e.edge == tail_placement.ROLLOUT_EDGE
    ]
    assert len(long_ids) > 100  # the capped responses of the math workload
    assert {e.item for e in done} >= long_ids
    for e in done:
        on_long_engine = int(e.instance.rsplit("-", 1)[1]) % num_engines < e_c
        assert on_long_engine == (e.item in long_ids), (e.item, e.instance)
