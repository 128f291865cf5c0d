"""The predictor: per-component throughput as a function of devices and load.

Two model families, each a linear least-squares fit refined online (recursive, with
forgetting so it follows drift: :class:`~dynarl.control.throughput_fit.ThroughputFit`):

* **concave** (rollout): a decode step advances every running request by one token
  and costs ``a + (b + c * context) * load / devices`` seconds: a fixed cost (reading
  the weights), a cost per request and one per token of context the requests hold
  (reading their KV), ``context`` being the mean context per running request. So
  throughput is ``load / step`` tokens/s: each extra device helps less as requests
  finish, and the same batch slows down as its contexts grow. Fitted as ``1/throughput
  = a/load + b/devices + c * context/devices``, each observation weighted by
  ``throughput^2`` so that the fit minimises relative errors (``1/throughput`` spans
  orders of magnitude between a full batch and a tail request alone; unweighted, the
  slowest few observations decide the fit). Without context in the observations
  (an engine that does not report its KV tokens) ``c`` stays 0 and ``b`` absorbs the
  context. A request runs on one engine, so only the devices of engines holding one
  count: ``devices`` is floored at ``load x devices per instance`` (at the tail, with
  fewer requests than engines, a request's step does not get cheaper with the idle
  engines; without the floor the fit reads the tail's slow steps as a large ``b``).
  Prefills (admitting requests, sessions returning from their tools) stall an engine's
  batch beside its decode steps: where engines count their steps the fit sees their
  decode rate alone, and the prefill's device-seconds per generated token ``p`` are
  kept apart (a ratio of sums, forgetting as the fit does) and added to the token's
  cost, ``b + c * context + p`` (see :mod:`dynarl.control.decode_window`). A moved
  request's re-prefill is the move's cost, not in ``p``: engines report it apart.
* **linear** (actor, inference): ``throughput = k * devices ** e`` with ``e <= 1`` the
  data-parallel efficiency; fitted in log space. Devices beyond the load do nothing.

Device slots that share one host's cores (CPU slots) do not add up: while ``n`` of them
compute at once each runs ``host_slowdown(n)`` times slower than alone, so ``n``
devices deliver ``n / host_slowdown(n)`` of one device's throughput, not ``n`` times.
Given that curve (plain numbers: element ``n - 1`` for ``n`` busy devices, 1.0 first;
past its end the host counts as saturated, each device's speed falling as ``1/n``), the
predictor fits both families on what a device would have done alone (an observation's
throughput times the slowdown at the devices it kept busy) and divides predictions by
it. Without a curve (GPUs) devices are independent.

The fit is seeded from a :class:`Profile` (rows a profiling run or the simulator
writes) and says how sure it is: :meth:`Predictor.predict` returns the relative standard
error of the fit beside the estimate. Migration costs per kind are learned the same way
(an exponential average of observed durations). What re-prefilling a moved request
costs a rollout engine (:class:`PrefillCost`) comes from the profile alone.

A component whose instances may be regrouped into another size (the rollout's engines
at ``tail_devices_per_instance`` for its tail) has a fit per size: the methods take
the size asked about as ``unit`` (0, or the component's own, for its own), and
observations go to the fit of the size that made them (:attr:`ProfileRow.engine_devices`
in a profile), except the prefill share ``p``: one per component (a prefill is
compute-bound, its device-seconds about the same at either size). A re-prefill on an
engine ``k`` times wider takes ``1/k`` the time (compute-bound) with ``k`` times the KV
cache.
"""

import collections
import json
import math
import os
from collections.abc import Iterable

import msgspec

from dynarl.control.predictor_profile import PrefillCost, PrefillRow, Profile, ProfileRow
from dynarl.control.throughput_fit import ThroughputFit
from dynarl.control.topology import PipelineSpec, Scaling
from dynarl.core.errors import ConfigError
from dynarl.core.ids import ComponentId


class StepCosts(msgspec.Struct, frozen=True):
    """A rollout's fitted decode-step costs: a step over ``load`` requests holding
    ``context`` tokens each on average, on ``devices`` devices, takes ``a + (b + c *
    context) * load / devices`` seconds (``devices`` floored as
    :func:`~dynarl.control.throughput_fit.busy_devices` says); besides, its engines
    spend ``prefill`` device-seconds prefilling per token they generate (0 where they
    do not count their steps: ``b`` then absorbs it)."""

    a: float  # seconds per step
    b: float  # device-seconds per request per step
    c: float  # device-seconds per token of context per step
    prefill: float = 0.0  # device-seconds of prefill per generated token

    def per_token(self, context: float) -> float:
        """Device-seconds one request's token costs at ``context`` beyond ``a``, its
        share of the prefills included."""
        return self.b + self.c * max(context, 0.0) + self.prefill


