"""Per-request and per-engine bookkeeping of the simulated world: how far a request
has got (its turn and the tokens of it generated so far, kept across aborts) and what
a modelled engine holds (its requests and its busy time)."""

from dynarl.core.ids import InstanceId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.sim.engine import SimEngine
from dynarl.sim.jobs import Job
from dynarl.sim.rollout import turn_job


class SeqProgress:
    """One request's progress: its turn, tokens of the turn generated so far (kept
    across aborts), completed tool calls and the engine it last ran on."""

    __slots__ = ("done", "engine", "request", "tool_calls", "turn")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.turn = 0
        self.done = 0
        self.tool_calls = 0
        self.engine: InstanceId | None = None

    def generated(self) -> int:
        """Tokens it has generated so far, every turn's (as of its last abort)."""
        return sum(self.request.output_tokens[: self.turn]) + self.done

    def job(self) -> Job:
        """What is left of the current turn."""
        job = turn_job(self.request, self.turn)
        if not self.done:
            return job
        return Job(
            id=job.id,
            group=job.group,
            context_tokens=job.context_tokens + self.done,
            output_tokens=job.output_tokens - self.done,
            tool_call_after=job.tool_call_after,
        )


class EngineSlot:
    """A live engine: the modelled engine, the requests routed to it and its busy time
    (an engine with any request running counts as busy)."""

    __slots__ = ("busy_s", "busy_since", "held", "sim")

    def __init__(self, sim: SimEngine) -> None:
        self.sim = sim
        self.held: set[ItemId] = set()
        self.busy_since: float | None = None
        self.busy_s = 0.0
