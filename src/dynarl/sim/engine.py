"""A modelled rollout engine: continuous batching on a KV-cache budget, analytically.

It behaves like an SGLang engine seen from outside: requests (:class:`Job`s) are
submitted, queue, are admitted while the KV cache and ``max_running_requests`` allow,
prefill (compute-bound; running requests stall meanwhile; the prefill samples each
one's first token), then decode one token per step together. A decode step costs
``overhead + (weight bytes / tp + KV bytes read) / HBM bandwidth``; KV read grows by
one token per running request per step. Admission and retraction follow SGLang
(:mod:`~dynarl.sim.admission`); a retracted request's KV is freed, it goes to the front
of the queue and re-prefills its whole context later. A job that ends in a tool call
leaves its KV in a prefix cache (LRU, evicted by tokens from the least recent entry's
tail), so its next turn re-prefills only what was evicted and the tool's output.

Time moves analytically. Between events every running request advances the same
number of steps, and step ``k`` from now costs ``a + c * B + b * (A + k * B)`` (``B``
running, ``A`` tokens of context held), so the time of ``n`` steps has a closed form and the
steps that fit in an interval solve a quadratic. Events are completions, cache
overflows and admissions; nothing is simulated token by token, and between events the
engine's state is only materialised when someone looks (submit, abort).

An engine that keeps its running batch in one left-padded cache (the reference torch
engine; :attr:`EngineConfig.padded_kv`) reads every row at the longest row's width: a
step then reads ``B x (M + k)`` tokens (``M`` the longest context) instead of ``A + k x
B``, the same closed form. Rebuilding that cache when rows join (a prefill) or leave (a
completion) costs its own time per token it holds (:attr:`EngineConfig.join_per_held_token_s`,
:attr:`EngineConfig.leave_per_held_token_s`).
"""

import heapq
import math
from collections.abc import Iterable

from dynarl.control.events import EngineStats
from dynarl.core.ids import InstanceId, ItemId
from dynarl.sim.admission import Admission
from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.engine_queue import EngineQueue
from dynarl.sim.errors import SimError
from dynarl.sim.jobs import EngineEntry, EngineTotals, Job, JobDone, JobProgress
from dynarl.sim.prefix_cache import PrefixCache

# events this close after the target time are due (as the world's own tolerance): a
# clock that lands one ulp short of an event must not leave it pending forever
_DUE_S = 1e-9


