"""A fault soak: a simulated run with random faults (:mod:`dynarl.sim.faults`), the
hypergraph's invariants checked after every event, and every item counted.

:func:`soak` runs it on the running :class:`~dynarl.core.virtual_time.VirtualTimeLoop`
and returns a :class:`SoakResult`: iterations completed, items that did not finish
each edge exactly once per iteration (lost or duplicated), and per fault kind how many
were injected and how long recovery took (virtual seconds, measured from the events).
"""

import collections
import statistics

import msgspec

from dynarl.control import events as ev
from dynarl.control.topology import TO_ACTOR
from dynarl.sim.config import SimulatedRun
from dynarl.sim.faults import FaultPlan, FaultRecord, SimFaults
from dynarl.sim.run import ModeResult, simulate


class KindSummary(msgspec.Struct, frozen=True, kw_only=True):
    """Faults of one kind: how many, how many recovered, and their recovery times."""

    injected: int
    recovered: int
    items_requeued: int
    median_recovery_s: float | None
    max_recovery_s: float | None
    devices_rebooted: int = 0
    median_device_downtime_s: float | None = None


class SoakResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a soak measured.

    Attributes:
        iterations: iterations completed.
        samples: samples trained (completed on the actor's edge), over all iterations.
        samples_expected: samples the iterations asked for.
        lost: (iteration, edge, item) that never completed an edge it entered.
        duplicated: (iteration, edge, item) that completed an edge more than once.
        kinds: per fault kind, its summary.
        result: the simulation's own result.
    """

    iterations: int
    samples: int
    samples_expected: int
    lost: int
    duplicated: int
    kinds: dict[str, KindSummary]
    result: ModeResult


async def soak(run: SimulatedRun, plan: FaultPlan) -> tuple[SoakResult, list[FaultRecord]]:
    """Simulate ``run`` with ``plan``'s faults, checking the hypergraph after every
    event; returns the summary and every fault's record."""
    faults = SimFaults(plan)
    entered: collections.Counter[tuple[int, str, str]] = collections.Counter()
    completed: collections.Counter[tuple[int, str, str]] = collections.Counter()
    iteration = [0]

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.IterationStarted):
            iteration[0] = event.iteration
        elif isinstance(event, ev.ItemsEnqueued):
            for ref in event.items:
                entered[(iteration[0], event.edge, ref.id)] = 1
        elif isinstance(event, ev.ItemCompleted):
            completed[(iteration[0], event.edge, event.item)] += 1

    result, _ = await simulate(run, check=True, on_event=on_event, faults=faults)
    lost = sum(1 for key in entered if completed[key] == 0)
    duplicated = sum(1 for n in completed.values() if n > 1)
    samples = sum(n for (_, edge, _), n in completed.items() if edge == TO_ACTOR)
    algo = run.job.algorithm
    by_kind: dict[str, list[FaultRecord]] = collections.defaultdict(list)
    for record in faults.records:
        by_kind[record.kind].append(record)
    kinds = {}
    for kind, records in sorted(by_kind.items()):
        times = [r.recovery_s for r in records if r.recovery_s is not None]
        downs = [r.device_downtime_s for r in records if r.device_downtime_s is not None]
        kinds[kind] = KindSummary(
            injected=len(records),
            recovered=len(times),
            items_requeued=sum(r.lost_items for r in records),
            median_recovery_s=statistics.median(times) if times else None,
            max_recovery_s=max(times) if times else None,
            devices_rebooted=len(downs),
            median_device_downtime_s=statistics.median(downs) if downs else None,
        )
    summary = SoakResult(
        iterations=len(result.iterations),
        samples=samples,
        samples_expected=len(result.iterations) * algo.samples_per_iteration,
        lost=lost,
        duplicated=duplicated,
        kinds=kinds,
        result=result,
    )
    return summary, faults.records


SOAK_JOB = [
    "cluster.num_devices=8",
    "actor.initial_devices=2",
    "rollout.initial_devices=4",
    "inference.initial_devices=2",
    "rollout.max_running_requests=32",
    "rollout.max_new_tokens=2048",
    "algorithm.num_prompts=8",
    "algorithm.group_size=4",
    "algorithm.n_minibatches=2",
]
"""The soak's job (``--set`` overrides of the default config): 8 modelled devices, 32
sequences per iteration, so that 200 iterations with a check after every event take
well under a minute."""
