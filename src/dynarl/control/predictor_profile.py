"""What seeds the scheduler's predictor: a table of throughput measurements per
component (:class:`ProfileRow`), a rollout's own prefills (:class:`PrefillRow`), the
cost of re-prefilling a moved request (:class:`PrefillCost`) and migration costs, in
one :class:`Profile` -- a profiling run's, or what a run's predictor observed
(:meth:`~dynarl.control.predictor.Predictor.to_profile`)."""

from pathlib import Path

import msgspec

from dynarl.core.ids import ComponentId


class ProfileRow(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement: ``component`` on ``devices`` devices with ``load`` parallel
    work items (running requests, samples) did ``throughput`` units/s; for rollout,
    ``context`` is the mean tokens of context a running request held (0: unknown).
    ``engine_devices`` is the devices of each of its instances when they were
    regrouped into another size than the component's own (0: its own)."""

    component: ComponentId
    devices: int
    load: float
    throughput: float
    context: float = 0.0
    engine_devices: int = 0


class PrefillCost(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine of a rollout component pays to re-prefill a request it is sent
    (a migration moves requests without their KV): compute-bound, a request holding
    ``L`` tokens of context (prompt and tokens generated so far) takes ``L *
    (s_per_token + s_per_token_context * L / 2)`` seconds (causal attention: each token
    attends to the ones before it), stalling the engine's running requests meanwhile.
    ``kv_capacity_tokens`` is the engine's KV cache, which turns its reported KV usage
    into tokens of context."""

    s_per_token: float
    s_per_token_context: float
    kv_capacity_tokens: float

    def seconds(self, context_tokens: float) -> float:
        """Seconds to re-prefill one request of ``context_tokens`` tokens."""
        n = max(context_tokens, 0.0)
        return n * (self.s_per_token + self.s_per_token_context * n / 2.0)


class PrefillRow(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement of a rollout's own prefills: its engines on ``devices`` devices
    at ``load`` running requests spent ``device_s`` device-seconds prefilling while they
    generated ``tokens`` tokens (see
    :meth:`~dynarl.control.predictor.Predictor.observe_prefill`)."""

    component: ComponentId
    devices: int
    load: float
    device_s: float
    tokens: float


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A table of measurements that seeds the predictor (and rollout components'
    re-prefill costs): a profiling run's, or what a run observed
    (:meth:`~dynarl.control.predictor.Predictor.to_profile`; a real run writes it to
    ``predictor.json`` in its run directory with every checkpoint)."""

    rows: tuple[ProfileRow, ...] = ()
    migration_s: dict[str, float] = msgspec.field(default_factory=dict)
    prefill: dict[str, PrefillCost] = msgspec.field(default_factory=dict)
    prefill_rows: tuple[PrefillRow, ...] = ()

    def components(self) -> set[ComponentId]:
        """The components its measurements name."""
        return {r.component for r in self.rows} | {r.component for r in self.prefill_rows}

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_bytes(msgspec.json.encode(self))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by :meth:`save`."""
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)