class SimEngine:
    """A modelled rollout engine on a virtual clock (see the module docstring).

    Drive it with :meth:`advance_to` (process everything up to a time, get the
    completions) and :meth:`next_event_time`; it never reads a real clock.

    Running jobs advance together, so the engine keeps one step counter: a job admitted
    at step ``s`` has generated ``done + 1 + (step - s)`` tokens (its prefill samples the
    first, as a real engine's does: a one-token response ends at its prefill);
    completions come off a heap of finish steps. An event costs O(log running),
    whatever the batch.
    """

    def __init__(self, config: EngineConfig, *, instance: InstanceId, start_s: float = 0.0):
        self.config = config
        self.instance = instance
        self._a, self._b = config.step_coefficients()
        self._c = config.step_per_request_s
        self._capacity = config.kv_tokens_capacity
        self._admission = Admission(config)
        # prefill of n new tokens after h cached ones: n * (fixed + per_context * (h + n/2))
        # FLOPs at _flops_rate FLOP/s (as EngineConfig.prefill_s)
        self._flops_fixed = config.model.forward_flops_per_token(0.0)
        self._flops_per_context = config.model.forward_flops_per_token(1.0) - self._flops_fixed
        self._flops_rate = config.tp * config.gpu.bf16_flops_per_s * config.prefill_mfu
        self._now = start_s
        self._t = start_s  # the running state is exact at _t, a step boundary
        self._step_count = 0
        self._num_prefills = 0
        self._step_s = [0.0, 0.0]  # seconds of prefill and of decode steps, in all
        self._resume_prefill_s = 0.0  # of the prefills' seconds, the resumed jobs' share
        self._running: dict[ItemId, EngineEntry] = {}  # in admission order: last is youngest
        self._finish_heap: list[tuple[int, int, ItemId]] = []  # (finish step, seq, id)
        self._held = 0  # context tokens of the running jobs
        self._padded = config.padded_kv
        self._longest_base = 0  # longest running context = this + _step_count (padded_kv)
        self._queue = EngineQueue()
        self._cache = PrefixCache()
        self._admit_pending = False
        self._seq = 0
        self._prefill_from = 1  # seq of the first job the last prefill admitted
        self._prefill_end_s = start_s  # when that prefill ends
        self._event: tuple[float, int] | None = None  # memoised (time, steps)
        self._generated = self._prefilled = self._hits = self._preemptions = 0
        self._decode_tokens = 0  # generated by decode steps (not prefills' first tokens)
        self._retractions = 0
        self._slowdown = 1.0  # the host's: work takes this many times its alone time
        # The last stats report: its time and the tokens generated by then.
        self._stats_s, self._stats_generated = start_s, 0.0

    # ---- the public surface -------------------------------------------------------

    @property
    def now(self) -> float:
        """The engine's virtual time (last ``advance_to`` or construction)."""
        return self._now

    def submit(self, jobs: Iterable[Job]) -> None:
        """Queue ``jobs`` at the current time; they are admitted at the next step
        boundary (at once when the engine is idle).

        Raises:
            SimError: a job can never fit in the KV cache, has nothing to generate, or
                is already here.
        """
        jobs = tuple(jobs)
        for job in jobs:
            if job.output_tokens <= 0 or job.context_tokens + job.output_tokens > self._capacity:
                raise SimError(
                    f"job {job.id}: context {job.context_tokens} + output {job.output_tokens} "
                    f"tokens must be positive and fit the KV cache ({self._capacity} tokens); "
                    "raise tp or lower the max length"
                )
            if job.id in self._running or job.id in self._queue:
                raise SimError(
                    f"job {job.id} is already on engine {self.instance}; abort it "
                    "before submitting it again"
                )
        self._materialise()
        for job in jobs:
            self._queue.push(EngineEntry(job))
        if not self._running or (self._t >= self._now and self._prefill_end_s <= self._now):
            # idle, or at a step boundary: admit now rather than one step later
            self._t = max(self._t, self._now)
            self._schedule()
        else:
            # mid-step, or in a prefill (its jobs' first tokens, and the one-token jobs'
            # ends, come out at _t): admit at the next step boundary
            self._admit_pending = True
        self._event = None

    def abort(self, ids: Iterable[ItemId]) -> list[JobProgress]:
        """Remove ``ids`` (running or queued) now and return what each generated here.

        Ids the engine does not hold (finished meanwhile) are skipped. A step in flight
        is lost for the aborted jobs; their KV is dropped, prefix cache included.
        """
        wanted = set(ids)
        self._materialise()
        out = [
            JobProgress(id=e.job.id, generated_tokens=e.done) for e in self._queue.remove(wanted)
        ]
        # a prefill still running has not sampled its jobs' first token yet
        in_prefill = self._now < self._prefill_end_s
        for item in [i for i in self._running if i in wanted]:  # in admission order
            entry = self._remove(item)
            if in_prefill and entry.seq >= self._prefill_from:
                entry.done -= 1
                self._generated -= 1
            out.append(JobProgress(id=item, generated_tokens=entry.done))
        for item in wanted:
            self._cache.take(item)
        self._event = None
        return out

    def abort_all(self) -> list[JobProgress]:
        """Abort everything running or queued (a drained engine)."""
        return self.abort(self._running.keys() | self._queue.ids)

    @property
    def slowdown(self) -> float:
        """How many times its alone time the engine's work takes now (slots that share
        a host's cores slow each other down; 1.0 on an independent device)."""
        return self._slowdown

    def set_slowdown(self, factor: float) -> None:
        """From the engine's ``now`` on, work takes ``factor`` times its alone time;
        the step or prefill in flight goes on at the new speed for what is left of it."""
        if factor <= 0:
            raise SimError(f"engine {self.instance}: slowdown {factor} must be positive")
        if factor == self._slowdown:
            return
        if self._running:
            self._materialise()
            # _t is the in-flight step's start (or a prefill's end, after now): keep
            # the fraction of it done, and stretch what is left
            self._t = self._now + (self._t - self._now) * factor / self._slowdown
        self._slowdown = factor
        self._event = None

    def next_event_time(self) -> float:
        """When the next completion, preemption or admission happens (``inf`` if idle)."""
        event = self._next_event()
        return math.inf if event is None else event[0]

    def advance_to(self, time_s: float) -> list[JobDone]:
        """Run until ``time_s``; return the jobs that finished, in time order."""
        if time_s < self._now:
            raise SimError(
                f"engine {self.instance} is at {self._now} s; cannot go back to {time_s} s"
            )
        done: list[JobDone] = []
        while (event := self._next_event()) is not None and event[0] <= time_s + _DUE_S:
            self._step(event[1])
            done += self._finish()
            self._schedule()
            self._event = None
        self._now = time_s
        return done

    def stats(self) -> EngineStats:
        """What a real engine reports now: KV usage (held / capacity, prefix cache not
        counted) and the tokens held, running and queued jobs, and its generation
        throughput since its last report (SGLang logs a windowed ``gen throughput``
        too; with no time since the last report, the current decode rate)."""
        batch = len(self._running)
        held, generated = self._held, float(self._generated)
        # The steps of the segment under way count as done when they are (a real
        # engine counts each step as it ends), with their tokens.
        decode_steps, decode_s = self._step_count, self._step_s[1]
        decode_tokens = self._decode_tokens
        if batch and self._t < self._now:
            steps = self._steps_within(self._now - self._t)
            held += batch * steps
            generated += batch * steps
            # The step in progress counts pro rata: a real engine's rate is smooth, while
            # whole steps alone would give a report between two step boundaries a whole
            # step or none (reports come at every event: a few milliseconds apart on a
            # multi-turn workload, about one step).
            done_s = self._span_s(steps)
            decode_steps += steps
            decode_s += done_s
            decode_tokens += batch * steps
            step_s = self._span_s(steps + 1) - done_s
            if step_s > 0:
                generated += batch * min(1.0, (self._now - self._t - done_s) / step_s)
        # A request that leaves mid-step (recalled, preempted) takes its share of that
        # step with it: never report fewer tokens than the last report did (the next
        # whole step makes up the difference).
        generated = max(generated, self._stats_generated)
        window = self._now - self._stats_s
        if window > 0:
            rate = (generated - self._stats_generated) / window
        else:
            decoding = batch > 0 and self._t <= self._now
            read = held + self._read_tokens() - self._held
            step_s = (self._a + self._c * batch + self._b * read) * self._slowdown
            rate = batch / step_s if decoding else 0.0
        self._stats_s, self._stats_generated = self._now, generated
        return EngineStats(
            time_s=self._now,
            instance=self.instance,
            kv_usage=held / self._capacity,
            num_running=batch,
            num_queued=len(self._queue),
            gen_tokens_per_s=rate,
            kv_tokens=held,
            prefill_steps=self._num_prefills,
            decode_steps=decode_steps,
            prefill_s=self._step_s[0],
            resume_prefill_s=self._resume_prefill_s,
            decode_s=decode_s,
            decode_tokens=decode_tokens,
        )

    def decode_rates_alone(self) -> tuple[float, float]:
        """Tokens a second the running batch generates at this engine's alone speed (no
        host slowdown), from its state at the last step boundary, and responses a
        second, each running job counted as ``1 / output_tokens`` of a response per
        token it generates; ``(0, 0)`` when idle."""
        batch = len(self._running)
        if not batch:
            return 0.0, 0.0
        step_s = self._a + self._c * batch + self._b * self._read_tokens()
        responses = sum(1.0 / max(e.job.output_tokens, 1) for e in self._running.values())
        return batch / step_s, responses / step_s

    def totals(self) -> EngineTotals:
        """Counters since construction (whole steps up to the last event)."""
        return EngineTotals(
            generated_tokens=self._generated,
            prefill_tokens=self._prefilled,
            cached_tokens=self._hits,
            num_preemptions=self._preemptions,
            num_retractions=self._retractions,
            num_steps=self._step_count,
        )

    @property
    def prefix_cache_tokens(self) -> int:
        """Tokens held in the prefix cache for jobs away on tool calls."""
        return self._cache.tokens

    def cached_prefix(self, item: ItemId) -> int:
        """Tokens of ``item``'s context this engine holds cached (0 if none)."""
        return self._cache.get(item)

    # ---- time --------------------------------------------------------------------

    def _span_s(self, steps: int) -> float:
        """Time of the next ``steps`` decode steps from the current state."""
        batch = len(self._running)
        fixed = self._a + self._c * batch
        read = self._read_tokens()
        alone = steps * fixed + self._b * (steps * read + batch * steps * (steps - 1) / 2)
        return alone * self._slowdown

    def _read_tokens(self) -> int:
        """Tokens of KV the next decode step reads: the context held, or every row at
        the longest row's width in a left-padded cache."""
        if not self._padded:
            return self._held
        return len(self._running) * (self._longest_base + self._step_count)

    def _rows_changed(self) -> None:
        """The running set changed: find the longest row again (padded cache only)."""
        if self._padded:
            self._longest_base = max(
                (e.queued_context - e.start_step for e in self._running.values()), default=0
            )

    def _steps_within(self, dt: float) -> int:
        """Whole decode steps that fit in ``dt`` seconds from the current state."""
        batch = len(self._running)
        if dt <= 0 or not batch:
            return 0
        dt_alone = dt / self._slowdown
        qa = self._b * batch / 2
        qb = self._a + self._c * batch + self._b * self._read_tokens() - qa
        n = int((-qb + math.sqrt(qb * qb + 4 * qa * dt_alone)) / (2 * qa))
        while n > 0 and self._span_s(n) > dt:
            n -= 1
        while self._span_s(n + 1) <= dt:
            n += 1
        return n

    def _next_event(self) -> tuple[float, int] | None:
        if self._event is not None:
            return self._event
        batch = len(self._running)
        if not batch:
            # jobs that waited for a step boundary whose running jobs were all aborted
            # since: admitted once the engine is free (a lone job always fits)
            if self._queue:
                self._event = (max(self._t, self._now), 0)
            return self._event
        heap = self._finish_heap
        while heap[0][2] not in self._running or self._running[heap[0][2]].seq != heap[0][1]:
            heapq.heappop(heap)  # stale: aborted or preempted
        steps = min(heap[0][0] - self._step_count, (self._capacity - self._held) // batch)
        if self._admit_pending:
            steps = min(steps, 0 if self._t >= self._now else 1)
        self._event = (self._t + self._span_s(steps), steps)
        return self._event

    def _materialise(self) -> None:
        """Apply the whole steps done by now (no event lies before now)."""
        if self._running and self._t < self._now:
            event = self._next_event()
            assert event is not None
            self._step(min(self._steps_within(self._now - self._t), event[1]))
            self._event = None

    def _step(self, steps: int) -> None:
        span_s = self._span_s(steps)
        self._t += span_s
        self._step_s[1] += span_s
        self._step_count += steps
        self._held += len(self._running) * steps
        self._generated += len(self._running) * steps
        self._decode_tokens += len(self._running) * steps

    # ---- events ------------------------------------------------------------------

    def _remove(self, item: ItemId) -> EngineEntry:
        """Take ``item`` out of the running set, folding its progress into ``done``."""
        entry = self._running.pop(item)
        self._admission.stop(entry)  # before its progress moves its finish step
        entry.done += self._step_count - entry.start_step
        self._held -= entry.queued_context
        self._rows_changed()
        return entry

    def _finish(self) -> list[JobDone]:
        out = []
        heap = self._finish_heap
        while heap and heap[0][0] <= self._step_count:
            _, seq, item = heapq.heappop(heap)
            entry = self._running.get(item)
            if entry is None or entry.seq != seq:
                continue
            self._remove(item)
            job, ctx = entry.job, entry.queued_context
            out.append(
                JobDone(
                    id=item,
                    time_s=self._t,
                    generated_tokens=entry.done,
                    context_tokens=ctx,
                    tool_call=job.tool_call_after,
                )
            )
            if job.tool_call_after:
                self._cache.put(item, ctx)
        if out and self._running and self.config.leave_per_held_token_s:
            # the rows left behind are copied into a cache of their own
            self._t += self.config.leave_per_held_token_s * self._read_tokens() * self._slowdown
        return out

    def _schedule(self) -> None:
        """At a step boundary: if the next step does not fit, retract the youngest
        running jobs (to the front of the queue) while the policy asks; then admit."""
        self._admit_pending = False
        if self._admission.must_retract(held=self._held, batch=len(self._running)):
            while self._admission.keeps_retracting(held=self._held, batch=len(self._running)):
                youngest = next(reversed(self._running))
                self._queue.push_front(self._remove(youngest))
                self._preemptions += 1
            self._retractions += 1
            self._admission.retracted(step=self._step_count)
        self._cache.shrink_to(self._capacity - self._held)
        admitted = self._admission.admit(
            self._queue, held=self._held, batch=len(self._running), step=self._step_count
        )
        if admitted:
            self._prefill(admitted)

    def _prefill(self, admitted: list[EngineEntry]) -> None:
        """Admit ``admitted``: prefill what the prefix cache does not hold; running
        jobs stall meanwhile."""
        flops = resumed = 0.0
        self._prefill_from = self._seq + 1
        joined = self.config.join_per_held_token_s * self._read_tokens() if self._running else 0.0
        for entry in admitted:
            context = entry.queued_context
            hit = min(self._cache.take(entry.job.id), context)
            new = context - hit
            job_flops = new * (self._flops_fixed + self._flops_per_context * (hit + new / 2))
            flops += job_flops
            if entry.job.resumed:
                resumed += job_flops
            self._prefilled += new
            self._hits += hit
            self._seq += 1
            # The prefill samples the job's first token (SGLang's extend batch and the
            # torch engine's prefill step both do): counted as one step already run.
            entry.seq, entry.start_step = self._seq, self._step_count - 1
            self._running[entry.job.id] = entry
            heapq.heappush(self._finish_heap, (entry.finish_step, entry.seq, entry.job.id))
            self._admission.start(entry, step=self._step_count)
            self._held += context + 1
            self._generated += 1
        self._rows_changed()
        prefill_s = self.config.prefill_overhead_s + flops / self._flops_rate + joined
        self._t += prefill_s * self._slowdown
        self._prefill_end_s = self._t
        self._num_prefills += 1
        self._step_s[0] += prefill_s * self._slowdown
        if resumed > 0:  # the shared costs in proportion to the FLOPs
            self._resume_prefill_s += prefill_s * self._slowdown * resumed / flops
        self._cache.shrink_to(self._capacity - self._held)
