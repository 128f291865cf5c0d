"""Per-request and per-engine bookkeeping of the simulated world: how far a request
has got (its turn and the tokens of it generated so far, kept across aborts) and what
a modelled engine is (its model, its worker as the data plane sees it, its busy
time)."""

from dynarl.data.peers import WorkerState
from dynarl.obs.trace_records import Request
from dynarl.sim.engine import SimEngine
from dynarl.sim.jobs import Job, JobProgress
from dynarl.sim.rollout import turn_job


class SeqProgress:
    """One request's progress: its turn, tokens of the turn generated so far (kept
    across aborts) and completed tool calls."""

    __slots__ = ("done", "request", "tool_calls", "turn")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.turn = 0
        self.done = 0
        self.tool_calls = 0

    def generated(self) -> int:
        """Tokens it has generated so far, every turn's (as of its last abort)."""
        return sum(self.request.output_tokens[: self.turn]) + self.done

    def job(self) -> Job:
        """What is left of the current turn."""
        job = turn_job(self.request, self.turn)
        if not self.done:
            return job
        return job.resume(JobProgress(id=job.id, generated_tokens=self.done))


class EngineSlot:
    """A live engine: the modelled engine, its worker as the data plane's placement
    sees it (its request queue and the requests in flight on it), its busy time (an
    engine with any request running counts as busy) and ``order``, its place among the
    fleet's engines (they are fed in the order they joined)."""

    __slots__ = ("busy_s", "busy_since", "order", "sim", "worker")

    def __init__(self, sim: SimEngine, worker: WorkerState, *, order: int = 0) -> None:
        self.sim = sim
        self.worker = worker
        self.order = order
        self.busy_since: float | None = None
        self.busy_s = 0.0
