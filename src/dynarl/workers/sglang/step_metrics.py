"""An SGLang server's own step counters, and the engine's step counts built on them.

The control plane fits a rollout's decode cost from its engines' decode steps apart
from their prefills (:mod:`dynarl.control.decode_window`); an engine that cannot count
them is observed by its summed generation rate, which mixes the prefills in. SGLang
counts both on its Prometheus endpoint (``/metrics``, with ``--enable-metrics``):

- ``sglang:cuda_graph_passes_total`` (``mode``: ``decode_cuda_graph`` or
  ``decode_none``): one per decode batch the scheduler ran -- the decode steps;
- ``sglang:gpu_execution_seconds_total`` (``category``: the forward mode, ``decode``,
  ``extend``, ... or, in older 0.5 releases, ``forward_decode``, ``forward_extend``,
  ...): the device seconds of each kind of forward pass, with the environment variable
  ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1``; and, where the server has it,
  ``sglang:gpu_overlap_wait_seconds_total`` (same categories): the device's idle gaps
  before each pass, so that a decode step's seconds are its wall time, as the torch
  engine counts them.

The tokens those decode steps generated are the engine's own count (its streams
deliver every token; a stream's first token comes from its prefill): the server's
``realtime_tokens_total`` moves only once per logging interval (40 decode steps by
default), too coarse for a window of a few seconds. The server's counters are read
every ``stats_interval_s`` and the engine's token count is taken as each answer
arrives, so both describe the same moment.

A request moved here with partial output re-prefills it: a move's cost, which the
control plane keeps out of the workload's prefill model (``resume_prefill_s``). The
server does not time requests apart, so the prefill seconds between two reads are
shared out by the tokens the engine's prefills computed (prompt less its cached
prefix): a resumed request's share is its part of them.
"""

import logging

import msgspec
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

DECODE_PASSES = "sglang:cuda_graph_passes_total"
"""Decode batches the server ran (label ``mode``)."""

EXECUTION_S = "sglang:gpu_execution_seconds_total"
"""Device seconds of forward passes (label ``category``)."""

OVERLAP_WAIT_S = "sglang:gpu_overlap_wait_seconds_total"
"""Device idle seconds before forward passes (label ``category``)."""

DECODE_CATEGORIES = frozenset({"decode", "forward_decode"})
"""Forward passes that advance every running request by a token."""

PREFILL_CATEGORIES = frozenset(
    {"extend", "forward_extend", "mixed", "forward_mixed", "split_prefill"}
)
"""Forward passes that prefill (a mixed one prefills with the decode batch beside it)."""

_FAMILIES = tuple(
    name.removesuffix("_total") for name in (DECODE_PASSES, EXECUTION_S, OVERLAP_WAIT_S)
)
"""The counters' family names (a line of any of them names its family)."""

TIMER_CHECK_STEPS = 64
"""Decode steps after which a server whose decode passes have no device seconds is
taken to run without the device timer (its reports lag a step or two, not 64)."""


class ServerSteps(msgspec.Struct, frozen=True):
    """A server's counters at one read: decode batches, and the seconds of its decode
    and prefill forward passes (with the idle gaps before them where it reports them)."""

    decode_steps: int
    decode_s: float
    prefill_s: float


def parse_server_steps(text: str) -> ServerSteps | None:
    """The step counters in ``/metrics`` text; ``None`` when the server does not keep
    them (a release without them), or keeps them per data-parallel rank (each rank
    runs batches of its own: not one engine's steps). Counters not yet incremented
    read 0. Of a server whose every scheduler reports
    (``--enable-metrics-for-all-schedulers``), the first tensor-parallel rank's are
    read (each rank runs every step).

    Raises:
        ValueError: the counters' lines are not Prometheus' exposition format.
    """
    # A server's page holds many histograms (thousands of lines): parse only the
    # counters' own lines (read every second, in the engine's event loop).
    wanted = "\n".join(
        line for line in text.splitlines() if any(name in line for name in _FAMILIES)
    )
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(wanted):
        rows = samples.setdefault(family.name + "_total", [])
        for sample in family.samples:
            if sample.name.endswith("_total"):
                rows.append((sample.labels, sample.value))
    if DECODE_PASSES not in samples or EXECUTION_S not in samples:
        return None
    if len({labels.get("dp_rank") for rows in samples.values() for labels, _ in rows}) > 1:
        return None
    rank = min(
        (int(labels.get("tp_rank", "0")) for rows in samples.values() for labels, _ in rows),
        default=0,
    )

    def total(metric: str, label: str, values: frozenset[str] | None = None) -> float:
        return sum(
            (
                value
                for labels, value in samples.get(metric, [])
                if int(labels.get("tp_rank", "0")) == rank
                and (values is None or labels.get(label) in values)
            ),
            0.0,
        )

    return ServerSteps(
        decode_steps=round(total(DECODE_PASSES, "mode")),
        decode_s=total(EXECUTION_S, "category", DECODE_CATEGORIES)
        + total(OVERLAP_WAIT_S, "category", DECODE_CATEGORIES),
        prefill_s=total(EXECUTION_S, "category", PREFILL_CATEGORIES)
        + total(OVERLAP_WAIT_S, "category", PREFILL_CATEGORIES),
    )


