"""Worker mains for the Ray launcher's tests: module-level, so a Ray actor's child
process imports them by name."""

import anyio

from dynarl.core.ids import ComponentId, InstanceId
from dynarl.data import ItemResult, PeerLostError, open_worker_link
from dynarl.data.endpoint import split_endpoint
from dynarl.data.zmq_transport import ZmqTransport


def echo_worker(endpoint: str, name: str, num_threads: int) -> None:
    """Answers every call with ``b"pong:" + body`` and serves each item after 0.2 s
    (its result's payload names the worker); prints a line when it is up."""

    async def serve() -> None:
        address, token = split_endpoint(endpoint)
        transport = ZmqTransport.connect(address)
        try:
            async with (
                open_worker_link(
                    transport,
                    instance=InstanceId(name),
                    component=ComponentId("rollout"),
                    capacity=4,
                    token=token,
                ) as link,
                anyio.create_task_group() as tg,
            ):
                print(f"{name} serving", flush=True)

                async def answer() -> None:
                    while True:
                        call = await link.receive_call()
                        await link.reply(call.corr, b"pong:" + call.body)

                tg.start_soon(answer)
                while True:
                    for item in await link.receive():
                        await anyio.sleep(0.2)
                        link.complete(
                            ItemResult(item=item.id, payload=item.payload + b"@" + name.encode())
                        )
        except PeerLostError:
            pass
        finally:
            await transport.aclose()

    anyio.run(serve)
