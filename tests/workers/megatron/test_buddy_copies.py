"""The distributed optimizer's buddy copies: which survivor gives each slice after a
loss (the most steps a survivor completed, never a copy of another step), the refusal
when a rank and its buddy both died (with tp > 1: per shard), and on two real gloo
processes a step that fails after the optimizer updated its slice (rolled back to the
boundary) or in the commit (both boundaries kept)."""

import dataclasses
from typing import Any

import pytest
from gloo_processes import gather_from_workers

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynarl.workers.config import ModelConfig  # noqa: E402
from dynarl.workers.errors import TrainerError  # noqa: E402
from dynarl.workers.megatron import buddy, recovery  # noqa: E402
from dynarl.workers.megatron.layout import Layout  # noqa: E402
from dynarl.workers.megatron.spec import ModelSpec  # noqa: E402

SLICED = ModelSpec(model=ModelConfig(), distributed_optimizer=True)


def offer(worker: int, num_steps: int, own: list[int], theirs: list[int], dp: int = 4) -> Any:
    """Worker ``worker`` holds its own slice at steps ``own`` and its predecessor's at
    ``theirs`` (dp_rank = worker, tp = pp = 1)."""
    return buddy.Offer(
        worker=worker,
        shard=(0, 0),
        dp=dp,
        num_steps=num_steps,
        own=tuple((worker, n) for n in own),
        theirs=tuple(((worker - 1) % dp, n) for n in theirs),
    )


def test_a_dead_ranks_slice_comes_from_its_buddy_the_others_from_their_owners() -> None:
    # Rank 2 died; rank 3 keeps its copy.
    offers = [offer(0, 5, [5], [5]), offer(1, 5, [5], [5]), offer(3, 5, [5], [5])]
    target, chosen = buddy.choose(offers, tp=1, pp=1)
    assert target == 5
    assert chosen == {
        ((0, 0), 0): (0, "own"),
        ((0, 0), 1): (1, "own"),
        ((0, 0), 2): (3, "theirs"),
        ((0, 0), 3): (3, "own"),
    }


def test_the_most_steps_a_survivor_completed_is_restored_from_either_boundary() -> None:
    # Rank 2 died as step 6 was committed: rank 1's commit failed (it keeps both
    # boundaries, its step count is 5), rank 3's completed (step 6 everywhere).
    offers = [
        offer(0, 5, [5, 6], [5, 6]),
        offer(1, 5, [5, 6], [5, 6]),
        offer(3, 6, [6], [6]),
    ]
    target, chosen = buddy.choose(offers, tp=1, pp=1)
    assert target == 6 and chosen[((0, 0), 2)] == (3, "theirs")
    # Nobody completed step 6: the boundary of step 5, from the older copies.
    target, chosen = buddy.choose([*offers[:2], offer(3, 5, [5, 6], [5, 6])], tp=1, pp=1)
    assert target == 5 and chosen[((0, 0), 1)] == (1, "own")


def test_a_copy_of_another_step_is_never_mixed_in() -> None:
    # Rank 2 died; rank 3 completed step 6 but holds rank 2's slice of step 5 only.
    offers = [offer(0, 6, [6], [6]), offer(1, 6, [6], [6]), offer(3, 6, [6], [5])]
    with pytest.raises(TrainerError, match=r"slice\(s\) \[\(0, 0, 2\)\] .* at step 6"):
        buddy.choose(offers, tp=1, pp=1)


def test_a_rank_dying_with_its_buddy_is_refused_and_the_message_says_why() -> None:
    # Ranks 1 and 2 died: rank 1's slice lived on 1 and on its buddy 2.
    with pytest.raises(TrainerError, match=r"\[\(0, 0, 1\)\] .* both died") as refused:
        buddy.choose([offer(0, 5, [5], [5]), offer(3, 5, [5], [5])], tp=1, pp=1)
    assert "distributed_optimizer=false" in str(refused.value)
    dp3 = Layout((0, 1, 2), tp=1, pp=1)
    assert recovery.unrecoverable(SLICED, dp3, {1}) is None
    assert recovery.unrecoverable(SLICED, dp3, ()) is None
    why = recovery.unrecoverable(SLICED, dp3, {1, 2}) or ""
    assert "rank(s) [1] died with their buddies [2]" in why and "checkpoint" in why
    why = recovery.unrecoverable(SLICED, dp3, {0, 2}) or ""  # 2's buddy is 0
    assert "rank(s) [2] died with their buddies [0]" in why


def test_without_buddy_copies_any_lost_rank_is_refused_but_a_spare() -> None:
    uncopied = ModelSpec(model=ModelConfig(), distributed_optimizer=True, buddy_copies=False)
    dp3 = Layout((0, 1, 2), tp=1, pp=1)
    why = recovery.unrecoverable(uncopied, dp3, {1}) or ""
    assert "buddy_copies=false cannot survive a lost rank" in why, why
    assert "buddy_copies=true" in why and "checkpoint" in why
    assert recovery.unrecoverable(uncopied, dp3, ()) is not None
    assert recovery.unrecoverable(uncopied, dp3, {7}) is None  # a spare died


