"""What a modelled engine is asked to do and what it reports back, as data."""

import msgspec

from dynarl.core.ids import GroupId, ItemId


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One stretch of generation: prefill ``context_tokens``, generate
    ``output_tokens``. ``tool_call_after``: the job ends in a tool call (its context is
    kept in the prefix cache for the next turn)."""

    id: ItemId
    group: GroupId
    context_tokens: int
    output_tokens: int
    tool_call_after: bool = False

    def resume(self, progress: "JobProgress") -> "Job":
        """The work left after an abort: the context grew by what was generated."""
        return Job(
            id=self.id,
            group=self.group,
            context_tokens=self.context_tokens + progress.generated_tokens,
            output_tokens=self.output_tokens - progress.generated_tokens,
            tool_call_after=self.tool_call_after,
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
    """An aborted job: how much of it this engine generated (whole decode steps only)."""

    id: ItemId
    generated_tokens: int
