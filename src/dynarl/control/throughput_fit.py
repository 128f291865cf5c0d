"""One component's throughput model, fitted online: weighted recursive least squares
with forgetting (:class:`ThroughputFit`), the fit the predictor keeps per component.

A **concave** model (rollout) is fitted as ``1/throughput = a/load + b/devices + c *
context/devices``, ``devices`` floored at what the load keeps busy
(:func:`busy_devices`), each observation weighted by ``throughput^2`` so that the fit
minimises relative errors; its prefill device-seconds per generated token are kept
apart as a ratio of sums. A **linear** model (actor, inference) is fitted as ``log
throughput = log k + e * log devices`` with a ridge prior of ``e = 1``. Both fit what
the devices would have done alone: the fit is given how much slower a device runs while
others of its host compute at once, and divides its predictions by that again (see
:mod:`dynarl.control.predictor`).
"""

import math
from collections.abc import Callable

import numpy as np

from dynarl.control.topology import Scaling


def busy_devices(devices: float, load: float, unit: int) -> float:
    """Devices a concave component's ``load`` requests can keep busy: a request runs on
    one instance of ``unit`` devices, so at most ``ceil(load) x unit`` of ``devices``."""
    return min(devices, math.ceil(load) * unit) if load > 0 else devices


class ThroughputFit:
    """Weighted recursive least squares with forgetting: 3 features for a concave
    model (the last is 0 without context), 2 for a linear one.

    Args:
        scaling: the model family.
        forget: per-observation forgetting factor (1.0 never forgets).
        unit: devices per instance (a concave load keeps at most that many per item busy).
        slowdown: how many times longer a device's work takes while ``n`` devices
            compute at once (1.0 throughout for independent devices).
    """

    def __init__(
        self,
        scaling: Scaling,
        forget: float,
        unit: int = 1,
        *,
        slowdown: Callable[[float], float],
    ) -> None:
        self.scaling = scaling
        self.forget = forget
        self.unit = unit  # devices per instance
        self.slowdown = slowdown
        k = 3 if scaling == "concave" else 2
        self.xtx = np.zeros((k, k))
        self.xty = np.zeros(k)
        self.yty = 0.0
        self.weight = 0.0
        self.context_sum = 0.0  # forgetting-weighted, as ``weight``
        # Prefill device-seconds (on devices alone) and the tokens generated beside
        # them, forgetting-weighted per sample (concave only; see add_prefill).
        self.prefill_s = 0.0
        self.prefill_tokens = 0.0
        self.count = 0
        self.coef: np.ndarray | None = None
        self._coef_list: list[float] | None = None  # coef as floats, for predict
        self._rel_std: float | None = None

    @property
    def context(self) -> float:
        """Mean context of the observations (forgetting-weighted)."""
        return self.context_sum / self.weight if self.weight > 0 else 0.0

    def features(self, devices: float, load: float, context: float) -> np.ndarray | None:
        """The regressors of an observation; ``None`` without devices or load."""
        if devices <= 0 or load <= 0:
            return None
        if self.scaling == "concave":
            busy = busy_devices(devices, load, self.unit)
            return np.array([1.0 / load, 1.0 / busy, max(context, 0.0) / busy])
        return np.array([1.0, math.log(min(devices, load))])

    def target(self, throughput: float) -> float:
        """What the model regresses: ``1/throughput`` (concave) or its log (linear)."""
        return 1.0 / throughput if self.scaling == "concave" else math.log(throughput)

    def busy(self, devices: float, load: float) -> float:
        """Devices ``load`` keeps computing at once (what the host curve is read at)."""
        if self.scaling == "concave":
            return busy_devices(devices, load, self.unit)
        return min(devices, load)

    def add(self, devices: float, load: float, throughput: float, context: float) -> None:
        """Fold in one observation (ignored without devices, load or a finite positive
        throughput)."""
        x = self.features(devices, load, context)
        if x is None or throughput <= 0 or not math.isfinite(throughput):
            return
        # Fitted as if the devices were independent: what they would do alone.
        y = self.target(throughput * self.slowdown(self.busy(devices, load)))
        # Concave: 1/throughput spans orders of magnitude (a full batch on many
        # devices against a tail request alone), and plain least squares would fit the
        # few slowest observations and err on the rest; each is weighted by 1/y^2 so
        # the fit minimises relative errors. (Log space does that for linear.)
        w = 1.0 / (y * y) if self.scaling == "concave" else 1.0
        self.xtx = self.forget * self.xtx + w * np.outer(x, x)
        self.xty = self.forget * self.xty + w * x * y
        self.yty = self.forget * self.yty + w * y * y
        self.weight = self.forget * self.weight + 1.0
        self.context_sum = self.forget * self.context_sum + max(context, 0.0)
        self.count += 1
        self.coef = None
        self._coef_list = None
        self._rel_std = None

    @property
    def prefill(self) -> float:
        """Prefill device-seconds per generated token (0 before any sample)."""
        return self.prefill_s / self.prefill_tokens if self.prefill_tokens > 0 else 0.0

    def add_prefill(self, devices: float, load: float, device_s: float, tokens: float) -> None:
        """Fold in ``device_s`` device-seconds of prefill spent beside ``tokens``
        generated tokens (ignored without tokens or a finite non-negative cost)."""
        if tokens <= 0 or device_s < 0 or not math.isfinite(device_s):
            return
        self.prefill_s = self.forget * self.prefill_s + device_s / self.slowdown(
            self.busy(devices, load)
        )
        self.prefill_tokens = self.forget * self.prefill_tokens + tokens

    def solve(self) -> np.ndarray | None:
        """The fitted coefficients (cached until the next observation); ``None`` before
        two observations."""
        if self.coef is None and self.count >= 2:
            # Ridge towards a prior: linear scaling (e = 1) for linear components. A
            # direction the data does not vary in (a component always on the same
            # device count) is decided by the prior, not by numerical noise.
            k = len(self.xty)
            prior = np.array([0.0, 1.0]) if self.scaling == "linear" else np.zeros(k)
            if self.scaling == "concave":
                # Relative to the (weighted) data: enough to settle a direction the
                # observations do not vary in, too little to bias one they do.
                ridge = np.diag(1e-6 * np.diag(self.xtx) + 1e-12)
            else:
                ridge = np.diag([1e-9, 1e-3])
            free = np.ones(k, dtype=bool)
            while True:
                coef = prior.copy()
                idx = np.flatnonzero(free)
                sub = (self.xtx + ridge)[np.ix_(idx, idx)]
                coef[idx] += np.linalg.solve(sub, (self.xty - self.xtx @ prior)[idx])
                # Step costs are never negative: a cost the data would make negative
                # is fixed at (almost) 0 and the others are fitted again without it
                # (clamping it alone would leave them fitted to the negative one).
                if self.scaling != "concave" or (coef >= 0).all():
                    break
                free &= coef >= 0
                if not free.any():
                    break
            if self.scaling == "concave":
                coef = np.maximum(coef, 1e-12)
            else:
                coef[1] = min(max(coef[1], 0.0), 1.0)  # 0 <= DP efficiency exponent <= 1
            self.coef = coef
        return self.coef

    def rel_std(self) -> float:
        """The fit's relative standard error (1.0 while too few observations)."""
        if self._rel_std is None:
            self._rel_std = self._compute_rel_std()
        return self._rel_std

    def _compute_rel_std(self) -> float:
        coef = self.solve()
        k = len(self.xty)
        if coef is None or self.weight <= k:
            return 1.0
        sse = self.yty - 2 * coef @ self.xty + coef @ self.xtx @ coef
        var = max(float(sse), 0.0) / (self.weight - k)
        # Concave residuals are weighted by 1/y^2, linear ones in log space: either way
        # the residual is relative, and a relative error of 1/throughput is one of the
        # throughput (to first order).
        return min(1.0, math.sqrt(var))

    def predict(self, devices: float, load: float, context: float | None) -> float | None:
        """Throughput on ``devices`` devices at ``load`` (for a concave model, at a mean
        ``context``; ``None``: the observations' mean), slowed as the host says;
        ``None`` before the fit exists or without devices or load."""
        # Plain floats: this runs for every candidate plan, and a 3-vector numpy dot
        # costs more than the arithmetic.
        if self._coef_list is None:
            coef = self.solve()
            if coef is None:
                return None
            self._coef_list = [float(v) for v in coef]
        if devices <= 0 or load <= 0:
            return None
        c = self._coef_list
        busy = self.busy(devices, load)
        if self.scaling == "concave":
            ctx = max(self.context if context is None else context, 0.0)
            y = c[0] / load + (c[1] + c[2] * ctx + self.prefill) / busy
            return 1.0 / (y * self.slowdown(busy)) if y > 0 else None
        return math.exp(c[0] + c[1] * math.log(busy)) / self.slowdown(busy)
