"""A rollout slot hands its engine each batch of items the router sends in one
submission (items submitted one at a time entered the torch engine one per step, so a
batch decoded far below the engine's width), and one request the engine refuses does
not take the rest of its batch down with it."""

import functools
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest

pytest.importorskip("torch")

from dynarl.control import events as ev
from dynarl.core.ids import EdgeId, GroupId, ItemId
from dynarl.data import Item, WorkerLink
from dynarl.workers import backends
from dynarl.workers.config import ModelConfig, RolloutConfig
from dynarl.workers.item_feeds import feed_rollout
from dynarl.workers.load_reports import LoadReporter
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.rollout import GenerateRequest, RequestSink, RolloutEngine, SamplingParams

from .helpers import PROMPTS, Cluster, Net, cluster, wait_until

MAX_SEQ_LEN = 64


class Submissions:
    """The real engine, recording how many requests each ``submit`` carried."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.sizes: list[int] = []

    async def submit(self, requests: Sequence[GenerateRequest], sink: RequestSink) -> None:
        self.sizes.append(len(requests))
        await self.engine.submit(requests, sink)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


def _item(i: int, prompt_len: int = 4, *, tag: str = "r") -> Item:
    request = GenerateRequest(
        request_id="set by the slot",
        prompt_ids=(2,) + (5,) * (prompt_len - 1),
        sampling=SamplingParams(max_new_tokens=3, ignore_eos=True, seed=i),
    )
    return Item(
        id=ItemId(f"{tag}{i}"),
        group=GroupId("g"),
        edge=EdgeId(PROMPTS),
        payload=msgspec.msgpack.encode(request),
    )


def _engine() -> Submissions:
    section = RolloutConfig(max_running_requests=16)
    role = RolloutRole(model=ModelConfig(max_seq_len=MAX_SEQ_LEN), rollout=section)
    built = backends.rollout_backend(section).build_rollout(role, name="t", num_threads=1)
    return Submissions(built)


async def _serve(engine: Submissions, link: WorkerLink, *, reporting: bool = False) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.engine.run)
        await feed_rollout(
            engine,  # type: ignore[arg-type]  # the engine, recording its submissions
            link,
            reporter=LoadReporter(engine, link, link.instance),  # type: ignore[arg-type]
            stats_interval_s=60.0,
            reporting=lambda: reporting,
        )
        tg.cancel_scope.cancel()


async def _route(tmp_path: Path, items: list[Item]) -> tuple[Submissions, dict[str, str]]:
    """Route ``items`` at once to one rollout slot's feed; the engine (with its
    submissions) and each item's result status."""
    engine = _engine()
    net = Net("inproc", tmp_path)
    async with cluster(net, [], all_instances=["rollout-0"]) as c:
        c.add_worker("rollout-0", capacity=32, serve=lambda link: _serve(engine, link))
        await c.router.wait_for_instances(1)
        await c.router.submit(items)
        results = await c.collect(len(items))
    await net.aclose()
    return engine, {r.result.item: r.result.status for r in results}


async def test_a_batch_of_items_enters_the_engine_in_one_submission(tmp_path: Path) -> None:
    engine, status = await _route(tmp_path, [_item(i) for i in range(12)])
    assert sorted(status.values()) == ["done"] * 12
    assert engine.sizes == [12]


async def test_a_refused_request_leaves_the_rest_of_its_batch_served(tmp_path: Path) -> None:
    # r1's prompt fills the context: no room for a token, the engine refuses it
    items = [_item(0), _item(1, prompt_len=MAX_SEQ_LEN), _item(2)]
    engine, status = await _route(tmp_path, items)
    assert status == {"r0": "done", "r1": "refused", "r2": "done"}
    assert engine.sizes == [3, 1, 1, 1]  # refused as a batch, then each alone


async def test_an_engine_reports_its_steps_when_it_runs_dry_counted_per_instance(
    tmp_path: Path,
) -> None:
    # Reports on schedule are a minute apart here: the one that comes is the engine
    # running out of requests, with its steps final for what it was given. The same
    # engine then serves as another instance (a slot's parked role resumed): that
    # instance's counts start from zero, not from the engine's start.
    engine = _engine()
    net = Net("inproc", tmp_path)

    def steps_of(c: Cluster, instance: str) -> list[tuple[int, int, int]]:
        return [
            (e.prefill_steps, e.decode_steps, e.decode_tokens)
            for e in c.graph.of(ev.EngineStats)
            if isinstance(e, ev.EngineStats) and e.instance == instance and e.decode_steps
        ]

    async with cluster(net, [], all_instances=["rollout-0", "rollout-1"]) as c:
        for name in ("rollout-0", "rollout-1"):
            c.add_worker(
                name,
                capacity=32,
                serve=lambda link: _serve(engine, link, reporting=True),
            )
            await c.router.wait_for_instances(1)
            await c.router.submit([_item(i, tag=f"{name}-") for i in range(4)])
            await c.collect(4)
            await wait_until(functools.partial(steps_of, c, name))
            c.scopes[name].cancel()
            await wait_until(lambda: not c.router.instances)
        # One prefill admits the four, then two decode steps give their 2nd and 3rd
        # tokens (8 decode tokens): the same for both instances.
        assert steps_of(c, "rollout-0")[-1] == steps_of(c, "rollout-1")[-1] == (1, 2, 8)
    await net.aclose()
    assert engine.engine.load().decode_steps == 4  # the engine's own counts go on