class Estimate(msgspec.Struct, frozen=True):
    """A predicted throughput and the fit's relative standard error (0.1 = ±10%);
    ``num_observations`` says how much data stands behind it."""

    throughput: float
    rel_std: float
    num_observations: int


DEFAULT_MIGRATION_S: dict[str, float] = {
    "workload": 4.0,  # rollout migration: 3.5-5 s median in the reference measurements
    "reshard": 1.5,  # trainer reshard: 0.5-2.8 s for 1.5B-32B
    "reboot": 30.0,
}


def host_factor(slowdown: tuple[float, ...], devices: float) -> float:
    """How many times longer a device's work takes while ``devices`` devices of its
    host compute at once, by the curve ``slowdown`` (element ``n - 1`` for ``n``;
    between points, linear; past the last, saturated: growing as ``devices``). An
    empty curve, or one device or fewer, is 1.0."""
    if not slowdown or devices <= 1.0:
        return 1.0
    last = len(slowdown)
    if devices >= last:
        return slowdown[-1] * devices / last
    lo = int(devices)
    frac = devices - lo
    return slowdown[lo - 1] + frac * (slowdown[lo] - slowdown[lo - 1])


def cores_slowdown(num_devices: int, threads_per_device: int, num_cores: int) -> tuple[float, ...]:
    """The host curve of ``num_devices`` slots of ``threads_per_device`` threads each on
    ``num_cores`` cores, as ideal processor sharing: no slowdown while the busy slots'
    threads fit on the cores, then ``busy threads / cores`` (a prior for a run with
    no measured curve: real hosts, with other tenants and shared memory bandwidth,
    slow down sooner)."""
    return tuple(
        max(1.0, n * threads_per_device / max(num_cores, 1)) for n in range(1, num_devices + 1)
    )


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one): what
    :func:`cores_slowdown` shares among a local run's slots."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_host_slowdown(slowdown: tuple[float, ...]) -> None:
    """Refuse a malformed host curve.

    Raises:
        ConfigError: the curve does not start at 1.0 or holds a factor that is not a
            finite positive number.
    """
    if slowdown and abs(slowdown[0] - 1.0) > 1e-9:
        raise ConfigError(
            f"host_slowdown[0]={slowdown[0]}: the first point is one device alone, 1.0 by "
            "definition; pass () for independent devices",
            field="host_slowdown",
        )
    for n, value in enumerate(slowdown, start=1):
        if not (value > 0.0 and math.isfinite(value)):
            raise ConfigError(
                f"host_slowdown[{n - 1}]={value} ({n} devices busy): need a finite positive factor",
                field="host_slowdown",
            )


RECENT_ROWS = 1024
"""Observations per component a predictor keeps for :meth:`Predictor.to_profile` (its
fit forgets at 0.5% an observation: the 1,024th newest weighs 0.6%)."""


