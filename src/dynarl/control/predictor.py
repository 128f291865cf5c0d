"""The predictor: per-component throughput as a function of devices and load.

Two model families, each a linear least-squares fit refined online (recursive, with
forgetting so it follows drift):

* **concave** (rollout): a decode step costs ``a + b * load / devices`` seconds and
  advances every running request by one token, so throughput is
  ``load / (a + b * load / devices)`` tokens/s: each extra device helps less as
  requests finish. Fitted as ``1/throughput = a/load + b/devices``. A request runs on
  one engine, so only the devices of engines holding one count: ``devices`` is floored
  at ``load x devices per instance`` (at the tail, with fewer requests than engines, a
  request's step does not get cheaper with the idle engines; without the floor the fit
  reads the tail's slow steps as a large ``b``).
* **linear** (actor, inference): ``throughput = c * devices ** e`` with ``e <= 1`` the
  data-parallel efficiency; fitted in log space. Devices beyond the load do nothing.

The fit is seeded from a :class:`Profile` (rows a profiling run or the simulator
writes) and says how sure it is: :meth:`Predictor.predict` returns the relative standard
error of the fit beside the estimate. Migration costs per kind are learned the same way
(an exponential average of observed durations). What re-prefilling a moved request
costs a rollout engine (:class:`PrefillCost`) comes from the profile alone.
"""

import json
import math
from collections.abc import Iterable
from pathlib import Path

import msgspec
import numpy as np

from dynarl.control.topology import Scaling
from dynarl.core.ids import ComponentId


