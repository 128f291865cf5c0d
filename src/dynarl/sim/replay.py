"""A workload that replays measured requests, iteration by iteration.

A real run's per-request lengths (its ``trace.jsonl``, or ``bench/e2e_cpu.py``'s
records) replayed through the simulator let a prediction be checked against the very
run it describes, and let a user ask what another schedule would make of their own
workload.
"""

from collections.abc import Sequence

import msgspec
import numpy as np

from dynarl.obs.trace_records import Request
from dynarl.sim.errors import SimError


class ReplayWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Measured requests, replayed: iteration ``i`` gets ``iterations[i]`` (the last
    one again past the end)."""

    iterations: tuple[tuple[Request, ...], ...]
    num_prompts: int
    group_size: int
    max_output_tokens: int

    def generate(self, rng: np.random.Generator, *, iteration: int = 0) -> tuple[Request, ...]:
        """The requests of ``iteration`` (``rng`` is unused: a replay is exact)."""
        if not self.iterations:
            raise SimError("a replay workload needs at least one recorded iteration")
        return self.iterations[min(iteration, len(self.iterations) - 1)]

    @property
    def multi_turn(self) -> bool:
        """Whether any request makes a tool call (an agentic workload)."""
        return any(r.num_tool_calls for it in self.iterations for r in it)

    @property
    def longest_output_tokens(self) -> int:
        """The most tokens one request generates, over its turns."""
        return max((r.total_output_tokens for it in self.iterations for r in it), default=0)

    @classmethod
    def of_requests(cls, requests: Sequence[Request], *, source: str) -> "ReplayWorkload":
        """The replay of a trace's ``requests``: one replayed iteration per distinct
        ``iteration`` value, in increasing order, each in its groups (a group's
        requests adjacent, groups in the order they first appear). A turn recorded
        with no token (an aborted sample) replays as one token.

        Raises:
            SimError: the trace is empty, repeats an id, or its iterations do not all
                hold the same number of groups of the same size (``source`` names it).
        """
        if not requests:
            raise SimError(f"{source}: the trace holds no request to replay")
        seen: set[str] = set()
        by_iteration: dict[int, dict[str, list[Request]]] = {}
        for recorded in requests:
            r = recorded
            if r.id in seen:
                raise SimError(
                    f"{source}: request id {r.id!r} appears twice; give every request "
                    "of the trace its own id"
                )
            seen.add(r.id)
            if any(n < 1 for n in r.output_tokens):
                turns = tuple(max(1, n) for n in r.output_tokens)
                r = msgspec.structs.replace(r, output_tokens=turns)
            by_iteration.setdefault(r.iteration, {}).setdefault(r.group, []).append(r)
        shapes = {
            i: (len(groups), sorted({len(g) for g in groups.values()}))
            for i, groups in by_iteration.items()
        }
        first = min(shapes)
        num_prompts, sizes = shapes[first]
        for i, (prompts, group_sizes) in sorted(shapes.items()):
            if len(group_sizes) != 1 or (prompts, group_sizes) != (num_prompts, sizes):
                raise SimError(
                    f"{source}: iteration {i} holds {prompts} groups of sizes "
                    f"{group_sizes}, iteration {first} {num_prompts} of sizes {sizes}; "
                    "every iteration of a trace must hold the same number of groups, "
                    "all of one size (algorithm.num_prompts x algorithm.group_size)"
                )
        iterations = tuple(
            tuple(r for group in by_iteration[i].values() for r in group)
            for i in sorted(by_iteration)
        )
        replay = cls(
            iterations=iterations, num_prompts=num_prompts, group_size=sizes[0], max_output_tokens=0
        )
        return msgspec.structs.replace(replay, max_output_tokens=replay.longest_output_tokens)
