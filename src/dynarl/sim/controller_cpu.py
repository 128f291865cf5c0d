"""The controller process as a tenant of the host, from a real run's own records: its
CPU seconds per response and per generated token.

A real run records, per iteration, the CPU seconds of its controller process (the one
running the event loop: controller, data router, reward threads, result batches;
``IterationStats.controller_cpu_s`` in ``metrics.jsonl``) beside the responses and
the tokens the iteration generated. :func:`fit_controller_cost` fits

    CPU = per_request_s x responses + per_token_s x tokens

by least squares over the iterations given, both terms at least 0 (a negative one is
dropped and the other unit alone carries the CPU). Every iteration of a run holds the
same number of responses, so within one run the per-response term is the fit's
intercept: a cost per response cannot be told from one per iteration. The simulator
charges it while the engines decode (:class:`~dynarl.sim.host.HostSharing`).

:func:`controller_cost_of_run` fits a run directory's iterations after a warm-up
(``dynarl profile --from-run``); ``bench/sim_fidelity.py`` fits its modes' iterations
with the same function.
"""

from collections.abc import Iterable
from pathlib import Path

import msgspec
import numpy as np

from dynarl.obs.metrics import IterationStats, read_metrics
from dynarl.sim.errors import SimError

MIN_ITERATIONS = 2
"""The fewest iterations a fit takes: one per term."""


class ControllerCost(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's CPU fitted over iterations, and how well it describes them.

    Attributes:
        per_request_s: CPU seconds per response (the profile's
            ``controller_cpu_per_request_s``).
        per_token_s: CPU seconds per generated token on top
            (``controller_cpu_per_token_s``).
        num_iterations: iterations fitted.
        mean_cpu_s, mean_responses, mean_tokens: their means per iteration.
        rms_fit: the fit's root-mean-square residual relative to the mean CPU.
        rms_per_token_only: the same of CPU = k x tokens alone.
        rms_per_request_only: the same of CPU = k x responses alone.
    """

    per_request_s: float
    per_token_s: float
    num_iterations: int
    mean_cpu_s: float
    mean_responses: float
    mean_tokens: float
    rms_fit: float
    rms_per_token_only: float
    rms_per_request_only: float


def fit_controller_cost(records: Iterable[IterationStats]) -> ControllerCost:
    """The controller's CPU per response and per generated token over ``records``
    (the caller leaves out its warm-up).

    Raises:
        SimError: a record has no controller CPU (a run by an older dynarl), or fewer
            than :data:`MIN_ITERATIONS` records are given.
    """
    rows = list(records)
    for r in rows:
        if r.controller_cpu_s is None:
            raise SimError(
                f"iteration {r.iteration} records no controller CPU (controller_cpu_s): "
                "the run was made by an older dynarl; run it again with this one"
            )
    if len(rows) < MIN_ITERATIONS:
        raise SimError(
            f"{len(rows)} iteration(s) to fit the controller's CPU on; it takes at least "
            f"{MIN_ITERATIONS} (one per term): record more iterations"
        )
    cpu = np.array([float(r.controller_cpu_s or 0.0) for r in rows])
    x = np.array([[float(r.num_samples), float(r.gen_tokens)] for r in rows])
    (per_request, per_token), *_ = np.linalg.lstsq(x, cpu, rcond=None)
    if per_request < 0:  # the tokens alone carry it
        per_request, per_token = 0.0, _ratio(cpu, x[:, 1])
    elif per_token < 0:  # the responses alone
        per_request, per_token = _ratio(cpu, x[:, 0]), 0.0
    scale = float(cpu.mean()) or 1.0

    def rms(predicted: np.ndarray) -> float:
        return float(np.sqrt(np.mean((cpu - predicted) ** 2)) / scale)

    return ControllerCost(
        per_request_s=float(per_request),
        per_token_s=float(per_token),
        num_iterations=len(rows),
        mean_cpu_s=float(cpu.mean()),
        mean_responses=float(x[:, 0].mean()),
        mean_tokens=float(x[:, 1].mean()),
        rms_fit=rms(x @ np.array([per_request, per_token])),
        rms_per_token_only=rms(x[:, 1] * _ratio(cpu, x[:, 1])),
        rms_per_request_only=rms(x[:, 0] * _ratio(cpu, x[:, 0])),
    )


def _ratio(cpu: np.ndarray, unit: np.ndarray) -> float:
    """CPU per unit over all rows (0 without units)."""
    total = float(unit.sum())
    return float(cpu.sum()) / total if total > 0 else 0.0


def controller_cost_of_run(run_dir: str | Path, *, warmup: int = 1) -> ControllerCost | None:
    """The controller's CPU per response and per token fitted over the iterations of
    the real run in ``run_dir`` after the first ``warmup`` (which start the workers and
    warm their caches); ``None`` when the run's slots do not share the controller's
    host (:func:`~dynarl.api.assembly.slots_share_host`, from the run's
    ``config.yaml``: GPUs or other hosts), whose CPU then slows none of them.

    Raises:
        SimError: the directory holds no run, the run records no controller CPU, or it
            has too few iterations after the warm-up; the message says what to do.
    """
    from dynarl.api.assembly import slots_share_host
    from dynarl.api.run_dir import RunDirectory

    files = RunDirectory(run_dir)
    if warmup < 0:
        raise SimError(f"warmup={warmup}: need 0 or more iterations to leave out")
    if not files.metrics_path.is_file() or not files.config_path.is_file():
        raise SimError(
            f"{run_dir} holds no real run (config.yaml and metrics.jsonl): pass the "
            "run directory `dynarl run --out DIR` wrote"
        )
    if not slots_share_host(files.load_config()):
        return None
    records = read_metrics(files.metrics_path)
    wanted = warmup + MIN_ITERATIONS
    if len(records) < wanted:
        raise SimError(
            f"{run_dir} holds {len(records)} iteration(s); fitting the controller's CPU "
            f"takes {MIN_ITERATIONS} after the {warmup} warm-up iteration(s): run it for "
            f"at least {wanted} (continue it with `dynarl run --resume {run_dir} --set "
            f"run.num_iterations={wanted}`, or start it again with "
            f"run.num_iterations={wanted}), or leave out fewer warm-up iterations "
            "(--warmup)"
        )
    return fit_controller_cost(records[warmup:])
