"""The rollout engine's scheduler: admission order and limits, preemption, removal."""

from dynarl.data.request_order import FifoOrder, RequestOrder, ToolCallPriorityOrder
from dynarl.workers.rollout import GenerateRequest
from dynarl.workers.torch.scheduler import Scheduler
from dynarl.workers.torch.sequence import Sequence, SequenceStatus
from dynarl.workers.torch.waiting import OrderedWaitingList


def _seq(rid: str, prompt_tokens: int = 4, *, tool_calls: int = 0, at: float = 0.0) -> Sequence:
    request = GenerateRequest(
        request_id=rid, prompt_ids=tuple(range(prompt_tokens)), tool_calls=tool_calls
    )
    return Sequence(request, seed=0, enqueued_s=at)


def _scheduler(
    order: RequestOrder | None = None,
    *,
    max_running: int = 8,
    capacity: int = 1000,
    max_prefill: int = 1000,
) -> Scheduler:
    return Scheduler(
        OrderedWaitingList[Sequence](order or FifoOrder()),
        max_running_requests=max_running,
        kv_capacity_tokens=capacity,
        max_prefill_tokens=max_prefill,
    )


def _ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_fifo_admits_in_arrival_order_up_to_max_running() -> None:
    scheduler = _scheduler(max_running=2)
    for i, at in enumerate([3.0, 1.0, 2.0]):
        scheduler.add(_seq(f"r{i}", at=at))
    assert _ids(scheduler.admit()) == ["r1", "r2"]
    assert scheduler.admit() == []
    assert scheduler.num_waiting == 1
    assert all(s.status is SequenceStatus.RUNNING for s in scheduler.running)


def test_tool_call_priority_serves_later_turns_first() -> None:
    scheduler = _scheduler(ToolCallPriorityOrder(), max_running=1)
    scheduler.add(_seq("first-turn", at=0.0))
    scheduler.add(_seq("third-turn", tool_calls=2, at=5.0))
    scheduler.add(_seq("second-turn", tool_calls=1, at=1.0))
    order = []
    for _ in range(3):
        (seq,) = scheduler.admit()
        order.append(seq.request_id)
        scheduler.finish([seq])
    assert order == ["third-turn", "second-turn", "first-turn"]


def test_kv_budget_blocks_admission_without_skipping_the_head() -> None:
    scheduler = _scheduler(capacity=20)
    scheduler.add(_seq("a", 10, at=0))
    scheduler.add(_seq("big", 12, at=1))
    scheduler.add(_seq("small", 2, at=2))
    assert _ids(scheduler.admit()) == ["a"]  # "big" does not fit, and "small" waits behind it
    assert scheduler.kv_tokens_held == 10
    scheduler.finish(scheduler.running)
    assert _ids(scheduler.admit()) == ["big", "small"]


def test_prefill_token_budget_splits_prefill_batches() -> None:
    scheduler = _scheduler(max_prefill=24)
    for i in range(4):
        scheduler.add(_seq(f"r{i}", 10, at=i))
    assert _ids(scheduler.admit()) == ["r0", "r1"]
    assert _ids(scheduler.admit()) == ["r2", "r3"]


def test_decode_preempts_the_newest_back_to_the_queue_with_its_output() -> None:
    scheduler = _scheduler(capacity=24)
    for i in range(2):
        scheduler.add(_seq(f"r{i}", 11, at=i))
    scheduler.add(_seq("late", 1, at=9))
    assert _ids(scheduler.admit()) == ["r0", "r1"]  # "late" does not fit any more
    scheduler.running[1].output_ids.append(5)  # 11 + 12 held; two more do not fit
    preempted = scheduler.preempt_for_decode()
    assert _ids(preempted) == ["r1"]
    assert preempted[0].output_ids == [5]  # it keeps its partial output
    scheduler.finish(scheduler.running)
    # "late" was already next in line when it did not fit, so it keeps its turn.
    assert _ids(scheduler.admit()) == ["late", "r1"]


def test_remove_takes_waiting_and_running_and_the_queue_skips_them() -> None:
    scheduler = _scheduler(max_running=1)
    for i in range(3):
        scheduler.add(_seq(f"r{i}", at=i))
    scheduler.admit()
    taken = scheduler.remove(["r0", "r1", "unknown"])
    assert sorted(_ids(taken)) == ["r0", "r1"]
    assert scheduler.running == [] and scheduler.num_waiting == 1
    assert not scheduler.holds("r1")
    assert _ids(scheduler.admit()) == ["r2"]
    assert _ids(scheduler.remove(None)) == ["r2"]
