"""Device slots that share one host's cores: how a slot's speed depends on how many
slots of the host are busy at once.

On a GPU cluster every device computes on its own silicon, and the simulator models
devices as independent. A CPU device slot is a process with a few torch threads, and
the slots of one host share its cores (and its memory bandwidth, and whatever else the
host runs): two slots decoding at once each take longer per step than one alone.
:class:`HostSharing` holds that slowdown as ``bench/profile_cpu.py --host-scaling``
(and ``dynarl profile``) measures it, and the simulated world applies it as processor
sharing: whenever the number of busy slots changes, every running piece of work
(a decode step, a prefill, a log-prob micro-batch, an optimizer step) goes on at the
new speed for what is left of it.

A slot counts as busy while it computes: a rollout engine with a request running or
prefilling, an inference replica in a micro-batch, a trainer rank in an optimizer
step. Migrations, weight sync and idle slots do not count.

The slots are not the host's only tenant: the controller process (the router, the
reward, the result batches, the controller itself) computes beside them, mostly while
responses come in. Where its CPU per response and per generated token is measured
(``controller_cpu_per_request_s``, ``controller_cpu_per_token_s``: fitted from a
real run's records by ``dynarl profile --from-run`` or ``bench/sim_fidelity.py``,
:mod:`dynarl.sim.controller_cpu`), it counts as a fractional busy
slot: its CPU-seconds per second at the engines' current decode rate, each response's
cost spread over the tokens it generates (at most one core: one Python process), the
factor interpolated between the curve's integer counts (:meth:`HostSharing.factor`),
so a lone slot decoding beside it runs slower than alone.
"""

import math

import msgspec

from dynarl.control.predictor import cores_slowdown
from dynarl.sim.errors import SimError


class HostSharing(msgspec.Struct, frozen=True, kw_only=True):
    """The measured slowdown of a host's slots busy at once.

    Attributes:
        slowdown: element ``n - 1`` is how many times longer a slot's work takes while
            ``n`` slots of the host are busy (its own included) than while it runs
            alone; the first element is 1 by definition. Past the measured range the
            host counts as saturated: each slot's speed falls as ``1 / n``.
        controller_cpu_per_request_s: CPU seconds the controller process spends per
            response (routing, reward, result batches), measured in a real run (0: not
            measured).
        controller_cpu_per_token_s: CPU seconds it spends per generated token on top
            (0: not measured; both 0: the controller is not counted).
        cores: the host's cores, for the curve a real run's controller predictor is
            given there (:meth:`predictor_slowdown`); 0: not recorded.
        threads: torch threads per slot (with ``cores``).
    """

    slowdown: tuple[float, ...]
    controller_cpu_per_request_s: float = 0.0
    controller_cpu_per_token_s: float = 0.0
    cores: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        check_slowdown(self.slowdown, "host_slowdown")
        check_controller_cpu(self.controller_cpu_per_request_s, "controller_cpu_per_request_s")
        check_controller_cpu(self.controller_cpu_per_token_s, "controller_cpu_per_token_s")

    @property
    def num_measured(self) -> int:
        """The largest number of busy slots measured."""
        return len(self.slowdown)

    def factor(self, num_busy: float) -> float:
        """How many times longer a slot's work takes while ``num_busy`` slots are busy
        (1.0 for none or one); a fractional count (the controller's share of a core)
        interpolates linearly between the integer counts around it."""
        if num_busy <= 1:
            return 1.0
        lo = math.floor(num_busy)
        frac = num_busy - lo
        low = self._at(lo)
        return low if frac == 0 else low + frac * (self._at(lo + 1) - low)

    def _at(self, n: int) -> float:
        """The factor at ``n >= 1`` busy slots (saturated past the measured range)."""
        if n <= len(self.slowdown):
            return self.slowdown[n - 1]
        return self.slowdown[-1] * n / len(self.slowdown)

    @property
    def counts_controller(self) -> bool:
        """Whether the controller's CPU is measured (and so counted on the curve)."""
        return self.controller_cpu_per_request_s > 0.0 or self.controller_cpu_per_token_s > 0.0

    def controller_load(self, tokens_per_s: float, responses_per_s: float) -> float:
        """The controller process's share of a core while the engines generate
        ``tokens_per_s`` tokens and complete ``responses_per_s`` responses a second:
        its measured CPU per token and per response times those rates, at most one
        core (one Python process)."""
        cpu = self.controller_cpu_per_token_s * max(tokens_per_s, 0.0)
        cpu += self.controller_cpu_per_request_s * max(responses_per_s, 0.0)
        return min(1.0, cpu)

    def predictor_slowdown(self, num_devices: int) -> tuple[float, ...]:
        """The curve the controller's predictor of a real run on this host is given:
        ideal processor sharing of ``num_devices`` slots on :attr:`cores`
        (:func:`~dynarl.control.predictor.cores_slowdown`, what
        ``dynarl.api.assembly.host_slowdown`` computes on the machine), so a simulated
        controller plans as the real one does; without recorded cores, the measured
        curve at 1 to ``num_devices`` busy slots."""
        if self.cores > 0:
            return cores_slowdown(num_devices, self.threads, self.cores)
        return tuple(self.factor(n) for n in range(1, num_devices + 1))


def check_slowdown(slowdown: tuple[float, ...], field: str) -> None:
    """Refuse a malformed slowdown curve, naming ``field``.

    Raises:
        SimError: the curve is empty, does not start at 1, or holds a factor that is
            not a positive number.
    """
    fix = "measure it with `python bench/profile_cpu.py --host-scaling N` or `dynarl profile`"
    if not slowdown:
        raise SimError(f"{field}=(): a slowdown curve needs at least one point; {fix}")
    if abs(slowdown[0] - 1.0) > 1e-9:
        raise SimError(
            f"{field}[0]={slowdown[0]}: the first point is one slot alone, 1.0 by definition; {fix}"
        )
    for n, value in enumerate(slowdown, start=1):
        if not value > 0.0 or value == float("inf"):
            raise SimError(f"{field}[{n - 1}]={value} ({n} slots busy): need a positive factor")


def check_controller_cpu(value: float, field: str) -> None:
    """Refuse a controller CPU cost that is not a finite number >= 0, naming ``field``.

    Raises:
        SimError: it is negative, infinite or NaN.
    """
    if not (value >= 0.0 and math.isfinite(value)):
        raise SimError(
            f"{field}={value}: the controller's CPU seconds must be a finite number >= 0; "
            "fit it from a real run with `dynarl profile --from-run RUN_DIR`"
        )
