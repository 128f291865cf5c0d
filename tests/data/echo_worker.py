"""A worker process for the data-plane tests: connects to a router over ZeroMQ and
completes every item with ``payload@instance`` after ``delay_s``.

Usage: ``python echo_worker.py ENDPOINT INSTANCE CAPACITY DELAY_S``
"""

import sys

import anyio

from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import ItemResult, PeerLostError, open_worker_link
from dynarl.data.zmq_transport import ZmqTransport


async def main(endpoint: str, instance: str, capacity: int, delay_s: float) -> None:
    transport = ZmqTransport.connect(endpoint)
    try:
        async with open_worker_link(
            transport,
            instance=InstanceId(instance),
            component=ComponentId("rollout"),
            capacity=capacity,
        ) as link:

            async def serve(item_id: str, payload: bytes) -> None:
                await anyio.sleep(delay_s)
                link.complete(
                    ItemResult(
                        item=item_id, payload=payload + b"@" + instance.encode(), num_tokens=1
                    )
                )

            async with anyio.create_task_group() as tg:
                while True:
                    for item in await link.receive():
                        tg.start_soon(serve, item.id, item.payload)
    except PeerLostError:
        pass
    finally:
        await transport.aclose()


if __name__ == "__main__":
    endpoint, instance, capacity, delay_s = sys.argv[1:5]
    anyio.run(main, endpoint, instance, int(capacity), float(delay_s))
