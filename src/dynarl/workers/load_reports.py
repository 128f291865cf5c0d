"""A rollout engine's load, reported to the controller as ``EngineStats`` on its link.

A :class:`LoadReporter` reports on schedule (every ``stats_interval_s`` while the slot
serves), at once when the engine has run out of requests having stepped since its last
report (a rollout's end: its step counts are then final for what it was given), and
when the slot asks before it releases the engine (the controller may move the slot's
device within milliseconds of the rollout's last completion, before any report on
schedule). The step counts it reports are those since it was made: an engine serves as
one instance per link, and a slot's engine outlives its instances (a parked role
resumes under a new one).
"""

import contextlib
from collections.abc import Callable

import anyio

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId
from dynarl.data.errors import DataPlaneError
from dynarl.data.worker_link import WorkerLink
from dynarl.workers.rollout import EngineLoad, RolloutEngine

DRY_CHECK_S = 0.05
"""How often the reporter looks whether the engine ran dry."""


class LoadReporter:
    """Reports ``engine``'s load as ``instance`` on ``link``."""

    def __init__(self, engine: RolloutEngine, link: WorkerLink, instance: InstanceId) -> None:
        self._engine = engine
        self._link = link
        self._instance = instance
        self._base = engine.load()
        self._reported = (self._base.prefill_steps, self._base.decode_steps)

    async def report(self, load: EngineLoad | None = None) -> None:
        """Report the engine's load now (``load``, if just read); a link already closed
        is let be (the controller hears of it otherwise)."""
        load = load or self._engine.load()
        base = self._base
        self._reported = (load.prefill_steps, load.decode_steps)
        event = ev.EngineStats(
            time_s=0.0,
            instance=self._instance,
            kv_usage=load.kv_usage,
            num_running=load.num_running,
            num_queued=load.num_queued,
            gen_tokens_per_s=load.gen_tokens_per_s,
            kv_tokens=load.kv_tokens,
            prefill_steps=load.prefill_steps - base.prefill_steps,
            decode_steps=load.decode_steps - base.decode_steps,
            prefill_s=load.prefill_s - base.prefill_s,
            resume_prefill_s=load.resume_prefill_s - base.resume_prefill_s,
            decode_s=load.decode_s - base.decode_s,
            decode_tokens=load.decode_tokens - base.decode_tokens,
        )
        with contextlib.suppress(anyio.ClosedResourceError, DataPlaneError):
            await self._link.report(event)

    async def run(self, interval_s: float, reporting: Callable[[], bool]) -> None:
        """Report every ``interval_s`` while ``reporting()``, and when the engine ran
        dry having stepped since the last report; until cancelled."""
        due_s = anyio.current_time() + interval_s
        while True:
            await anyio.sleep(min(DRY_CHECK_S, interval_s))
            now = anyio.current_time()
            if now < due_s and (self._engine.num_requests or not reporting()):
                continue
            load = self._engine.load()
            if now < due_s and (load.prefill_steps, load.decode_steps) == self._reported:
                continue  # idle, and nothing new since the last report
            due_s = now + interval_s
            if reporting():
                await self.report(load)