class Predictor:
    """Throughput predictions per component, seeded by a profile and refined online.

    Args:
        scalings: each component's model family.
        profile: measurements to seed the fits with.
        forget: per-observation forgetting factor (1.0 never forgets).
        prior_per_device: throughput per device assumed before any data, per component
            (so a fresh predictor still ranks plans sensibly).
        devices_per_instance: devices one instance of a component runs on (default 1):
            a concave component's load keeps at most that many devices per item busy.
        tail_devices_per_instance: the other size a component's instances may be
            regrouped into (see the module docstring); a fit is kept for it.
        host_slowdown: the devices share one host's cores: element ``n - 1`` is how
            many times longer a device's work takes while ``n`` compute at once (1.0
            first; see :func:`host_factor`). Empty (default): independent devices.

    Raises:
        ConfigError: ``host_slowdown`` is malformed (:func:`check_host_slowdown`).
    """

    def __init__(
        self,
        scalings: dict[ComponentId, Scaling],
        *,
        profile: Profile | None = None,
        forget: float = 0.995,
        prior_per_device: dict[ComponentId, float] | None = None,
        devices_per_instance: dict[ComponentId, int] | None = None,
        tail_devices_per_instance: dict[ComponentId, int] | None = None,
        host_slowdown: tuple[float, ...] = (),
    ) -> None:
        check_host_slowdown(host_slowdown)
        self.host_slowdown = tuple(host_slowdown)
        units = devices_per_instance or {}
        self._units = {c: units.get(c, 1) for c in scalings}
        self._fits = {
            c: ThroughputFit(s, forget, units.get(c, 1), slowdown=self.slowdown)
            for c, s in scalings.items()
        }
        # Fits of the other instance size, per (component, size).
        self._sized = {
            (c, n): ThroughputFit(scalings[c], forget, n, slowdown=self.slowdown)
            for c, n in (tail_devices_per_instance or {}).items()
            if n and c in scalings
        }
        self._prior = dict(prior_per_device or {})
        self.migration_s: dict[str, float] = dict(DEFAULT_MIGRATION_S)
        self._prefill: dict[str, PrefillCost] = {}
        # The newest observations per component, in order (what to_profile hands on).
        self._rows = {c: collections.deque[ProfileRow](maxlen=RECENT_ROWS) for c in scalings}
        self._prefill_rows = {
            c: collections.deque[PrefillRow](maxlen=RECENT_ROWS) for c in scalings
        }
        if profile is not None:
            self.observe_all(profile.rows)
            for r in profile.prefill_rows:
                self.observe_prefill(r.component, r.devices, r.load, r.device_s, r.tokens)
            self.migration_s.update(profile.migration_s)
            self._prefill.update(profile.prefill)

    @classmethod
    def for_pipeline(
        cls,
        pipeline: PipelineSpec,
        *,
        profile: Profile | None = None,
        host_slowdown: tuple[float, ...] = (),
    ) -> "Predictor":
        """The predictor of a run of ``pipeline``: each component's model family and
        devices per instance from its spec (so a simulated run and a real one predict
        alike), seeded with ``profile``, on a host that slows its devices by
        ``host_slowdown`` (see the class)."""
        return cls(
            {c.id: c.scaling for c in pipeline.components},
            profile=profile,
            devices_per_instance={c.id: c.devices_per_instance for c in pipeline.components},
            tail_devices_per_instance={
                c.id: c.tail_devices_per_instance
                for c in pipeline.components
                if c.tail_devices_per_instance
            },
            host_slowdown=host_slowdown,
        )

    def _fit(self, component: ComponentId, unit: int) -> ThroughputFit | None:
        """The fit of ``component``'s instances of ``unit`` devices (0: its own size);
        ``None`` for an unknown component or size."""
        if not unit or unit == self._units.get(component):
            return self._fits.get(component)
        return self._sized.get((component, unit))

    def _sized_fit(self, component: ComponentId, unit: int) -> ThroughputFit:
        fit = self._fit(component, unit)
        if fit is None:
            raise KeyError(f"{component} has no instances of {unit} devices")
        return fit

    def observe(
        self,
        component: ComponentId,
        devices: int,
        load: float,
        throughput: float,
        *,
        context: float = 0.0,
        unit: int = 0,
    ) -> None:
        """Add one measurement of ``component``'s throughput (for rollout, at a mean
        ``context`` tokens per running request; 0 if unknown) on instances of ``unit``
        devices (0: its own size)."""
        fit = self._fit(component, unit)
        if fit is not None:
            fit.add(devices, load, throughput, context)
            sized = unit if unit and unit != self._units.get(component) else 0
            self._rows[component].append(
                ProfileRow(
                    component=component,
                    devices=devices,
                    load=load,
                    throughput=throughput,
                    context=context,
                    engine_devices=sized,
                )
            )

    def observe_prefill(
        self,
        component: ComponentId,
        devices: int,
        load: float,
        device_s: float,
        tokens: float,
    ) -> None:
        """Add what a rollout's engines spent prefilling (``device_s`` device-seconds)
        while they generated ``tokens`` tokens, on ``devices`` devices at ``load``
        running requests (a concave component whose decode rate :meth:`observe` sees
        apart from its prefills). One share per component, whatever its engines'
        size: a prefill is compute-bound, so its device-seconds hardly change with
        the engine's devices (and engines of a size used only for the rollout's tail
        admit no fresh request to learn it from)."""
        fit = self._fits.get(component)
        if fit is not None and fit.scaling == "concave":
            fit.add_prefill(devices, load, device_s, tokens)
            self._prefill_rows[component].append(
                PrefillRow(
                    component=component,
                    devices=devices,
                    load=load,
                    device_s=device_s,
                    tokens=tokens,
                )
            )

    def observe_all(self, rows: Iterable[ProfileRow]) -> None:
        """Add profile rows."""
        for r in rows:
            self.observe(
                r.component,
                r.devices,
                r.load,
                r.throughput,
                context=r.context,
                unit=r.engine_devices,
            )

    def observe_migration(self, kind: str, duration_s: float, *, alpha: float = 0.3) -> None:
        """Fold an observed migration duration into the cost estimate of its kind."""
        old = self.migration_s.get(kind, duration_s)
        self.migration_s[kind] = (1 - alpha) * old + alpha * duration_s

    def migration_cost(self, kind: str) -> float:
        """Expected seconds one migration of ``kind`` takes."""
        return self.migration_s.get(kind, DEFAULT_MIGRATION_S["reboot"])

    def prefill_cost(self, component: ComponentId, unit: int = 0) -> PrefillCost | None:
        """What re-prefilling a moved request costs one engine of ``component`` of
        ``unit`` devices (0: its own size); ``None`` if the profile did not measure
        it."""
        cost = self._prefill.get(component)
        own = self._units.get(component, 1)
        if cost is None or not unit or unit == own:
            return cost
        k = unit / own  # compute-bound: k times the devices, 1/k the time
        return PrefillCost(
            s_per_token=cost.s_per_token / k,
            s_per_token_context=cost.s_per_token_context / k,
            kv_capacity_tokens=cost.kv_capacity_tokens * k,
        )

    def predict(
        self,
        component: ComponentId,
        devices: int,
        load: float,
        *,
        context: float | None = None,
        unit: int = 0,
    ) -> Estimate:
        """Expected throughput of ``component`` on ``devices`` devices at ``load`` (for
        rollout, at a mean ``context`` per request; default: the observations' mean),
        its instances of ``unit`` devices (0: its own size).

        Zero devices or zero load predict zero throughput (with certainty).
        """
        fit = self._sized_fit(component, unit)
        if devices <= 0 or load <= 0:
            return Estimate(0.0, 0.0, fit.count)
        value = fit.predict(devices, load, context)
        if value is None:
            # No data yet: linear in the devices the load can use (and the host lets work).
            busy = min(devices, load)
            value = self._prior.get(component, 1.0) * busy / self.slowdown(busy)
            return Estimate(value, 1.0, fit.count)
        return Estimate(value, fit.rel_std(), fit.count)

    def slowdown(self, devices: float) -> float:
        """How many times longer a device's work takes while ``devices`` devices
        compute at once (1.0 for independent devices; :func:`host_factor`)."""
        return host_factor(self.host_slowdown, devices)

    def step_costs(self, component: ComponentId, unit: int = 0) -> StepCosts | None:
        """A concave component's fitted decode-step costs (:class:`StepCosts`) on
        devices working alone (see :meth:`slowdown` for those sharing a host), its
        instances of ``unit`` devices (0: its own size); ``None`` before the fit
        exists."""
        fit = self._sized_fit(component, unit)
        coef = fit.solve() if fit.scaling == "concave" else None
        if coef is None:
            return None
        prefill = self._fits[component].prefill  # the component's (see observe_prefill)
        return StepCosts(float(coef[0]), float(coef[1]), float(coef[2]), prefill)

    def to_profile(self) -> Profile:
        """A profile that seeds a fresh predictor with what this one has learnt: its
        newest observations (:data:`RECENT_ROWS` per component, with its prefills) and
        the learned migration and re-prefill costs."""
        return Profile(
            rows=tuple(r for q in self._rows.values() for r in q),
            migration_s=dict(self.migration_s),
            prefill=dict(self._prefill),
            prefill_rows=tuple(r for q in self._prefill_rows.values() for r in q),
        )

    def describe(self) -> str:
        """One line per component: fitted coefficients and confidence."""
        lines = []
        for c, fit in self._fits.items():
            coef = fit.solve()
            shown = "no data" if coef is None else json.dumps([round(float(v), 6) for v in coef])
            prefill = f" prefill={fit.prefill:.3g}" if fit.prefill > 0 else ""
            lines.append(
                f"{c}: {fit.scaling} {shown}{prefill} n={fit.count} rel_std={fit.rel_std():.3f}"
            )
        return "\n".join(lines)
