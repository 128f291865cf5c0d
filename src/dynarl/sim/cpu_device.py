"""A CPU device slot's measured costs (:class:`CpuProfile`) and the built-in profile
of the development machine (:data:`CPU_1T`): plain data, read by the profile files
(:mod:`dynarl.sim.profile_file`) and turned into the simulator's cost models by
:mod:`dynarl.sim.cpu_profile`."""

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from dynarl.sim.errors import SimError
from dynarl.sim.host import HostSharing, check_controller_cpu, check_slowdown


class CpuProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Measured costs of the reference workers on one CPU device slot.

    Attributes:
        name: table key (``sim.gpu`` selects it), e.g. ``"cpu-1t"``.
        threads: torch threads per slot the figures were measured with.
        decode_step_s: fixed cost of one decode step (forward, sampling, bookkeeping).
        decode_per_request_s: extra decode-step cost per running request (sampling and
            bookkeeping in Python).
        decode_per_context_token_s: extra decode-step cost per token of context held.
        prefill_overhead_s: fixed cost of one prefill batch.
        prefill_per_token_s: prefill cost per prompt token.
        step_dispatch_s: extra cost of every engine step (decode or prefill) when the
            rollout worker's loop drives it (a hop to a worker thread and back, the
            engine lock, completions handed on) rather than a bare ``step()`` call.
        join_per_held_token_s: extra cost of a prefill into a running batch per token
            of KV the batch holds at its padded width (the cache rebuilt with the new
            rows).
        leave_per_held_token_s: cost of finished rows leaving the running batch, per
            token of KV the remaining rows hold at their padded width.
        inference_overhead_s: fixed cost of one log-prob micro-batch.
        inference_per_token_s: log-prob cost per (padded) token.
        train_overhead_s: fixed cost of one optimizer step on a rank.
        train_per_token_s: forward plus backward cost per padded token on one slot.
        train_per_token_context_s: extra training cost per padded token per token of
            context it attends to (half the minibatch's width on average): attention
            makes a token of a wide minibatch dearer than one of a narrow one.
        dp_alpha: data-parallel efficiency ``1 / (1 + dp_alpha * log2(ranks))`` (gloo
            all-reduce of the gradients).
        engine_acquire_s: a rollout or inference instance taking a device (resume,
            weights from the trainer, first stats).
        reshard_s: the trainer growing or shrinking by a device (state over gloo, group
            rebuild).
        reboot_s: a worker restarted on its device.
        weight_sync_s: pushing the new weights to every engine after the last step.
        transfer_bytes_per_s: bandwidth of moving state between two slots (weights,
            optimizer state; gloo), on top of the setup times above; ``None``: the
            setup times are the whole cost (the tiny model's bytes are negligible).
        iteration_overhead_s: per-iteration time outside the modelled stages (prompt
            encoding, routing round trips, reward, advantage and minibatch building).
        host_slowdown: how the slots of one host slow each other down: element
            ``n - 1`` is how many times longer a slot's work takes while ``n`` slots
            compute at once than alone (``1.0`` first;
            :class:`~dynarl.sim.host.HostSharing`). Empty: not measured, and the
            simulated slots are independent (as if each had cores of its own).
        controller_cpu_per_request_s: CPU seconds the controller process (router,
            reward, result batches, controller) spends per response, fitted from a real
            run's records (``dynarl profile --from-run``, ``bench/sim_fidelity.py``:
            :mod:`dynarl.sim.controller_cpu`); with ``host_slowdown`` the controller counts
            as a fractional busy slot on the curve while the engines decode
            (:class:`~dynarl.sim.host.HostSharing`). 0: not measured.
        controller_cpu_per_token_s: its CPU seconds per generated token on top (0:
            not measured; both 0: the controller is not counted).
        host_cores: the cores of the host measured (0: not recorded): the simulated
            controller's predictor is given the curve a real run's is there (ideal
            processor sharing on them) rather than the measured one.
    """

    name: str
    threads: int = 1
    decode_step_s: float
    decode_per_request_s: float = 0.0
    decode_per_context_token_s: float
    prefill_overhead_s: float
    prefill_per_token_s: float
    step_dispatch_s: float = 0.0
    join_per_held_token_s: float = 0.0
    leave_per_held_token_s: float = 0.0
    inference_overhead_s: float
    inference_per_token_s: float
    train_overhead_s: float
    train_per_token_s: float
    train_per_token_context_s: float = 0.0
    dp_alpha: float = 0.1
    engine_acquire_s: float
    reshard_s: float
    reboot_s: float = 30.0
    weight_sync_s: float
    transfer_bytes_per_s: float | None = None
    iteration_overhead_s: float = 0.0
    host_slowdown: tuple[float, ...] = ()
    controller_cpu_per_request_s: float = 0.0
    controller_cpu_per_token_s: float = 0.0
    host_cores: int = 0

    def __post_init__(self) -> None:
        if self.host_slowdown:
            check_slowdown(self.host_slowdown, "host_slowdown")
        check_controller_cpu(self.controller_cpu_per_request_s, "controller_cpu_per_request_s")
        check_controller_cpu(self.controller_cpu_per_token_s, "controller_cpu_per_token_s")
        if self.host_cores < 0:
            raise SimError(f"host_cores={self.host_cores}: need 0 (not recorded) or more")

    def host_sharing(self) -> HostSharing | None:
        """The host-sharing model of :attr:`host_slowdown`, the controller tenant and the
        cores (``None`` if the curve is not measured)."""
        if not self.host_slowdown:
            return None
        return HostSharing(
            slowdown=self.host_slowdown,
            controller_cpu_per_request_s=self.controller_cpu_per_request_s,
            controller_cpu_per_token_s=self.controller_cpu_per_token_s,
            cores=self.host_cores,
            threads=self.threads,
        )


CPU_1T = CpuProfile(
    name="cpu-1t",
    threads=1,
    # bench/profile_cpu.py on the shared 2-core development machine (default model
    # shape: hidden 64, 2 layers, fp32; one torch thread), medians of four runs; single
    # runs scattered by 2-3x with the other tenants' load (decode step 2.0-7.3 ms).
    decode_step_s=3.4e-3,
    decode_per_request_s=44e-6,
    decode_per_context_token_s=0.1e-6,
    prefill_overhead_s=3.6e-3,
    prefill_per_token_s=13e-6,
    # the worker loop's cost per step and the padded cache's rebuilds: the dispatch
    # and churn parts of bench/profile_cpu.py, medians of 4-8 rounds on 2026-12-03
    # (step 0.09-0.25 ms; join 0.07-0.24 us, leave 0.02-0.12 us per token held)
    step_dispatch_s=0.17e-3,
    join_per_held_token_s=0.13e-6,
    leave_per_held_token_s=0.04e-6,
    inference_overhead_s=1.4e-3,
    inference_per_token_s=16e-6,
    train_overhead_s=2e-3,
    train_per_token_s=41e-6,
    # bench/e2e_cpu.py (2 devices, iterations 1-5 of every mode): medians of the
    # migration records and of the sync stage.
    engine_acquire_s=0.025,
    reshard_s=0.07,
    weight_sync_s=0.04,
    iteration_overhead_s=0.0,
    # bench/profile_cpu.py --host-scaling 4, the mean of two runs (x2.24/3.52/6.04 and
    # x1.58/2.35/2.83 for 2/3/4 slots) under other tenants' load (load average 3.5-6.5
    # on 2 cores). It moves with that load: the 2-slot point measured between
    # bench/sim_fidelity.py's iterations ranged x1.1-5.2, mostly near x1.1 or x2.5.
    host_slowdown=(1.0, 1.91, 2.93, 4.44),
)
"""One-thread CPU device slot of the development machine, default model shape."""

CPU_PROFILES: Mapping[str, CpuProfile] = MappingProxyType({p.name: p for p in (CPU_1T,)})
"""Every built-in CPU profile by name."""
