"""The simulator's CPU worker profile: the e2e bench's setting simulates, sensibly."""

import asyncio
import math

import msgspec
import numpy as np
import pytest
from recipes import e2e_cpu

from dynarl.api.config import DynaRLConfig
from dynarl.control.topology import ACTOR
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim.cluster import ClusterModel, sequence_tokens, sim_profile
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimConfig, SimulatedRun, simulated_run
from dynarl.sim.costs import attended_context, expected_longest
from dynarl.sim.cpu_device import CPU_1T
from dynarl.sim.cpu_profile import cpu_cluster, replay_workload
from dynarl.sim.errors import SimError
from dynarl.sim.run import ModeResult, simulate

MODES = ("dynamic", "static-colocated", "static-disaggregated")


def cpu_run(cfg: DynaRLConfig, *sets: str) -> SimulatedRun:
    """The job simulated on the CPU worker profile."""
    return simulated_run(SimulatedRun(job=cfg, sim=SimConfig(gpu="cpu-1t")), sets)


def _small(mode: str, *sets: str) -> SimulatedRun:
    return cpu_run(
        e2e_cpu(mode),  # type: ignore[arg-type]
        "algorithm.num_prompts=8",
        "algorithm.group_size=4",
        "sim.median_output_tokens=40",
        "run.num_iterations=2",
        *sets,
    )


def _run(cfg: SimulatedRun, cluster: ClusterModel | None = None) -> ModeResult:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(cfg, cluster=cluster))
    return result


def test_the_recipe_selects_the_cpu_profile() -> None:
    cluster = build_cluster(cpu_run(e2e_cpu()))
    assert cluster.gpu.name == CPU_1T.name
    assert cluster.train_after_rollout and cluster.padded_batches
    completion = cpu_run(e2e_cpu(), "algorithm.minibatch_order=completion")
    assert not build_cluster(completion).train_after_rollout
    a, b = cluster.engine.step_coefficients()
    assert a == pytest.approx(CPU_1T.decode_step_s + CPU_1T.step_dispatch_s)
    assert b == pytest.approx(CPU_1T.decode_per_context_token_s)
    assert cluster.engine.step_per_request_s == CPU_1T.decode_per_request_s


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_simulates_to_a_finite_positive_iteration_time(mode: str) -> None:
    result = _run(_small(mode))
    assert math.isfinite(result.mean_iteration_s) and result.mean_iteration_s > 0
    assert result.generated_tokens == result.requested_tokens


@pytest.mark.parametrize("mode", ["static-colocated", "dynamic"])
def test_more_independent_cpu_devices_are_not_slower(mode: str) -> None:
    # slots with cores of their own (no host-sharing curve): on a shared host, more
    # slots can be slower (tests/sim/test_sim_host.py)
    independent = msgspec.structs.replace(CPU_1T, host_slowdown=())
    two = _small(mode, "cluster.num_devices=2")
    four = _small(
        mode,
        "cluster.num_devices=4",
        "rollout.initial_devices=2",
        "actor.initial_devices=2",
    )
    two_s = _run(two, cpu_cluster(two, profile=independent)).mean_iteration_s
    four_s = _run(four, cpu_cluster(four, profile=independent)).mean_iteration_s
    assert four_s <= two_s * 1.02


def test_a_replay_generates_the_recorded_lengths_and_training_waits_for_it() -> None:
    cfg = _small("static-disaggregated", "run.num_iterations=2")
    generated = [
        {f"{i}-{p}-{g}": 5 + 40 * p * (p == 7) + g for p in range(8) for g in range(4)}
        for i in range(2)
    ]
    cluster = cpu_cluster(cfg, workload=replay_workload(cfg.job, generated))
    barrier = _run(cfg, cluster)
    assert barrier.generated_tokens == sum(sum(it.values()) for it in generated)
    # one long group: with its own device the actor could train the first whole
    # minibatch of groups during that group's decode; the seeded-order loop waits
    pipelined = _run(cfg, msgspec.structs.replace(cluster, train_after_rollout=False))
    assert barrier.mean_iteration_s > pipelined.mean_iteration_s


