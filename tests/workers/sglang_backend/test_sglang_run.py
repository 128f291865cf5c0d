"""A real run with ``rollout.backend=sglang``: slots launch fake SGLang servers
(``rollout.sglang.launch_command``), and under ``static-colocated`` every device goes
through rollout, inference and the actor each iteration, so the servers release and
resume their memory, the slots switch roles, and the weights reach the servers by
manifest after every optimizer step; the servers' step counters reach the metrics.
Nothing is left running afterwards."""

import logging
import multiprocessing
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.testing.faults import FaultInjector, WorkerKill
from dynarl.testing.ports import free_port

from .conftest import servers_on

pytestmark = pytest.mark.slow

SMALL = [
    "run.checkpoint_every=0",
    "cluster.num_devices=2",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "algorithm.num_prompts=8",
    "run.num_iterations=2",
    "rollout.backend=sglang",
    "rollout.sglang.launch_command=[python, -m, dynarl.testing.fake_sglang]",
]


@pytest.mark.timeout(300)
async def test_a_colocated_run_on_sglang_servers_syncs_weights_every_iteration(
    tmp_path: Path,
) -> None:
    port = free_port(2)  # launched servers listen on port_base + slot index
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            *SMALL,
            "scheduler.mode=static-colocated",
            f"rollout.sglang.port_base={port}",
            "rollout.sglang.stats_interval_s=0.1",
            f"run.run_dir={tmp_path}",
        ],
    )
    async with DynaRL(cfg) as rl:
        history = [s async for s in rl.iterations()]
    assert [s.weight_version for s in history] == [1, 2]
    assert all(s.gen_tokens > 0 and s.mean_reward >= 0 for s in history)
    # The servers count their decode steps on /metrics (launched with --enable-metrics
    # and the device timer); SGLang does not count its prefill passes.
    for s in history:
        steps = s.engine_steps
        assert steps["decode_steps"] >= 1 and steps["decode_s"] > 0, steps
        assert steps["prefill_steps"] == 0 and steps["prefill_s"] > 0, steps
    for stats in history:  # every device moved through rollout and the actor
        moves = [(m.src, m.dst) for m in stats.migrations]
        assert any(dst == "rollout" for _, dst in moves), moves
        assert stats.allocation == {"rollout": 0, "inference": 0, "actor": 2}
    assert multiprocessing.active_children() == []
    assert not servers_on(port), "a launched server outlived the run"


@pytest.mark.timeout(300)
async def test_engines_of_two_devices_are_relaunched_on_the_devices_each_move_gives_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``rollout.tp=2`` on four devices: each engine's server runs at ``--tp-size 2``
    and takes two ranks of the weight-sync group. The moves do not give a slot the
    same pair of devices every iteration (the first iteration's are (0, 3) and (1, 2),
    prebuilt as (0, 1) and (2, 3)), so a slot closes its server for one on the new
    pair, on the same port, and the new one is brought to the weights the engines
    run before it serves."""
    port = free_port(4)
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            *SMALL,
            "cluster.num_devices=4",
            "rollout.initial_devices=2",
            "rollout.tp=2",
            "scheduler.mode=static-colocated",
            f"rollout.sglang.port_base={port}",
            f"run.run_dir={tmp_path}",
        ],
    )
    with caplog.at_level(logging.INFO, logger="dynarl.api.engine_weights"):
        async with DynaRL(cfg) as rl:
            history = [s async for s in rl.iterations()]
    assert [s.weight_version for s in history] == [1, 2]
    assert all(s.gen_tokens > 0 for s in history)
    brought = [r.getMessage() for r in caplog.records if "brought" in r.getMessage()]
    assert any(m.endswith("to weight version 1") for m in brought), brought
    assert multiprocessing.active_children() == []
    assert not servers_on(*range(port, port + 4)), "a launched server outlived the run"


@pytest.mark.timeout(400)
async def test_a_killed_rollout_slot_is_survived_and_the_servers_keep_taking_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rollout slots on SGLang servers; one is killed mid-rollout, and its server
    dies with it. Its requests run on the survivor, the weight-sync group is abandoned
    (leaving is collective), and at the iteration's sync the surviving server, which
    still holds the old group under the sync's name, joins the rebuilt one: SGLang
    refuses a second group under a name in use, so it destroys the old one first.
    Every iteration trains every sample once and takes the next weight version, and
    the random-init policy written for the killed slot's server goes with it."""
    scratch = tmp_path / "tmp"  # where the slots write their servers' policies
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    port = free_port(3)  # a port per device's slot, as port_base + slot index
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            *SMALL,
            "cluster.num_devices=3",
            "rollout.initial_devices=2",
            "run.num_iterations=3",
            "run.stall_timeout_s=120",
            "scheduler.mode=static-disaggregated",
            "algorithm.old_logprobs=rollout",
            f"rollout.sglang.port_base={port}",
            f"run.run_dir={tmp_path}",
        ],
    )
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, [WorkerKill(target="rollout", point="rollout", iteration=1)])
        injector.attach()
        history = [s async for s in rl.iterations()]
    assert len(injector.kills) == 1
    assert [s.weight_version for s in history] == [1, 2, 3]
    samples = cfg.algorithm.samples_per_iteration
    for (iteration, edge), counts in injector.completions().items():
        assert len(counts) == samples and set(counts.values()) == {1}, (iteration, edge)
    # The killed slot's server died with it (its tether), not left holding its port.
    assert not servers_on(port, port + 1), "a launched server outlived its slot"
    assert not list(scratch.glob("dynarl-sglang-policy-*")), "a policy outlived its slot"
