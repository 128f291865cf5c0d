"""The data router's items into a slot's engine, until the worker link is lost.

A rollout engine is fed generate requests (each item's payload is a msgpack
:class:`~dynarl.workers.rollout.GenerateRequest`; its outcome goes back through an
:class:`~dynarl.workers.sinks.ItemSink`), gives back the items the controller asks for
with their partial output, hears which multi-turn sessions are over, and reports its
load (:mod:`dynarl.workers.load_reports`). An inference engine scores the items (msgpack
:class:`~dynarl.workers.inference.LogprobRequest`) in the batches they arrive in.

An item a worker cannot serve (an undecodable payload, a request its engine refuses) is
handed back ``refused`` with the reason: the router finishes it and counts it.
"""

from collections.abc import Callable

import anyio
import msgspec

from dynarl.core.ids import ItemId
from dynarl.data import wire
from dynarl.data.errors import PeerLostError
from dynarl.data.worker_link import WorkerLink
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import InferenceEngine, LogprobRequest, LogprobResult
from dynarl.workers.load_reports import LoadReporter
from dynarl.workers.rollout import GenerateRequest, RolloutEngine
from dynarl.workers.sinks import EachSink, ItemSink

_ENCODER = msgspec.msgpack.Encoder()
_GENERATE = msgspec.msgpack.Decoder(GenerateRequest)
_SCORE = msgspec.msgpack.Decoder(LogprobRequest)


async def feed_rollout(
    engine: RolloutEngine,
    link: WorkerLink,
    *,
    reporter: LoadReporter,
    stats_interval_s: float,
    reporting: Callable[[], bool],
) -> None:
    """Serve ``link``'s rollout items on ``engine`` until the link is lost: requests,
    aborts, session ends, and ``reporter``'s ``EngineStats`` reports (every
    ``stats_interval_s`` while ``reporting()`` says the engine serves, and when it ran
    dry: :class:`~dynarl.workers.load_reports.LoadReporter`)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(reporter.run, stats_interval_s, reporting)
        async with anyio.create_task_group() as feeds:
            feeds.start_soon(_requests, engine, link)
            feeds.start_soon(_aborts, engine, link)
            feeds.start_soon(_session_ends, engine, link)
        tg.cancel_scope.cancel()  # the link is lost: stop reporting


async def _requests(engine: RolloutEngine, link: WorkerLink) -> None:
    """Submit each batch of items the router sends in one call: a submission takes
    the engine's lock between two steps, so items submitted one at a time can enter
    one per step while the engine decodes below its width."""
    while True:
        try:
            items = await link.receive()
        except PeerLostError:
            return
        batch: list[tuple[GenerateRequest, ItemSink]] = []
        for item in items:
            try:
                request = _GENERATE.decode(item.payload)
            except msgspec.DecodeError as e:
                link.complete(refused(item.id, f"not a GenerateRequest: {e}"))
                continue
            request = msgspec.structs.replace(request, request_id=item.id)
            sink = ItemSink(link, item, len(request.output_ids), multi_turn=request.multi_turn)
            batch.append((request, sink))
        submitted = await _submit(engine, link, batch)
        asked_back = [rid for rid in submitted if link.abort_requested(ItemId(rid))]
        if asked_back:  # asked back while they were on their way
            await engine.abort(asked_back)


async def _submit(
    engine: RolloutEngine, link: WorkerLink, batch: list[tuple[GenerateRequest, ItemSink]]
) -> list[str]:
    """Submit ``batch`` in one call; if the engine refuses it (all or none), each
    request alone, so one bad request does not take the others down with it. Returns
    the ids of the requests the engine took."""
    if not batch:
        return []
    try:
        await engine.submit(
            [request for request, _ in batch],
            EachSink({request.request_id: sink for request, sink in batch}),
        )
    except BadRequestError as e:
        if len(batch) == 1:
            link.complete(refused(ItemId(batch[0][0].request_id), e))
            return []
        return [rid for one in batch for rid in await _submit(engine, link, [one])]
    return [request.request_id for request, _ in batch]


async def _aborts(engine: RolloutEngine, link: WorkerLink) -> None:
    """Hand back, with their partial output, the items the controller asks for."""
    while True:
        try:
            wanted = await link.receive_aborts()
        except PeerLostError:
            return
        await engine.abort(wanted)


async def _session_ends(engine: RolloutEngine, link: WorkerLink) -> None:
    """Tell the engine which multi-turn sessions are over (their cached prefixes go)."""
    while True:
        try:
            ended = await link.receive_ended_sessions()
        except PeerLostError:
            return
        await engine.end_sessions(ended)


async def feed_inference(engine: InferenceEngine, link: WorkerLink) -> None:
    """Score ``link``'s items in the batches they arrive in, completing each with its
    ``LogprobResult``, until the link is lost. A batch in progress finishes before an
    abort takes effect (its items complete)."""
    while True:
        try:
            items = await link.receive()
        except PeerLostError:
            return
        batch: list[tuple[wire.Item, LogprobRequest]] = []
        for item in items:
            try:
                sample = _SCORE.decode(item.payload)
            except msgspec.DecodeError as e:
                link.complete(refused(item.id, f"not a LogprobRequest: {e}"))
                continue
            batch.append((item, msgspec.structs.replace(sample, item_id=item.id)))
        if not batch:
            continue
        for (item, sample), result in await _score_each(engine, batch):
            if isinstance(result, BadRequestError):
                link.complete(refused(item.id, result))
                continue
            link.complete(
                wire.ItemResult(
                    item=ItemId(item.id),
                    payload=_ENCODER.encode(result),
                    num_tokens=len(sample.token_ids),
                )
            )


async def _score_each(
    engine: InferenceEngine, batch: list[tuple[wire.Item, LogprobRequest]]
) -> list[tuple[tuple[wire.Item, LogprobRequest], LogprobResult | BadRequestError]]:
    """Each sample of ``batch`` with its log-probs, or with the engine's refusal: a
    refused batch is scored again one sample at a time, so one bad sample does not take
    the others down with it."""
    try:
        results = await engine.score([sample for _, sample in batch])
    except BadRequestError as e:
        if len(batch) == 1:
            return [(batch[0], e)]
        return [pair for one in batch for pair in await _score_each(engine, [one])]
    return list(zip(batch, results, strict=True))


def refused(item: ItemId, reason: BadRequestError | str) -> wire.ItemResult:
    """The result of an item the worker cannot serve: the reason goes back to the
    router, which finishes the item and counts it."""
    return wire.ItemResult(item=item, status="refused", payload=str(reason).encode())