class ProfileRow(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement: ``component`` on ``devices`` devices with ``load`` parallel
    work items (running requests, samples) did ``throughput`` units/s."""

    component: ComponentId
    devices: int
    load: float
    throughput: float


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


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A table of measurements that seeds the predictor (and rollout components'
    re-prefill costs)."""

    rows: tuple[ProfileRow, ...] = ()
    migration_s: dict[str, float] = msgspec.field(default_factory=dict)
    prefill: dict[str, PrefillCost] = msgspec.field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_bytes(msgspec.json.encode(self))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by :meth:`save`."""
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)


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


def busy_devices(devices: float, load: float, unit: int) -> float:
    """Devices a concave component's ``load`` requests can keep busy: a request runs on
    one instance of ``unit`` devices, so at most ``ceil(load) x unit`` of ``devices``."""
    return min(devices, math.ceil(load) * unit) if load > 0 else devices


class _Fit:
    """Weighted recursive least squares on a 2-feature model with forgetting."""

    def __init__(self, scaling: Scaling, forget: float, unit: int = 1) -> None:
        self.scaling = scaling
        self.forget = forget
        self.unit = unit  # devices per instance
        self.xtx = np.zeros((2, 2))
        self.xty = np.zeros(2)
        self.yty = 0.0
        self.ysum = 0.0
        self.weight = 0.0
        self.count = 0
        self.coef: np.ndarray | None = None

    def features(self, devices: float, load: float) -> tuple[np.ndarray, float] | None:
        if devices <= 0 or load <= 0:
            return None
        if self.scaling == "concave":
            return np.array([1.0 / load, 1.0 / busy_devices(devices, load, self.unit)]), 1.0
        return np.array([1.0, math.log(min(devices, load))]), 1.0

    def target(self, throughput: float) -> float:
        return 1.0 / throughput if self.scaling == "concave" else math.log(throughput)

    def add(self, devices: float, load: float, throughput: float) -> None:
        feats = self.features(devices, load)
        if feats is None or throughput <= 0 or not math.isfinite(throughput):
            return
        x, _ = feats
        y = self.target(throughput)
        self.xtx = self.forget * self.xtx + np.outer(x, x)
        self.xty = self.forget * self.xty + x * y
        self.yty = self.forget * self.yty + y * y
        self.ysum = self.forget * self.ysum + y
        self.weight = self.forget * self.weight + 1.0
        self.count += 1
        self.coef = None

    def solve(self) -> np.ndarray | None:
        if self.coef is None and self.count >= 2:
            # Ridge towards a prior: linear scaling (e = 1) for linear components. A
            # direction the data does not vary in (a component always on the same
            # device count) is decided by the prior, not by numerical noise.
            prior = np.array([0.0, 1.0]) if self.scaling == "linear" else np.zeros(2)
            ridge = np.diag([1e-9, 1e-3])
            delta = np.linalg.solve(self.xtx + ridge, self.xty - self.xtx @ prior)
            coef = prior + delta
            if self.scaling == "concave":
                coef = np.maximum(coef, 1e-12)  # step costs are never negative
            else:
                coef[1] = min(max(coef[1], 0.0), 1.0)  # 0 <= DP efficiency exponent <= 1
            self.coef = coef
        return self.coef

    def rel_std(self) -> float:
        coef = self.solve()
        if coef is None or self.weight <= 2:
            return 1.0
        sse = self.yty - 2 * coef @ self.xty + coef @ self.xtx @ coef
        var = max(float(sse), 0.0) / (self.weight - 2)
        std = math.sqrt(var)
        if self.scaling == "concave":
            # y is 1/throughput: its relative error is the throughput's relative error.
            mean_y = self.ysum / self.weight
            return min(1.0, std / mean_y) if mean_y > 0 else 1.0
        return min(1.0, std)  # log space: std is the relative error

    def predict(self, devices: float, load: float) -> float | None:
        coef = self.solve()
        feats = self.features(devices, load)
        if coef is None or feats is None:
            return None
        x, _ = feats
        y = float(coef @ x)
        if self.scaling == "concave":
            return 1.0 / y if y > 0 else None
        return math.exp(y)


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
    """

    def __init__(
        self,
        scalings: dict[ComponentId, Scaling],
        *,
        profile: Profile | None = None,
        forget: float = 0.995,
        prior_per_device: dict[ComponentId, float] | None = None,
        devices_per_instance: dict[ComponentId, int] | None = None,
    ) -> None:
        units = devices_per_instance or {}
        self._fits = {c: _Fit(s, forget, units.get(c, 1)) for c, s in scalings.items()}
        self._prior = dict(prior_per_device or {})
        self.migration_s: dict[str, float] = dict(DEFAULT_MIGRATION_S)
        self._prefill: dict[str, PrefillCost] = {}
        if profile is not None:
            self.observe_all(profile.rows)
            self.migration_s.update(profile.migration_s)
            self._prefill.update(profile.prefill)

    def observe(self, component: ComponentId, devices: int, load: float, throughput: float) -> None:
        """Add one measurement of ``component``'s throughput."""
        fit = self._fits.get(component)
        if fit is not None:
            fit.add(devices, load, throughput)

    def observe_all(self, rows: Iterable[ProfileRow]) -> None:
        """Add profile rows."""
        for r in rows:
            self.observe(r.component, r.devices, r.load, r.throughput)

    def observe_migration(self, kind: str, duration_s: float, *, alpha: float = 0.3) -> None:
        """Fold an observed migration duration into the cost estimate of its kind."""
        old = self.migration_s.get(kind, duration_s)
        self.migration_s[kind] = (1 - alpha) * old + alpha * duration_s

    def migration_cost(self, kind: str) -> float:
        """Expected seconds one migration of ``kind`` takes."""
        return self.migration_s.get(kind, DEFAULT_MIGRATION_S["reboot"])

    def prefill_cost(self, component: ComponentId) -> PrefillCost | None:
        """What re-prefilling a moved request costs one engine of ``component``;
        ``None`` if the profile did not measure it."""
        return self._prefill.get(component)

    def predict(self, component: ComponentId, devices: int, load: float) -> Estimate:
        """Expected throughput of ``component`` on ``devices`` devices at ``load``.

        Zero devices or zero load predict zero throughput (with certainty).
        """
        fit = self._fits[component]
        if devices <= 0 or load <= 0:
            return Estimate(0.0, 0.0, fit.count)
        value = fit.predict(devices, load)
        if value is None:
            # No data yet: linear in the devices the load can use.
            value = self._prior.get(component, 1.0) * min(devices, load)
            return Estimate(value, 1.0, fit.count)
        return Estimate(value, fit.rel_std(), fit.count)

    def step_costs(self, component: ComponentId) -> tuple[float, float] | None:
        """A concave component's fitted decode-step costs ``(a, b)``: a step takes
        ``a + b * load / devices`` seconds, ``devices`` floored as :func:`busy_devices`
        says. ``None`` before the fit exists."""
        fit = self._fits[component]
        coef = fit.solve() if fit.scaling == "concave" else None
        return None if coef is None else (float(coef[0]), float(coef[1]))

    def to_profile(self, rows: Iterable[ProfileRow] = ()) -> Profile:
        """A profile holding ``rows`` and the learned migration costs."""
        return Profile(
            rows=tuple(rows), migration_s=dict(self.migration_s), prefill=dict(self._prefill)
        )

    def describe(self) -> str:
        """One line per component: fitted coefficients and confidence."""
        lines = []
        for c, fit in self._fits.items():
            coef = fit.solve()
            shown = "no data" if coef is None else json.dumps([round(float(v), 6) for v in coef])
            lines.append(f"{c}: {fit.scaling} {shown} n={fit.count} rel_std={fit.rel_std():.3f}")
        return "\n".join(lines)