def test_a_tensor_parallel_layout_needs_each_slice_on_a_rank_or_its_buddy() -> None:
    spec = ModelSpec(model=ModelConfig(), tp=2, distributed_optimizer=True)
    two = Layout((0, 1, 2, 3), tp=2, pp=1)  # replicas (0, 1) and (2, 3)
    assert recovery.unrecoverable(spec, two, {1}) is None  # its buddy 3 keeps its slice
    assert recovery.unrecoverable(spec, two, {1, 2}) is None  # different shards
    why = recovery.unrecoverable(spec, two, {1, 3}) or ""
    assert "slice(s) [(0, 1, 0), (0, 1, 1)]" in why, why
    one = Layout((0, 1), tp=2, pp=1)
    assert "tp=2, pp=1 cannot survive a lost worker with one" in (
        recovery.unrecoverable(spec, one, ()) or ""
    )
    assert recovery.unrecoverable(spec, one, {5}) is None  # a spare died
    chosen = recovery.plan_sliced(two, [0, 2, 3], {0: 4, 2: 5, 3: 4})
    assert chosen.members == (0, 2) and chosen.source == 2


# -- two processes ------------------------------------------------------------------


class _InjectedError(RuntimeError):
    pass


def _worker(worker: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from dynarl.api.config import AlgorithmConfig
    from dynarl.rl.grpo import GrpoLoss
    from dynarl.testing.minibatches import random_minibatch
    from dynarl.workers.megatron import optim
    from dynarl.workers.megatron.layout import build_groups
    from dynarl.workers.megatron.rank import MegatronRank
    from dynarl.workers.torch.trainer_config import TrainerConfig

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=worker, world_size=2
    )
    spec = ModelSpec(
        model=ModelConfig(max_seq_len=64, num_layers=2), seed=3, distributed_optimizer=True
    )
    config = TrainerConfig(micro_batch_size=4, lr=1e-2, timeout_s=60.0)
    loss = GrpoLoss.from_config(AlgorithmConfig())
    hf_state = spec.hf_state()
    real_swap, real_commit = buddy.swap, buddy.commit

    def batch(step: int) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(v) for k, v in random_minibatch(step).items()}

    def fresh_rank() -> MegatronRank:
        groups = build_groups(Layout((0, 1), 1, 1), worker=worker, timeout_s=60)
        assert groups is not None
        rank = MegatronRank.create(
            spec, loss_fn=loss, config=config, groups=groups, hf_state=hf_state
        )
        for step in range(2):
            rank.train_step(batch(step))
        return rank

    out: dict[str, Any] = {}
    # The swap fails after the optimizer updated the slice and gathered the parameters.
    rank = fresh_rank()
    adam = rank.distributed
    assert adam is not None
    boundary = adam.snapshot(2)
    seen: list[buddy.Slice] = []

    def failing_swap(mine: buddy.Slice, **_: Any) -> buddy.Slice:
        seen.append(mine)
        raise _InjectedError("injected")

    optim.buddy.swap = failing_swap  # type: ignore[assignment]
    try:
        rank.train_step(batch(2))
    except _InjectedError:
        out["swap_raised"] = True
    optim.buddy.swap = real_swap
    after = adam.snapshot(2)
    out["updated_before_the_failure"] = not torch.equal(seen[0].data, boundary.data)
    out["rolled_back"] = torch.equal(after.data, boundary.data) and (
        after.adam_step == boundary.adam_step == 2.0
    )
    out["steps_after_swap_failure"] = rank.num_steps
    rank.groups.destroy()

    # The commit fails: the slices of both boundaries are kept, the step not counted.
    rank = fresh_rank()
    adam = rank.distributed
    assert adam is not None

    def failing_commit(**_: Any) -> None:
        raise _InjectedError("injected")

    optim.buddy.commit = failing_commit  # type: ignore[assignment]
    try:
        rank.train_step(batch(2))
    except _InjectedError:
        out["commit_raised"] = True
    optim.buddy.commit = real_commit
    out["steps_after_commit_failure"] = rank.num_steps
    out["kept_mine"] = [(s.dp_rank, s.num_steps) for s in adam.copies.mine]
    out["kept_theirs"] = [(s.dp_rank, s.num_steps) for s in adam.copies.theirs]
    out["live_is_newest"] = torch.equal(adam.snapshot(3).data, adam.copies.mine[-1].data)
    rank.groups.destroy()

    # Without buddy copies the ranks step and keep none.
    spec = dataclasses.replace(spec, buddy_copies=False)
    rank = fresh_rank()
    assert rank.distributed is not None
    out["copies_when_off"] = len(rank.distributed.copies.mine) + len(rank.distributed.copies.theirs)
    rank.groups.destroy()
    results.put((f"worker {worker}", out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_failed_step_leaves_each_rank_a_slice_of_the_last_boundary() -> None:
    got = gather_from_workers(_worker, world=2, expected=2)
    for worker in range(2):
        out = got[f"worker {worker}"]
        assert out["swap_raised"] and out["updated_before_the_failure"], out
        assert out["rolled_back"] and out["steps_after_swap_failure"] == 2, out
        assert out["commit_raised"] and out["steps_after_commit_failure"] == 2, out
        assert out["kept_mine"] == [(worker, 2), (worker, 3)], out
        assert out["kept_theirs"] == [(1 - worker, 2), (1 - worker, 3)], out
        assert out["live_is_newest"], out
        assert out["copies_when_off"] == 0, out  # actor.megatron.buddy_copies=false