def test_the_cpu_profile_refuses_a_workload_its_workers_do_not_run() -> None:
    cfg = cpu_run(e2e_cpu(), "sim.workload=agentic")
    with pytest.raises(SimError, match=r"sim\.workload=.agentic"):
        build_cluster(cfg)


def test_the_reference_engine_costs_reach_the_engine_model() -> None:
    """The worker loop's cost per step and the padded cache's rebuilds are charged on
    the modelled engine of a CPU profile; a GPU cluster's engine keeps a paged cache."""
    profile = msgspec.structs.replace(
        CPU_1T, step_dispatch_s=3e-4, join_per_held_token_s=1e-7, leave_per_held_token_s=2e-7
    )
    engine = cpu_cluster(cpu_run(e2e_cpu()), profile=profile).engine
    a, _ = engine.step_coefficients()
    assert a == pytest.approx(CPU_1T.decode_step_s + 3e-4)
    assert engine.prefill_overhead_s == pytest.approx(CPU_1T.prefill_overhead_s + 3e-4)
    assert engine.padded_kv
    assert (engine.join_per_held_token_s, engine.leave_per_held_token_s) == (1e-7, 2e-7)
    gpu = build_cluster(SimulatedRun()).engine
    assert not gpu.padded_kv
    assert gpu.join_per_held_token_s == gpu.leave_per_held_token_s == 0.0


def test_a_profiling_run_fills_the_reference_engine_costs() -> None:
    from dynarl.sim.profile_file import MEASURED, profile_from

    costs = {
        "decode_a_s": 2e-3,
        "decode_per_request_s": 1e-5,
        "decode_per_context_s": 1e-7,
        "prefill_overhead_s": 1e-3,
        "prefill_per_token_s": 1e-5,
        "inference_overhead_s": 1e-3,
        "inference_per_token_s": 1e-5,
        "train_overhead_s": 1e-2,
        "train_per_token_s": 1e-5,
    }
    older = profile_from(costs)  # a profiling run from before these terms: none charged
    assert older.step_dispatch_s == older.join_per_held_token_s == 0.0
    new = {"step_dispatch_s": 2e-4, "join_per_held_token_s": 1e-7, "leave_per_held_token_s": -1.0}
    profile = profile_from({**costs, **new})
    assert profile.step_dispatch_s == 2e-4 and profile.join_per_held_token_s == 1e-7
    assert profile.leave_per_held_token_s == 0.0  # a fitted slope clipped at zero
    assert {"step_dispatch_s", "join_per_held_token_s", "leave_per_held_token_s"} <= set(MEASURED)


def test_the_seed_rows_of_a_padding_trainer_cost_its_steps_as_it_runs_them() -> None:
    # The reference trainer pads each minibatch to its longest sample, so with
    # heavy-tailed lengths a step costs several times its tokens' worth. Seeded with
    # unpadded rows, the simulated controller expected a 1.3 s step to take 0.4 s and
    # kept an idle device from the trainer that the real run's controller moved.
    # Heavy-tailed responses (median 60 tokens, capped at 384), as in the bench.
    run = cpu_run(
        e2e_cpu("dynamic"),  # type: ignore[arg-type]
        "sim.median_output_tokens=60",
        "rollout.max_new_tokens=384",
    )
    cluster = build_cluster(run)
    requests = cluster.workload.generate(np.random.default_rng(0))
    lengths = [sequence_tokens(r) for r in requests]
    per_step = len(requests) // cluster.actor.n_minibatches
    profile = sim_profile(cluster, requests, run.job.cluster.num_devices)
    row = next(r for r in profile.rows if r.component == ACTOR and r.devices == 1)
    longest = expected_longest(lengths, per_step)
    step_s = cluster.actor.step_time_s(per_step * longest, 1, longest / 2)
    step_s *= cluster.host.factor(1) if cluster.host is not None else 1.0
    real_tokens = per_step * sum(lengths) / len(lengths)
    assert row.throughput == pytest.approx(real_tokens / step_s)
    # ... half what the same samples would do unpadded
    unpadded = cluster.actor.step_time_s(real_tokens, 1, attended_context(lengths))
    unpadded *= cluster.host.factor(1) if cluster.host is not None else 1.0
    assert row.throughput < 0.5 * real_tokens / unpadded