class StepCounts(msgspec.Struct, frozen=True):
    """What the engine reports of its steps since its first read of the server
    (:class:`~dynarl.workers.rollout.EngineLoad`'s fields of the same names)."""

    decode_steps: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    resume_prefill_s: float = 0.0
    decode_tokens: int = 0


class StepTally:
    """An SGLang engine's step counts: the server's counters at each read, beside the
    tokens the engine's streams had delivered and the prefills they had started.

    The counts run from the first read (the server may have served before the engine
    attached); a server whose counters go back (restarted behind its URL) is read on
    from where they went. The counts are published once the server has shown it times
    its decode steps (decode seconds above 0), and never go back after: the control
    plane takes differences of them. :attr:`counting` turns false for good when the
    server shows it keeps no step counters before that (no ``--enable-metrics``, a
    release without them, or no device timer): the engine then reports no steps, and
    the control plane reads its generation rate instead; a failed read after that is a
    read missed.

    Args:
        name: the engine's, for the log line.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.counting = True
        self._decode_tokens = 0  # by the streams, so far
        self._prefill_tokens = 0  # computed by the prefills the streams started
        self._resumed_tokens = 0  # of which, of requests that came with output
        self._last: tuple[ServerSteps, int, int, int] | None = None  # at the last read
        self._counts = StepCounts()

    @property
    def counts(self) -> StepCounts:
        """The counts at the last read; zeros until the server's decode steps have
        seconds (and so for good when it keeps no step counters)."""
        return self._counts if self._counts.decode_s > 0 else StepCounts()

    def generated(self, tokens: int, *, first: bool) -> None:
        """A stream delivered ``tokens`` new tokens; ``first``: its first ones (the
        first came from its prefill, the rest from decode steps)."""
        self._decode_tokens += tokens - 1 if first else tokens

    def prefilled(self, tokens: int, *, resumed: bool) -> None:
        """A stream's prefill computed ``tokens`` (its input less the cached prefix);
        ``resumed``: its request came with output (moved here, or parked and resumed)."""
        self._prefill_tokens += tokens
        if resumed:
            self._resumed_tokens += tokens

    def stop(self, why: str) -> None:
        """Stop counting: the server keeps no step counters (``why``, logged once). Once
        counts are published, a read that fails is only missed (``why`` at debug)."""
        if self._counts.decode_s > 0:
            logger.debug("%s: missed a read of the server's step counters: %s", self.name, why)
        elif self.counting:
            self.counting = False
            logger.info("%s: %s; the scheduler reads its generation rate instead", self.name, why)

    def read(self, steps: ServerSteps) -> None:
        """The server's counters as just read (take the engine's counts now)."""
        now = (steps, self._decode_tokens, self._prefill_tokens, self._resumed_tokens)
        if self._last is None:
            self._last = now
            return
        before, tokens0, prefill0, resumed0 = self._last
        self._last = now
        d_steps = steps.decode_steps - before.decode_steps
        d_decode = steps.decode_s - before.decode_s
        d_prefill = steps.prefill_s - before.prefill_s
        if min(d_steps, d_decode, d_prefill) < 0:
            return  # the server restarted: count on from its new counters
        computed, resumed = self._prefill_tokens - prefill0, self._resumed_tokens - resumed0
        share = min(1.0, resumed / computed) if computed > 0 else 0.0
        c = self._counts
        self._counts = StepCounts(
            decode_steps=c.decode_steps + d_steps,
            decode_s=c.decode_s + d_decode,
            prefill_s=c.prefill_s + d_prefill,
            resume_prefill_s=c.resume_prefill_s + d_prefill * share,
            decode_tokens=c.decode_tokens + self._decode_tokens - tokens0,
        )
        if self._counts.decode_steps >= TIMER_CHECK_STEPS and self._counts.decode_s <= 0:
            self.stop(
                "the SGLang server counts its decode steps but not their seconds (start it "
                "with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1)"
            )
