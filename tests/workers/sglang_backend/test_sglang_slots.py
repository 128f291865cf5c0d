"""What an SGLang rollout engine says it runs at once, which its slot tells the data
router at hello: the limit the server reports it runs with, whatever the configuration
says, and the configured ``rollout.max_running_requests`` only when the server reports
none."""

import shutil
import tempfile
from pathlib import Path

import anyio
import msgspec
import pytest

from dynarl.core.ids import ComponentId, EdgeId, InstanceId
from dynarl.data import Router, RouterConfig
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.local import LaunchConfig, LocalLauncher
from dynarl.testing.fake_sglang import FakeSGLang
from dynarl.workers.config import RolloutConfig
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.sglang import messages as m
from dynarl.workers.sglang.backend import BACKEND
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.sglang.handshake import running_limit

from .conftest import MODEL


def attached(fake: FakeSGLang, *, max_running_requests: int) -> RolloutRole:
    """A rollout role on ``fake``, configured to run ``max_running_requests``."""
    rollout = RolloutConfig(
        backend="sglang",
        max_running_requests=max_running_requests,
        sglang=SGLangConfig(urls=(fake.url,)),
    )
    return RolloutRole(model=MODEL, rollout=rollout)


async def built_limit(role: RolloutRole) -> int:
    """What the engine a slot builds for ``role`` says it runs at once."""
    engine = await anyio.to_thread.run_sync(
        lambda: BACKEND.build_rollout(role, name="slot-0", num_threads=1)
    )
    async with anyio.create_task_group() as tg:  # its run closes its HTTP client
        tg.start_soon(engine.run)
        limit = engine.max_running_requests
        tg.cancel_scope.cancel()
    return limit


async def test_an_engine_runs_as_many_as_its_server_reports_not_the_configured_batch() -> None:
    # The server was started without --max-running-requests and chose 5 itself.
    with FakeSGLang(MODEL, max_running_requests=5) as fake:
        assert await built_limit(attached(fake, max_running_requests=64)) == 5
        assert await built_limit(attached(fake, max_running_requests=2)) == 5


async def test_an_engine_on_a_server_that_reports_no_limit_runs_the_configured_batch() -> None:
    with FakeSGLang(MODEL, max_running_requests=5, reports_running_limit=False) as fake:
        assert await built_limit(attached(fake, max_running_requests=8)) == 8


def _info(**fields: object) -> m.ServerInfo:
    """``/get_server_info`` as SGLang answers it, decoded as the adapter decodes it."""
    body = {"version": "0.5.9", "max_total_num_tokens": 4096, **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=m.ServerInfo)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # The scheduler capped the flag's 64 (its pools hold 24 requests).
        (
            {
                "max_running_requests": 64,
                "internal_states": [{"effective_max_running_requests_per_dp": 24}],
            },
            24,
        ),
        # Two data-parallel ranks: each counts as the smaller one.
        (
            {
                "max_running_requests": None,
                "internal_states": [
                    {"effective_max_running_requests_per_dp": 12},
                    {"effective_max_running_requests_per_dp": 10},
                ],
            },
            20,
        ),
        # A scheduler that does not report its limit: the flag bounds it.
        ({"max_running_requests": 32, "internal_states": [{"last_gen_throughput": 0.0}]}, 32),
        ({"max_running_requests": None, "internal_states": [{}]}, None),
        ({}, None),
    ],
)
def test_the_servers_limit_is_read_from_its_schedulers_internal_state(
    fields: dict[str, object], expected: int | None
) -> None:
    assert running_limit(_info(**fields)) == expected


@pytest.mark.timeout(60)  # includes starting a slot process
async def test_a_slot_tells_the_router_the_batch_its_server_runs() -> None:
    sockets = Path(tempfile.mkdtemp(prefix="dyn-"))  # short: a socket path has a limit
    transport = ZmqTransport.bind(f"ipc://{sockets}/router.sock")
    config = RouterConfig(heartbeat_interval_s=0.5, liveness_timeout_s=30.0)
    consumers = {EdgeId("prompts"): [ComponentId("rollout")]}
    try:
        with (
            FakeSGLang(MODEL, max_running_requests=5) as capped,
            FakeSGLang(MODEL, reports_running_limit=False) as silent,
        ):
            async with (
                Router(transport, consumers=consumers, config=config) as router,
                LocalLauncher(router, LaunchConfig(num_slots=1)) as launcher,
            ):
                slot = launcher.slots[0].handle
                announced = {}
                for fake, instance in ((capped, "rollout-0"), (silent, "rollout-1")):
                    role = attached(fake, max_running_requests=8)
                    await slot.assume_role(role, instance=InstanceId(instance))
                    announced[instance] = router._placement.workers[InstanceId(instance)].slots
    finally:
        await transport.aclose()
        shutil.rmtree(sockets, ignore_errors=True)
    assert announced == {"rollout-0": 5, "rollout-1": 8}
