"""When a modelled engine admits queued jobs and when it retracts running ones: SGLang's
scheduling on a KV-cache budget, counted in tokens.

Admission reserves KV for a share (the "new token ratio") of each running job's future
tokens, each job's clipped at ``new_token_clip`` (:class:`~dynarl.sim.reserve.Reservations`).
A queued job is admitted, in queue order, while its context plus that share of every
job's future (its own included) fits the cache, held KV stays under ``admit_fraction``
of it, and the next decode step still fits. When the cache is full anyway, the youngest
running jobs are retracted until the rest have headroom for ``retract_headroom_steps``
steps. A retraction raises the ratio to 1, so admission is conservative right after it;
the ratio then decays step by step back to its floor, which keeps retractions rare
events rather than one per step. A lone job is always admitted and never retracted.

The policy decides; the engine acts (prefills the jobs admitted, retracts the jobs
named) and tells it which jobs start and stop running.
"""

from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.engine_queue import EngineQueue
from dynarl.sim.jobs import EngineEntry
from dynarl.sim.reserve import Reservations


class Admission:
    """One engine's admission and retraction policy (see the module docstring).

    Args:
        config: the engine's; its KV capacity, batch cap, ``admit_fraction``,
            retraction headroom and new-token-ratio settings apply.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._capacity = config.kv_tokens_capacity
        self._max_running = config.max_running_requests
        self._admit_limit = config.admit_fraction * self._capacity
        self._headroom_steps = max(1, config.retract_headroom_steps)
        self._min_ratio = config.min_new_token_ratio
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / max(
            1, config.new_token_ratio_decay_steps
        )
        # the new token ratio is _ratio_base at step _ratio_step, decaying since
        self._ratio_base, self._ratio_step = config.init_new_token_ratio, 0
        self._reserved = Reservations(config.new_token_clip)  # the running jobs' future

    def ratio(self, step: int) -> float:
        """The new token ratio at engine step ``step``: it decays linearly to its floor."""
        decayed = self._ratio_base - self._ratio_decay * (step - self._ratio_step)
        return max(self._min_ratio, decayed)

    def start(self, entry: EngineEntry, *, step: int) -> None:
        """``entry`` runs from ``step`` (its ``seq`` and ``start_step`` set): reserve
        its future tokens."""
        self._reserved.add(entry.job.id, entry.seq, finish_step=entry.finish_step, step=step)

    def stop(self, entry: EngineEntry) -> None:
        """``entry`` stops running (finished, retracted or aborted): release its
        reservation. Call it before folding the entry's progress into ``done``."""
        self._reserved.remove(entry.job.id, finish_step=entry.finish_step)

    def must_retract(self, *, held: int, batch: int) -> bool:
        """Whether the next decode step overflows the cache: ``batch`` running jobs
        holding ``held`` tokens each need one more."""
        return batch > 0 and held + batch > self._capacity

    def keeps_retracting(self, *, held: int, batch: int) -> bool:
        """Whether a retraction takes one more job: more than one runs and the
        ``batch`` holding ``held`` tokens lacks room for ``retract_headroom_steps``
        steps."""
        return batch > 1 and held + batch * self._headroom_steps > self._capacity

    def retracted(self, *, step: int) -> None:
        """A retraction happened at ``step``: admission turns conservative (the ratio
        is at least 1 from there, decaying again)."""
        self._ratio_base, self._ratio_step = max(1.0, self.ratio(step)), step

    def admit(self, queue: EngineQueue, *, held: int, batch: int, step: int) -> list[EngineEntry]:
        """Take from ``queue`` the jobs to admit at ``step``, in order, while they fit
        beside the ``batch`` running jobs holding ``held`` tokens (see the module
        docstring); the engine prefills them."""
        admitted: list[EngineEntry] = []
        limit = self._max_running - batch
        if not queue or limit <= 0:
            return admitted
        ratio = self.ratio(step)
        future = self._reserved.total(step)  # the running jobs' reserved future
        while queue and len(admitted) < limit:
            entry = queue.peek()
            context = entry.queued_context
            need = min(entry.job.output_tokens - entry.done, self._reserved.clip)
            if (batch or admitted) and (
                held + context > self._admit_limit
                or held + context + ratio * (future + need) > self._capacity
                # room for the next step too, or a job retracted here would come straight
                # back and be retracted again
                or held + context + batch + len(admitted) + 1 > self._capacity
            ):
                break
            admitted.append(queue.pop())
            held += context
            future += need
        return admitted
