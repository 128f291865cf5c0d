"""What a rollout's engines did over the last few seconds, split into decode and prefill.

An engine's recent generation rate mixes two kinds of step: decode steps, which advance
every running request by a token and cost what the predictor's concave model says
(:class:`~dynarl.control.predictor.StepCosts`), and prefills, which admit requests and
stall the batch meanwhile. On a multi-turn workload sessions come back from their tools
all the time, and a rate read at one instant is whatever mix of the two the last few
milliseconds held: at a constant running count, simulated agentic 32B engines' summed
rates swung 9.8K-65K tokens/s, and the decode fit read the swings as noise and
collapsed (relative error 1.0; one iteration predicted at 7,847 s).

Engines that count their steps (``EngineStats.decode_steps``, ``decode_tokens``,
``decode_s``, ``prefill_s``: the torch engine, the simulator's, and SGLang's where the
server keeps its step counters, :mod:`dynarl.workers.sglang.step_metrics`) say how the time
went, and which prefill seconds re-prefilled requests moved to them
(``resume_prefill_s``: a move's cost, priced where the move is scored, left out of the
workload's prefills). :class:`DecodeWindows` keeps each rollout's
counters at every tick and, over a trailing window of at least ``span_s`` on the same
engines, turns them into a :class:`DecodeSample`: the decode rate (tokens per second of
decoding, summed over the engines), the mean batch those steps ran, and the prefill
seconds beside the tokens generated -- what the predictor fits separately.
"""

from collections import deque

import msgspec

from dynarl.control.elements import HyperNode
from dynarl.core.ids import InstanceId


class DecodeSample(msgspec.Struct, frozen=True):
    """A rollout's engines over the window from ``start_s``: ``throughput`` tokens per
    second of decoding summed over the engines, at a mean decode batch summed over
    them (``load``), holding ``context`` tokens per running request (over its ticks);
    meanwhile they spent ``prefill_device_s`` device-seconds prefilling the workload's
    requests (re-prefills of moved ones left out) and generated ``tokens``."""

    start_s: float
    load: float
    throughput: float
    context: float
    prefill_device_s: float
    tokens: float


class _Snapshot(msgspec.Struct, frozen=True):
    time_s: float
    # KV tokens the running requests hold, and how many run
    held: float
    running: float
    # per engine: (devices, decode tokens, decode steps, decode s, prefill s, of which
    # re-prefills)
    counters: dict[InstanceId, tuple[int, int, int, float, float, float]]


class DecodeWindows:
    """Per rollout component, its engines' step counters at recent ticks.

    Args:
        span_s: the shortest window a sample covers (a few hundred decode steps, so
            that a step in progress at either end does not matter).
    """

    def __init__(self, span_s: float) -> None:
        if span_s <= 0:
            raise ValueError(f"span_s must be positive, got {span_s}")
        self.span_s = span_s
        self._snapshots: dict[str, deque[_Snapshot]] = {}

    def forget(self, component: str) -> None:
        """Drop ``component``'s snapshots (it holds no devices)."""
        self._snapshots.pop(component, None)

    def sample(self, node: HyperNode, now_s: float) -> DecodeSample | None:
        """Record ``node``'s counters at ``now_s`` and return what its engines did
        since the oldest snapshot at least ``span_s`` old, on the same engines (the
        window restarts when an engine joins, leaves or restarts its counters).
        ``None`` when no such window exists yet, or an engine does not count its
        steps."""
        active = list(node.active_instances())
        if not active or not counts_steps(node):
            self.forget(node.id)
            return None
        snap = _Snapshot(
            now_s,
            float(sum(n.kv_tokens for n in active)),
            float(sum(n.num_running for n in active)),
            {
                n.id: (
                    len(n.devices),
                    n.decode_tokens,
                    n.decode_steps,
                    n.decode_s,
                    n.prefill_s,
                    n.resume_prefill_s,
                )
                for n in active
            },
        )
        window = self._snapshots.setdefault(node.id, deque())
        if window and not _continues(window[-1], snap):
            window.clear()
        window.append(snap)
        while len(window) > 2 and now_s - window[1].time_s >= self.span_s:
            window.popleft()
        first = window[0]
        if now_s - first.time_s < self.span_s:
            return None
        # The context over the window, at its ticks (it grows as requests decode).
        ticks = list(window)[1:]
        running = sum(w.running for w in ticks)
        context = sum(w.held for w in ticks) / running if running > 0 else 0.0
        return _between(first, snap, context)


def counts_steps(node: HyperNode) -> bool:
    """Whether ``node``'s engines count their steps: each that has reported a decode
    step has reported the tokens it generated (an SGLang engine reports neither where
    its server keeps no step counters), and one at least has."""
    active = list(node.active_instances())
    return any(n.decode_steps > 0 for n in active) and all(
        n.decode_tokens > 0 or n.decode_steps <= 0 for n in active
    )


def active_context(node: HyperNode) -> float:
    """Mean tokens of context a running request holds on ``node``'s engines (0 when
    they run none or do not report their KV tokens)."""
    running = sum(n.num_running for n in node.active_instances())
    held = sum(n.kv_tokens for n in node.active_instances())
    return held / running if running > 0 else 0.0


def _continues(before: _Snapshot, after: _Snapshot) -> bool:
    """``after`` counts on from ``before``: the same engines on the same devices, no
    counter going back."""
    if before.counters.keys() != after.counters.keys():
        return False
    return all(
        all(x >= y for x, y in zip(after.counters[i], c, strict=True))
        for i, c in before.counters.items()
    )


def _between(first: _Snapshot, last: _Snapshot, context: float) -> DecodeSample | None:
    load = throughput = prefill = tokens = 0.0
    for instance, (devices, gen, steps, decode_s, prefill_s, resume_s) in last.counters.items():
        _, gen0, steps0, decode0, prefill0, resume0 = first.counters[instance]
        d_gen, d_steps, d_decode = gen - gen0, steps - steps0, decode_s - decode0
        tokens += d_gen
        # the workload's own prefills: a moved request's re-prefill is the move's cost
        prefill += max(0.0, (prefill_s - prefill0) - (resume_s - resume0)) * devices
        if d_steps > 0 and d_decode > 0 and d_gen > 0:
            # A decode step advances every running request by one token.
            load += d_gen / d_steps
            throughput += d_gen / d_decode
    if throughput <= 0:
        return None
    return DecodeSample(first.time_s, load, throughput, context, prefill, tokens)
