"""The controller process's CPU per response and per token, fitted from a run's
per-iteration records: known coefficients are recovered, a negative term is dropped,
and a run that cannot be fitted (too few iterations, no record, slots that do not share
the host) is refused or carries no terms."""

from pathlib import Path

import numpy as np
import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, dump_config
from dynarl.obs.metrics import IterationStats, write_metrics
from dynarl.sim.controller_cpu import (
    MIN_ITERATIONS,
    controller_cost_of_run,
    fit_controller_cost,
)
from dynarl.sim.errors import SimError
from dynarl.sim.profile_file import measured_profile, read_profile, write_profile
from dynarl.workers.config import ModelConfig

PER_REQUEST_S = 0.8e-3
PER_TOKEN_S = 5e-6


def record(i: int, responses: int, tokens: int, cpu_s: float | None) -> IterationStats:
    return IterationStats(
        iteration=i,
        mean_reward=0.0,
        solved_fraction=0.0,
        num_samples=responses,
        gen_tokens=tokens,
        mean_response_tokens=tokens / responses,
        tokens_per_s=0.0,
        loss=0.0,
        grad_norm=0.0,
        weight_version=i + 1,
        stage_s={},
        elapsed_s=1.0,
        controller_cpu_s=cpu_s,
    )


def records(shapes: list[tuple[int, int]], noise: float = 0.0) -> list[IterationStats]:
    rng = np.random.default_rng(0)
    return [
        record(i, n, t, (PER_REQUEST_S * n + PER_TOKEN_S * t) * (1 + noise * rng.standard_normal()))
        for i, (n, t) in enumerate(shapes)
    ]


def test_the_fit_recovers_known_costs_per_response_and_per_token() -> None:
    exact = fit_controller_cost(records([(256, 4000), (256, 14000), (64, 9000)]))
    assert exact.per_request_s == pytest.approx(PER_REQUEST_S)
    assert exact.per_token_s == pytest.approx(PER_TOKEN_S)
    assert exact.rms_fit == pytest.approx(0.0, abs=1e-9)
    assert exact.num_iterations == 3
    # Every iteration of one run holds the same responses: the per-response term is
    # the intercept, still recovered while the tokens vary.
    shapes = [(256, t) for t in range(4000, 15000, 1000)]
    noisy = fit_controller_cost(records(shapes, noise=0.02))
    assert noisy.per_request_s == pytest.approx(PER_REQUEST_S, rel=0.15)
    assert noisy.per_token_s == pytest.approx(PER_TOKEN_S, rel=0.15)
    assert noisy.rms_fit < noisy.rms_per_token_only


def test_a_negative_term_is_dropped_and_the_other_unit_carries_the_cpu() -> None:
    # CPU falling with the responses at fixed tokens: no cost per response fits it
    rows = [record(0, 100, 10000, 0.05), record(1, 200, 10000, 0.04), record(2, 50, 9000, 0.05)]
    cost = fit_controller_cost(rows)
    assert cost.per_request_s == 0.0
    assert cost.per_token_s == pytest.approx(0.14 / 29000)


def test_a_fit_without_enough_recorded_iterations_is_refused() -> None:
    with pytest.raises(SimError, match=f"takes at least {MIN_ITERATIONS}"):
        fit_controller_cost(records([(256, 4000)]))
    with pytest.raises(SimError, match=r"records no controller CPU.*run it again"):
        fit_controller_cost([*records([(256, 4000)]), record(1, 256, 5000, None)])


def run_dir(path: Path, shapes: list[tuple[int, int]], *overrides: str) -> Path:
    path.mkdir()
    dump_config(apply_overrides(DynaRLConfig(), list(overrides)), path / "config.yaml")
    write_metrics(path / "metrics.jsonl", records(shapes))
    return path


def test_a_run_is_fitted_after_its_warm_up(tmp_path: Path) -> None:
    # the warm-up iteration (workers starting) would not fit the others
    shapes = [(32, 3000), (32, 1000), (32, 2000), (32, 4000)]
    path = run_dir(tmp_path / "run", shapes)
    write_metrics(path / "metrics.jsonl", [record(0, 32, 3000, 5.0), *records(shapes)[1:]])
    cost = controller_cost_of_run(path, warmup=1)
    assert cost is not None
    assert (cost.per_request_s, cost.per_token_s) == pytest.approx((PER_REQUEST_S, PER_TOKEN_S))
    assert cost.num_iterations == 3


def test_the_fit_goes_into_the_profile_file_and_the_simulated_host_counts_it(
    tmp_path: Path,
) -> None:
    cost = fit_controller_cost(records([(256, 4000), (256, 14000)]))
    costs = dict.fromkeys(
        (
            "decode_a_s",
            "decode_per_request_s",
            "decode_per_context_s",
            "prefill_overhead_s",
            "prefill_per_token_s",
            "inference_overhead_s",
            "inference_per_token_s",
            "train_overhead_s",
            "train_per_token_s",
        ),
        1e-3,
    )
    path = tmp_path / "profile.json"
    write_profile(
        path,
        measured_profile(
            costs,
            model=ModelConfig(),
            threads=1,
            host="here",
            name="x",
            host_slowdown=(1.0, 1.8),
            controller=cost,
        ),
    )
    read = read_profile(path)
    assert {"controller_cpu_per_request_s", "controller_cpu_per_token_s"} <= set(read.measured)
    host = read.device.host_sharing()
    assert host is not None and host.counts_controller
    assert host.controller_cpu_per_token_s == pytest.approx(PER_TOKEN_S)


def test_a_run_too_short_to_fit_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = run_dir(tmp_path / "run", [(32, 3000), (32, 1000)])
    with pytest.raises(SimError, match=r"holds 2 iteration\(s\).*run.num_iterations=3"):
        controller_cost_of_run(path, warmup=1)
    assert controller_cost_of_run(path, warmup=0) is not None
    with pytest.raises(SimError, match="holds no real run"):
        controller_cost_of_run(tmp_path / "absent")


def test_a_run_whose_slots_do_not_share_the_host_carries_no_terms(tmp_path: Path) -> None:
    """The controller's CPU slows no GPU: a run on GPUs (or on Ray's hosts) has none."""
    shapes = [(32, 3000), (32, 1000), (32, 2000)]
    assert controller_cost_of_run(run_dir(tmp_path / "cpu", shapes)) is not None
    assert (
        controller_cost_of_run(run_dir(tmp_path / "gpu", shapes, "cluster.accelerator=cuda"))
        is None
    )
    ray = run_dir(tmp_path / "ray", shapes, "cluster.launcher=ray")
    assert controller_cost_of_run(ray) is None
