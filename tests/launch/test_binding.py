"""Where the controller listens, from the cluster section: a private ipc socket for
local workers, TCP on the chosen interface and port otherwise, advertising an address
workers can dial; settings that cannot apply are refused naming the field."""

from pathlib import Path

import pytest

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.core.errors import ConfigError
from dynarl.data.endpoint import node_address
from dynarl.launch.binding import bind_controller
from dynarl.launch.config import ClusterConfig, RayConfig
from dynarl.launch.ray_placement import DevicePlacement, device_groups
from dynarl.testing.ports import free_port


async def test_local_workers_get_a_private_ipc_socket(tmp_path: Path) -> None:
    transport, advertised = bind_controller(ClusterConfig(), tmp_path)
    try:
        assert advertised == transport.address == f"ipc://{tmp_path}/router.sock"
    finally:
        await transport.aclose()


async def test_tcp_on_the_chosen_interface_and_port_advertising_a_dialable_host(
    tmp_path: Path,
) -> None:
    port = free_port()
    cluster = ClusterConfig(bind_host="0.0.0.0", controller_port=port)
    transport, advertised = bind_controller(cluster, tmp_path)
    try:
        assert transport.address == f"tcp://0.0.0.0:{port}"
        assert advertised == f"tcp://{node_address()}:{port}"  # not the wildcard
    finally:
        await transport.aclose()
    cluster = ClusterConfig(bind_host="127.0.0.1", advertise_host="gateway.example")
    transport, advertised = bind_controller(cluster, tmp_path)
    try:
        assert transport.address.startswith("tcp://127.0.0.1:")
        assert advertised == f"tcp://gateway.example:{transport.address.rsplit(':', 1)[1]}"
    finally:
        await transport.aclose()


async def test_ray_listens_on_this_machines_network_address(tmp_path: Path) -> None:
    transport, advertised = bind_controller(ClusterConfig(launcher="ray"), tmp_path)
    try:
        assert transport.address.startswith(f"tcp://{node_address()}:")
        assert advertised == transport.address
    finally:
        await transport.aclose()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["cluster.advertise_host=10.0.0.1"], "cluster.advertise_host"),
        (["cluster.controller_port=5555"], "cluster.controller_port"),
        (["cluster.ray.address=auto"], "cluster.ray"),
    ],
)
def test_settings_that_cannot_apply_to_a_local_ipc_run_are_refused(
    overrides: list[str], field: str
) -> None:
    with pytest.raises(ConfigError) as error:
        apply_overrides(DynaRLConfig(), overrides)
    assert error.value.field == field and "set cluster." in str(error.value)


def test_the_same_settings_are_accepted_where_they_apply() -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        ["cluster.launcher=ray", "cluster.ray.address=auto", "cluster.controller_port=5555"],
    )
    assert cfg.cluster.ray == RayConfig(address="auto") and cfg.cluster.uses_tcp


def test_devices_are_grouped_in_consecutive_blocks_each_asking_half_a_bundle() -> None:
    assert device_groups([3, 0, 2, 1, 4], 2) == [[0, 1], [2, 3], [4]]
    placement = DevicePlacement(range(4), group_size=4, bundle={"CPU": 4.0, "GPU": 1.0})
    assert placement.groups == [[0, 1, 2, 3]]
    assert placement.worker_resources() == {"num_cpus": 2.0, "num_gpus": 0.5}
    cpu_only = DevicePlacement([0], group_size=1, bundle={"CPU": 1.0, "GPU": 0.0})
    assert cpu_only.bundle == {"CPU": 1.0}
