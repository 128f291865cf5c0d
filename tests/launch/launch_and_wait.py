"""A controller process for the orphan test: binds a router, launches slots, prints
their pids as one JSON line, then waits to be killed.

Usage: ``python launch_and_wait.py ENDPOINT NUM_SLOTS``
"""

import json
import sys

import anyio

from dynarl.core.ids import ComponentId, EdgeId
from dynarl.data import Router
from dynarl.data.zmq_transport import ZmqTransport
from dynarl.launch.local import LaunchConfig, LocalLauncher
from dynarl.workers.slot import SlotConfig


async def main(endpoint: str, num_slots: int) -> None:
    transport = ZmqTransport.bind(endpoint)
    consumers = {EdgeId("prompts"): [ComponentId("rollout")]}
    async with (
        Router(transport, consumers=consumers) as router,
        LocalLauncher(router, LaunchConfig(num_slots=num_slots, slot=SlotConfig())) as launcher,
    ):
        print(json.dumps([slot.pid for slot in launcher.slots]), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]))
