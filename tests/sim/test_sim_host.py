"""Slots sharing a host's cores: the measured slowdown curve, applied as processor
sharing to every simulated worker, the controller process counted as a fractional
busy slot; a profile without the curve keeps devices independent."""

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from recipes import e2e_cpu

from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.core.virtual_time import VirtualTimeLoop
from dynarl.sim import H100, EngineConfig, Job, SimEngine, model
from dynarl.sim.cluster import ClusterModel, host_slowdown
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import SimConfig, SimulatedRun, simulated_run
from dynarl.sim.cpu_device import CPU_1T
from dynarl.sim.cpu_profile import cpu_cluster, replay_workload
from dynarl.sim.errors import SimError
from dynarl.sim.host import HostSharing
from dynarl.sim.profile_file import ProfileFile, measured_profile, read_profile
from dynarl.sim.run import ModeResult, simulate
from dynarl.workers.config import ModelConfig


def test_the_curve_gives_the_measured_factor_and_saturates_past_it() -> None:
    host = HostSharing(slowdown=(1.0, 1.6, 2.7))
    assert [host.factor(n) for n in (0, 1, 2, 3)] == [1.0, 1.0, 1.6, 2.7]
    # past the measured range the host is saturated: each slot's speed falls as 1/n
    assert host.factor(6) == pytest.approx(2.7 * 6 / 3)


def test_a_fractional_count_interpolates_between_the_curve_points() -> None:
    host = HostSharing(slowdown=(1.0, 1.6, 2.7))
    assert host.factor(0.5) == 1.0
    assert host.factor(1.5) == pytest.approx(1.3)
    assert host.factor(2.25) == pytest.approx(1.6 + 0.25 * 1.1)
    # past the measured range, between the saturated points
    assert host.factor(3.5) == pytest.approx(2.7 + 0.5 * (2.7 * 4 / 3 - 2.7))


def test_the_controller_takes_its_cpu_times_the_rates_at_most_a_core() -> None:
    host = HostSharing(
        slowdown=(1.0, 2.0), controller_cpu_per_request_s=1e-3, controller_cpu_per_token_s=20e-6
    )
    # 10k tokens/s and 100 responses/s: 0.2 + 0.1 CPU-s a second
    assert host.controller_load(10_000.0, 100.0) == pytest.approx(0.3)
    assert host.controller_load(1e6, 0.0) == 1.0  # one Python process: one core
    assert HostSharing(slowdown=(1.0, 2.0)).controller_load(1e6, 1e3) == 0.0  # not measured
    with pytest.raises(SimError, match="controller_cpu_per_token_s=-1"):
        HostSharing(slowdown=(1.0,), controller_cpu_per_token_s=-1.0)
    with pytest.raises(SimError, match="controller_cpu_per_request_s=nan"):
        HostSharing(slowdown=(1.0,), controller_cpu_per_request_s=float("nan"))


def test_the_predictor_gets_the_curve_a_real_run_gets_on_the_hosts_cores() -> None:
    cfg, _ = _colocated((1.0, 2.5))

    def curve(cores: int) -> tuple[float, ...]:
        profile = msgspec.structs.replace(CPU_1T, host_slowdown=(1.0, 2.5), host_cores=cores)
        return host_slowdown(cpu_cluster(cfg, profile=profile), 2)

    # 2 one-thread slots on 2 cores: a real run's predictor sees no slowdown
    assert curve(2) == (1.0, 1.0)
    assert curve(1) == (1.0, 2.0)
    assert curve(0) == (1.0, 2.5)  # cores not recorded: the measured curve
    gpu = simulated_run({}, ["sim.gpu=H100", "run.num_iterations=1"])
    assert host_slowdown(build_cluster(gpu), 4) == ()


@pytest.mark.parametrize(
    ("curve", "match"),
    [((), "at least one point"), ((2.0, 3.0), r"host_slowdown\[0\]=2.0"), ((1.0, 0.0), "2 slots")],
)
def test_a_malformed_curve_is_refused(curve: tuple[float, ...], match: str) -> None:
    with pytest.raises(SimError, match=match):
        HostSharing(slowdown=curve)
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.convert({"slowdown": list(curve)}, HostSharing)


