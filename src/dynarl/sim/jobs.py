"""What a modelled engine is asked to do, what it holds, and what it reports back, as
data."""

import msgspec

from dynarl.core.ids import GroupId, ItemId


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One stretch of generation: prefill ``context_tokens``, generate
    ``output_tokens``. ``tool_call_after``: the job ends in a tool call (its context is
    kept in the prefix cache for the next turn). ``rank``: where the engine's queue
    serves it (smaller first; the request order's key, see
    :class:`~dynarl.sim.engine_queue.EngineQueue`). ``resumed``: the job continues a
    turn an engine began and was taken from (its context holds what was generated
    there), so its prefill is a re-prefill, which the engine counts apart."""

    id: ItemId
    group: GroupId
    context_tokens: int
    output_tokens: int
    tool_call_after: bool = False
    rank: tuple[float, ...] = ()
    resumed: bool = False

    def resume(self, progress: "JobProgress") -> "Job":
        """The work left after an abort: the context grew by what was generated."""
        return Job(
            id=self.id,
            group=self.group,
            context_tokens=self.context_tokens + progress.generated_tokens,
            output_tokens=self.output_tokens - progress.generated_tokens,
            tool_call_after=self.tool_call_after,
            rank=self.rank,
            resumed=self.resumed or progress.generated_tokens > 0,
        )


class JobDone(msgspec.Struct, frozen=True, kw_only=True):
    """A job finished at ``time_s`` after generating ``generated_tokens`` here;
    ``context_tokens`` is its final context (the prefix held when ``tool_call`` is
    set: the job stopped to call a tool)."""

    id: ItemId
    time_s: float
    generated_tokens: int
    context_tokens: int
    tool_call: bool


class JobProgress(msgspec.Struct, frozen=True, kw_only=True):
    """An aborted job: how much of it this engine generated (its prefill's token, once
    that prefill ended, and whole decode steps only)."""

    id: ItemId
    generated_tokens: int


class EngineTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the engine was made: tokens generated and prefilled (prefix-cache
    hits excluded), prefix-cache hit tokens, preemptions (jobs retracted), retractions
    (the events, each retracting one or more jobs), decode steps."""

    generated_tokens: int
    prefill_tokens: int
    cached_tokens: int
    num_preemptions: int
    num_retractions: int
    num_steps: int


class EngineEntry:
    """A job inside an engine (:class:`~dynarl.sim.engine.SimEngine`). ``done`` counts
    the tokens it generated there before its current admission; while running it gains
    one per step since ``start_step`` (one step before its admission: the prefill
    samples a token)."""

    __slots__ = ("done", "job", "seq", "start_step")

    def __init__(self, job: Job, done: int = 0) -> None:
        self.job, self.done, self.seq, self.start_step = job, done, 0, 0

    @property
    def queued_context(self) -> int:
        """Context while not running (what a re-prefill must cover)."""
        return self.job.context_tokens + self.done

    @property
    def finish_step(self) -> int:
        """Engine step count at which it completes, while running."""
        return self.start_step + self.job.output_tokens - self.done
