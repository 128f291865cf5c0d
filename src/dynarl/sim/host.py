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
"""

import msgspec

from dynarl.sim.errors import SimError


class HostSharing(msgspec.Struct, frozen=True, kw_only=True):
    """The measured slowdown of a host's slots busy at once.

    Attributes:
        slowdown: element ``n - 1`` is how many times longer a slot's work takes while
            ``n`` slots of the host are busy (its own included) than while it runs
            alone; the first element is 1 by definition. Past the measured range the
            host counts as saturated: each slot's speed falls as ``1 / n``.
    """

    slowdown: tuple[float, ...]

    def __post_init__(self) -> None:
        check_slowdown(self.slowdown, "host_slowdown")

    @property
    def num_measured(self) -> int:
        """The largest number of busy slots measured."""
        return len(self.slowdown)

    def factor(self, num_busy: int) -> float:
        """How many times longer a slot's work takes while ``num_busy`` slots are busy
        (1.0 for none or one)."""
        if num_busy <= 1:
            return 1.0
        if num_busy <= len(self.slowdown):
            return self.slowdown[num_busy - 1]
        return self.slowdown[-1] * num_busy / len(self.slowdown)


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