def test_an_engine_slowed_mid_flight_finishes_the_rest_at_the_new_speed() -> None:
    config = EngineConfig(gpu=H100, model=model("R1-Distill-Qwen-1.5B"))
    jobs = [Job(id=ItemId("r"), group=GroupId("g"), context_tokens=64, output_tokens=400)]
    alone = SimEngine(config, instance=InstanceId("a"))
    alone.submit(jobs)
    end = alone.advance_to(1e9)[0].time_s
    shared = SimEngine(config, instance=InstanceId("b"))
    shared.submit(jobs)
    shared.advance_to(end / 2)
    shared.set_slowdown(3.0)
    late = shared.advance_to(1e9)[0].time_s
    # half the work at full speed, the other half three times slower (to a step)
    assert late == pytest.approx(end / 2 + 3 * end / 2, rel=0.01)


def _run(cfg: SimulatedRun, cluster: ClusterModel) -> ModeResult:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        result, _ = runner.run(simulate(cfg, cluster=cluster))
    return result


def _colocated(curve: tuple[float, ...]) -> tuple[SimulatedRun, ClusterModel]:
    """Two slots in lockstep: every stage runs on both, with equal work on each."""
    cfg = simulated_run(
        SimulatedRun(job=e2e_cpu("static-colocated"), sim=SimConfig(gpu="cpu-1t")),
        [
            "algorithm.num_prompts=8",
            "algorithm.group_size=4",
            "rollout.max_running_requests=16",  # both engines get half the requests
            "algorithm.old_logprobs=inference",  # an inference stage too
            "run.num_iterations=2",
        ],
    )
    generated = [{f"{i}-{p}-{g}": 30 for p in range(8) for g in range(4)} for i in range(2)]
    profile = msgspec.structs.replace(CPU_1T, host_slowdown=curve)
    workload = replay_workload(cfg.job, generated, prompt_tokens=[[10] * 8] * 2)
    return cfg, cpu_cluster(cfg, profile=profile, workload=workload)


def test_two_busy_slots_on_a_host_each_take_the_measured_factor_longer() -> None:
    alone = _run(*_colocated((1.0, 1.0)))
    shared = _run(*_colocated((1.0, 2.5)))
    for component in ("rollout", "inference", "actor"):
        ratio = shared.devices[component].busy / alone.devices[component].busy
        assert ratio == pytest.approx(2.5, rel=0.02), component
    # migrations and weight sync are not computed on the slots: not stretched
    assert shared.mean_iteration_s > 1.5 * alone.mean_iteration_s


def _disaggregated(
    per_token_s: float, per_request_s: float = 0.0
) -> tuple[SimulatedRun, ClusterModel]:
    """One rollout slot and one trainer slot; the trainer waits for the whole rollout
    (seeded minibatches), so the rollout slot decodes alone on the host."""
    cfg = simulated_run(
        SimulatedRun(job=e2e_cpu("static-disaggregated"), sim=SimConfig(gpu="cpu-1t")),
        ["algorithm.num_prompts=8", "algorithm.group_size=4", "run.num_iterations=2"],
    )
    generated = [{f"{i}-{p}-{g}": 60 for p in range(8) for g in range(4)} for i in range(2)]
    profile = msgspec.structs.replace(
        CPU_1T,
        host_slowdown=(1.0, 2.0),
        controller_cpu_per_token_s=per_token_s,
        controller_cpu_per_request_s=per_request_s,
    )
    workload = replay_workload(cfg.job, generated, prompt_tokens=[[10] * 8] * 2)
    return cfg, cpu_cluster(cfg, profile=profile, workload=workload)


def test_a_lone_slot_decodes_slower_beside_the_measured_controller() -> None:
    alone = _run(*_disaggregated(0.0))
    # the controller at a full core while the engine decodes: a second busy slot
    busy = _run(*_disaggregated(1.0))
    ratio = busy.devices["rollout"].busy / alone.devices["rollout"].busy
    assert 1.5 < ratio <= 2.0 + 1e-6
    assert busy.devices["actor"].busy == pytest.approx(alone.devices["actor"].busy, rel=1e-6)
    # at a fraction of a core, a fraction of the step to two busy slots
    some = _run(*_disaggregated(2e-6))
    assert alone.devices["rollout"].busy < some.devices["rollout"].busy
    assert some.devices["rollout"].busy < busy.devices["rollout"].busy
    # a cost per response, spread over its 60 tokens, weighs as much as 1/60 per token
    per_response = _run(*_disaggregated(0.0, 60 * 2e-6))
    assert per_response.devices["rollout"].busy == pytest.approx(
        some.devices["rollout"].busy, rel=1e-6
    )


