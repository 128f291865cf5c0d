"""The rollout's engines regrouped for its tail (``rollout.tail_tp``) on launched SGLang
servers: each slot leading a group of the tail's size keeps a server of each size, the
wide one prebuilt on its group at the start and asleep beside the narrow one, so a
regroup either way resumes servers and launches none; each server is brought to the
weights the engines run on its own (a narrow server asleep while the wide one took a
sync must not pass for current)."""

import logging
import multiprocessing
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.executor import WorldExecutor
from dynarl.api.facade import DynaRL
from dynarl.api.world import RealWorld
from dynarl.control.plan import InstanceSpec, Migration
from dynarl.control.topology import ROLLOUT
from dynarl.core.ids import DeviceId, InstanceId, MigrationId
from dynarl.testing.ports import free_port

from .conftest import servers_on

pytestmark = pytest.mark.slow


def regroup(
    number: int, drain: list[InstanceId], create: list[tuple[str, tuple[int, ...]]], unit: int
) -> Migration:
    """The migration the resize policy commits: every engine drained, new ones made."""
    specs = tuple(
        InstanceSpec(id=InstanceId(i), devices=tuple(DeviceId(d) for d in ds)) for i, ds in create
    )
    return Migration(
        id=MigrationId(number),
        kind="workload",
        src=ROLLOUT,
        dst=ROLLOUT,
        devices=tuple(sorted({d for s in specs for d in s.devices})),
        drain=tuple(drain),
        create=specs,
        unit=unit,
    )


async def versions(world: RealWorld, *devices: int) -> list[int]:
    """The weight version each device's slot serves with."""
    return [(await world.slot(DeviceId(d)).stats()).weight_version for d in devices]


@pytest.mark.timeout(300)
async def test_a_regroup_for_the_tail_resumes_servers_of_both_sizes_and_syncs_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port(8)  # narrow servers on port + slot, wide ones on port + 4 + slot
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            "run.checkpoint_every=0",
            "cluster.num_devices=4",
            "actor.initial_devices=2",
            "rollout.initial_devices=2",
            "inference.initial_devices=0",
            "algorithm.num_prompts=8",
            "run.num_iterations=1",
            "rollout.backend=sglang",
            "rollout.sglang.launch_command=[python, -m, dynarl.testing.fake_sglang]",
            "rollout.tail_tp=2",
            "scheduler.mode=dynamic",
            f"rollout.sglang.port_base={port}",
            f"run.run_dir={tmp_path}",
        ],
    )
    caplog.set_level(logging.INFO, logger="dynarl.launch.local")
    async with DynaRL(cfg) as rl:
        world = rl._world
        assert world is not None
        narrow = sorted(world.graph.components[ROLLOUT].active_instances(), key=lambda n: n.id)
        assert [tuple(n.devices) for n in narrow] == [(2,), (3,)]
        # Every slot has its narrow server; slots 0 and 2 lead a pair and have a wide one.
        launched = {p: servers_on(port + p) for p in range(8)}
        assert [bool(launched[p]) for p in range(8)] == [True] * 4 + [True, False, True, False]
        async with httpx.AsyncClient() as http:
            info = (await http.get(f"http://127.0.0.1:{port + 4 + 2}/get_server_info")).json()
        assert info["tp_size"] == 2  # its KV cache: as many tokens per device as a narrow one
        assert info["max_total_num_tokens"] == 2 * cfg.rollout.kv_capacity_tokens
        # A fresh run measured an engine of each size as it started (slot 0's, before
        # the trainer loaded), so its predictor can score the regroup.
        measured = sorted((s.engine_devices, s.load) for s in world.decode_samples)
        assert measured == sorted(
            [(1, 1), (1, 1), (1, 64), (1, 64), (2, 1), (2, 1), (2, 64), (2, 64)]
        )
        predictor = rl.controller.predictor if rl.controller is not None else None
        assert predictor is not None
        for size in (1, 2):
            assert predictor.step_costs(ROLLOUT, size) is not None, size

        executor = WorldExecutor(world)
        ids = [n.id for n in narrow]
        await executor.execute(regroup(1001, ids, [("wide-2", (2, 3))], unit=2))
        assert world.slot(DeviceId(2)).engine == ("rollout", (2, 3))
        await world.weights.sync_weights(1)  # the wide server takes version 1 alone
        assert await versions(world, 2) == [1]

        # Back to the narrow engines under their own ids (the hypergraph's placement).
        await executor.execute(
            regroup(1002, [InstanceId("wide-2")], [(i, (2 + k,)) for k, i in enumerate(ids)], 1)
        )
        for i in ids:
            world.router.reactivate(i)
        assert world.slot(DeviceId(2)).engine == ("rollout", (2,))
        # Slot 2's narrow server slept through the sync and was brought to version 1.
        assert await versions(world, 2, 3) == [1, 1]
        # No server was launched or stopped by either regroup.
        assert {p: servers_on(port + p) for p in range(8)} == launched

        history = [s async for s in rl.iterations()]
    assert [s.weight_version for s in history] == [1]  # the run numbers its own syncs
    assert history[0].gen_tokens > 0
    assert multiprocessing.active_children() == []
    assert not servers_on(*range(port, port + 8)), "a launched server outlived the run"
    # Every slot stopped when retired, its servers with it: slot-1, whose prebuilt
    # servers never served, did not connect again as the role it last built.
    assert "did not exit" not in caplog.text
