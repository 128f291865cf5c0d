"""A run's per-request trace records, written by real runs (``trace.jsonl``) and read by
the simulator (:mod:`dynarl.sim.traces`): one :class:`TraceHeader` line, then one
:class:`Request` per line. The format lives here, apart from both, so neither the real
pipeline nor the simulator depends on the other."""

import msgspec

from dynarl.core.errors import DynaRLError
from dynarl.core.ids import GroupId, ItemId


class TraceError(DynaRLError, ValueError):
    """A trace record that cannot be (a request whose turns and tool calls disagree)."""


TRACE_VERSION = 1
"""Format version written in every header."""


class TraceHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """First line of a trace: the format version and free-form metadata (workload
    name, seed, model, ...)."""

    trace_version: int = TRACE_VERSION
    meta: dict[str, str] = msgspec.field(default_factory=dict)


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence of an iteration.

    ``output_tokens[k]`` is what turn ``k`` generates; between turns ``k`` and ``k+1`` a
    tool runs for ``tool_latency_s[k]`` (``tool_ok[k]`` is False when it hit its
    timeout) and appends ``tool_output_tokens[k]`` to the context. A single-turn
    request has no tool calls. ``iteration`` is the iteration that asked for it (a
    trace of several iterations replays them in turn).
    """

    id: ItemId
    group: GroupId
    prompt_tokens: int
    output_tokens: tuple[int, ...]
    tool_latency_s: tuple[float, ...] = ()
    tool_output_tokens: tuple[int, ...] = ()
    tool_ok: tuple[bool, ...] = ()
    iteration: int = 0

    def __post_init__(self) -> None:
        num_calls = len(self.output_tokens) - 1
        if num_calls < 0 or not (
            len(self.tool_latency_s)
            == len(self.tool_output_tokens)
            == len(self.tool_ok)
            == num_calls
        ):
            raise TraceError(
                f"request {self.id}: {len(self.output_tokens)} turns need "
                f"{max(num_calls, 0)} tool calls, got latencies/outputs/ok of lengths "
                f"{len(self.tool_latency_s)}/{len(self.tool_output_tokens)}/{len(self.tool_ok)}"
            )

    @property
    def num_tool_calls(self) -> int:
        """Tool calls between its turns."""
        return len(self.output_tokens) - 1

    @property
    def total_output_tokens(self) -> int:
        """Tokens the policy generates over all turns."""
        return sum(self.output_tokens)

    @property
    def total_tokens(self) -> int:
        """Final context length: prompt, every turn's output and every tool's output."""
        return self.prompt_tokens + self.total_output_tokens + sum(self.tool_output_tokens)