def test_a_profile_without_the_curve_keeps_devices_independent() -> None:
    cfg, cluster = _colocated(())
    assert cluster.host is None
    flat = _run(*_colocated((1.0, 1.0)))
    assert _run(cfg, cluster).mean_iteration_s == pytest.approx(flat.mean_iteration_s, rel=1e-9)
    gpu = simulated_run({}, ["sim.gpu=H100", "run.num_iterations=1"])
    assert build_cluster(gpu).host is None


_VERSION_3 = ("step_dispatch_s", "join_per_held_token_s", "leave_per_held_token_s")
_VERSION_4 = ("controller_cpu_per_request_s", "controller_cpu_per_token_s", "host_cores")


def test_a_version_1_profile_file_reads_as_independent_slots(tmp_path: Path) -> None:
    device = msgspec.to_builtins(msgspec.structs.replace(CPU_1T, host_slowdown=()))
    for field in ("host_slowdown", *_VERSION_3, *_VERSION_4):  # fields of later versions
        del device[field]
    old = {"profile_version": 1, "device": device, "model": {}}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    assert read_profile(path).device.host_sharing() is None
    # a version 1 file that carries the curve is a mistake, not silently version 2
    device["host_slowdown"] = [1.0, 2.0]
    path.write_text(json.dumps(old))
    with pytest.raises(SimError, match="version 2 field"):
        read_profile(path)
    # version 2 holds it, and a malformed curve is refused with the field named
    path.write_text(json.dumps({**old, "profile_version": 2}))
    assert read_profile(path).device.host_sharing() == HostSharing(slowdown=(1.0, 2.0))
    device["host_slowdown"] = [2.0]
    path.write_text(json.dumps({**old, "profile_version": 2}))
    with pytest.raises(SimError, match=r"host_slowdown\[0\]=2.0"):
        read_profile(path)


def test_a_version_2_profile_file_reads_without_the_engine_costs(tmp_path: Path) -> None:
    device = msgspec.to_builtins(CPU_1T)
    dispatch = device.pop("step_dispatch_s")
    for field in (*_VERSION_3[1:], *_VERSION_4):
        del device[field]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"profile_version": 2, "device": device, "model": {}}))
    read = read_profile(path).device
    assert (read.step_dispatch_s, read.join_per_held_token_s) == (0.0, 0.0)
    device["step_dispatch_s"] = dispatch
    path.write_text(json.dumps({"profile_version": 2, "device": device, "model": {}}))
    with pytest.raises(SimError, match=r"device\.step_dispatch_s is a version 3 field"):
        read_profile(path)
    path.write_text(json.dumps({"profile_version": 3, "device": device, "model": {}}))
    assert read_profile(path).device.step_dispatch_s == dispatch


def test_a_version_3_profile_file_reads_without_the_controller(tmp_path: Path) -> None:
    device = msgspec.to_builtins(CPU_1T)
    for field in _VERSION_4:
        del device[field]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps({"profile_version": 3, "device": device, "model": {}}))
    host = read_profile(path).device.host_sharing()
    assert host is not None
    assert (host.controller_cpu_per_token_s, host.cores) == (0.0, 0)
    device["controller_cpu_per_token_s"] = 30e-6
    path.write_text(json.dumps({"profile_version": 3, "device": device, "model": {}}))
    with pytest.raises(SimError, match=r"controller_cpu_per_token_s is a version 4 field"):
        read_profile(path)
    device["host_cores"] = 2
    path.write_text(json.dumps({"profile_version": 4, "device": device, "model": {}}))
    host = read_profile(path).device.host_sharing()
    assert host is not None
    assert (host.controller_cpu_per_token_s, host.cores) == (30e-6, 2)


def test_a_profiling_run_records_the_hosts_cores() -> None:
    costs = {
        "decode_a_s": 3e-3,
        "decode_per_request_s": 4e-5,
        "decode_per_context_s": 1e-7,
        "prefill_overhead_s": 3e-3,
        "prefill_per_token_s": 1e-5,
        "inference_overhead_s": 1e-3,
        "inference_per_token_s": 1e-5,
        "train_overhead_s": 2e-3,
        "train_per_token_s": 4e-5,
    }

    def profile(**host: Any) -> ProfileFile:
        return measured_profile(
            costs, model=ModelConfig(), threads=1, host="here", name="x", **host
        )

    file = profile(host_slowdown=(1.0, 1.8), host_cores=2)
    assert file.device.host_cores == 2
    assert file.measured[-2:] == ("host_slowdown", "host_cores")
    assert "host_cores" not in profile().measured
