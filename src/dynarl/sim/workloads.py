"""Workload generators: what one RL iteration asks the rollout engines to do.

A workload is plain data: one :class:`Request` per sequence, with its prompt length,
the tokens it will generate per turn, and (agentic) the latency and output length of
each tool call between turns. Generators take a seeded ``numpy.random.Generator``, so
the same seed gives the same iteration.
"""

import math

import msgspec
import numpy as np

from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.sim.errors import SimError
from dynarl.sim.lengths import LengthDistribution, Lognormal


def _item_ids(iteration: int, num_prompts: int, group_size: int) -> tuple[list[str], list[str]]:
    groups = [f"it{iteration}-p{p}" for p in range(num_prompts)]
    items = [f"{g}-s{s}" for g in groups for s in range(group_size)]
    return groups, items


def _prompt_lengths(
    rng: np.random.Generator, n: int, *, median: int, sigma: float, lo: int, hi: int
) -> np.ndarray:
    lengths = np.exp(math.log(median) + sigma * rng.standard_normal(n))
    return np.clip(np.rint(lengths), lo, hi).astype(np.int64)


class ToolLatency(msgspec.Struct, frozen=True, kw_only=True):
    """A tool's per-call latency: lognormal with mean ``mean_s``, cut at ``timeout_s``
    (a call that would run longer returns at the timeout, failed). Tools run on CPU,
    off the devices."""

    mean_s: float = 0.3
    sigma: float = 1.0
    timeout_s: float = 4.0

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` latencies in seconds and whether each call finished before the timeout."""
        mu = math.log(self.mean_s) - self.sigma**2 / 2.0
        raw = np.exp(mu + self.sigma * rng.standard_normal(n))
        return np.minimum(raw, self.timeout_s), raw <= self.timeout_s


class MathWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Single-turn math reasoning (GRPO): ``num_prompts`` groups of ``group_size``.

    Response lengths are lognormal: a group draws its log-median around
    ``median_output_tokens`` with spread ``group_sigma``, and each sample adds
    ``sample_sigma`` of its own (within-group correlation
    ``group_sigma² / (group_sigma² + sample_sigma²)``, 0.76 by default); lengths are
    capped at ``max_output_tokens``. ``lengths``, when given, replaces that lognormal
    (and its three fields) with another distribution (a mixture, a histogram). The
    defaults give, at 512 x 16 (seeds 0–2): p99/median 14–16, 6–8% of sequences at
    the cap, mean ≈ 5.2–6K tokens; on 64 H100 engines (1.5B) 95–98% of sequences finish
    by 60% of the longest one's time.
    """

    num_prompts: int = 512
    group_size: int = 16
    prompt_median_tokens: int = 200
    prompt_sigma: float = 0.5
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 1024
    median_output_tokens: int = 2000
    group_sigma: float = 1.6
    sample_sigma: float = 0.9
    min_output_tokens: int = 16
    max_output_tokens: int = 28672
    lengths: LengthDistribution | None = None

    def generate(self, rng: np.random.Generator, *, iteration: int = 0) -> tuple[Request, ...]:
        """One iteration's requests, grouped (a group's samples are adjacent); ids are
        ``it{iteration}-p{prompt}-s{sample}``."""
        n, g = self.num_prompts, self.group_size
        prompts = _prompt_lengths(
            rng,
            n,
            median=self.prompt_median_tokens,
            sigma=self.prompt_sigma,
            lo=self.min_prompt_tokens,
            hi=self.max_prompt_tokens,
        )
        distribution = self.lengths or Lognormal(
            median_tokens=self.median_output_tokens,
            group_sigma=self.group_sigma,
            sample_sigma=self.sample_sigma,
        )
        drawn = distribution.sample(rng, n, g)
        lengths = np.clip(np.rint(drawn), self.min_output_tokens, self.max_output_tokens)
        groups, items = _item_ids(iteration, n, g)
        flat = lengths.astype(np.int64).ravel().tolist()
        prompt_list = prompts.tolist()
        return tuple(
            Request(
                id=ItemId(items[i]),
                group=GroupId(groups[i // g]),
                prompt_tokens=prompt_list[i // g],
                output_tokens=(flat[i],),
                iteration=iteration,
            )
            for i in range(n * g)
        )


class AgenticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-turn tool-use (rStar2-Agent style: reason, call a code tool, read its
    output, continue).

    Each trajectory makes ``1 + Geometric`` tool calls with a per-group mean of
    ``mean_tool_calls`` (capped at ``max_tool_calls``), so most make 1–4 and a few make
    10 or more; the length cap ends some early, so the default 3.0 gives ≈2.7 calls per
    trajectory, as rStar2-Agent reports. Turn ``k`` generates about ``first_turn_median_tokens *
    turn_decay**k`` tokens (lognormal, group-correlated); each tool call takes a
    latency from ``tool`` and appends ``tool_output_median_tokens`` (lognormal) to the
    context. The total generated is capped at ``max_output_tokens``: the turn that
    reaches the cap is cut there and is the last (a first turn that reaches it leaves
    a truncated trajectory with no tool call, ≈3% by default).
    """

    num_prompts: int = 512
    group_size: int = 16
    prompt_median_tokens: int = 300
    prompt_sigma: float = 0.5
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 1024
    mean_tool_calls: float = 3.0
    max_tool_calls: int = 16
    first_turn_median_tokens: int = 1200
    turn_decay: float = 0.6
    group_sigma: float = 0.8
    turn_sigma: float = 0.6
    min_turn_tokens: int = 8
    tool_output_median_tokens: int = 80
    tool_output_sigma: float = 0.8
    max_tool_output_tokens: int = 1024
    max_output_tokens: int = 8192
    tool: ToolLatency = msgspec.field(default_factory=ToolLatency)

    def generate(self, rng: np.random.Generator, *, iteration: int = 0) -> tuple[Request, ...]:
        """One iteration's trajectories, grouped; ids as in :meth:`MathWorkload.generate`."""
        if self.mean_tool_calls < 1.0:
            raise SimError(
                f"mean_tool_calls={self.mean_tool_calls}: every trajectory makes at "
                "least one call; use MathWorkload for single-turn requests"
            )
        n, g, total = self.num_prompts, self.group_size, self.num_prompts * self.group_size
        prompts = _prompt_lengths(
            rng,
            n,
            median=self.prompt_median_tokens,
            sigma=self.prompt_sigma,
            lo=self.min_prompt_tokens,
            hi=self.max_prompt_tokens,
        ).tolist()
        group_calls = 1.0 + (self.mean_tool_calls - 1.0) * np.exp(
            0.5 * rng.standard_normal(n) - 0.125
        )
        calls = np.minimum(rng.geometric(1.0 / np.repeat(group_calls, g)), self.max_tool_calls)
        group_shift = np.repeat(self.group_sigma * rng.standard_normal(n), g)
        base = math.log(self.first_turn_median_tokens)
        groups, items = _item_ids(iteration, n, g)
        requests = []
        for i in range(total):
            num_turns = int(calls[i]) + 1
            decay = np.arange(num_turns) * math.log(self.turn_decay)
            turn_noise = self.turn_sigma * rng.standard_normal(num_turns)
            turns = np.maximum(
                np.rint(np.exp(base + group_shift[i] + decay + turn_noise)), self.min_turn_tokens
            ).astype(np.int64)
            cum = np.cumsum(turns)
            if cum[-1] > self.max_output_tokens:
                last = int(np.searchsorted(cum, self.max_output_tokens))
                turns = turns[: last + 1]
                turns[last] = self.max_output_tokens - (int(cum[last - 1]) if last else 0)
                num_turns = last + 1
            latency, ok = self.tool.sample(rng, num_turns - 1)
            tool_out = _prompt_lengths(
                rng,
                num_turns - 1,
                median=self.tool_output_median_tokens,
                sigma=self.tool_output_sigma,
                lo=1,
                hi=self.max_tool_output_tokens,
            )
            requests.append(
                Request(
                    id=ItemId(items[i]),
                    group=GroupId(groups[i // g]),
                    prompt_tokens=prompts[i // g],
                    output_tokens=tuple(turns.tolist()),
                    tool_latency_s=tuple(latency.tolist()),
                    tool_output_tokens=tuple(tool_out.tolist()),
                    tool_ok=tuple(ok.tolist()),
                    iteration=iteration,
                )
            )
        return tuple(requests)
