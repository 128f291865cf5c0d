"""A pending request's expected remaining length: the survivors of the last iteration's
length distribution, given how far the pending requests have got."""

import pytest

from dynarl.control import events as ev
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import PROMPTS, ROLLOUT
from dynarl.core.ids import GroupId, InstanceId, ItemId

from .test_item_sizes import sized_graph

E0 = InstanceId("rollout-0")


def progress_to(g: Hypergraph, tokens_per_request: float, pending: int, t0: float) -> None:
    """rollout-0 reports generating ``tokens_per_request`` per pending request over 1 s."""
    g.apply(ev.EngineStats(instance=E0, kv_usage=0.1, num_running=pending, num_queued=0, time_s=t0))
    g.apply(
        ev.EngineStats(
            instance=E0,
            kv_usage=0.1,
            num_running=pending,
            num_queued=0,
            gen_tokens_per_s=tokens_per_request * pending,
            time_s=t0 + 1.0,
        )
    )


def test_expected_remaining_is_the_survivors_mean_less_the_progress() -> None:
    g = sized_graph(expected_tokens=1000.0)
    lengths = [100, 200, 1000, 5000]
    refs = tuple(ev.ItemRef(ItemId(f"a{k}"), GroupId("g"), 10) for k in range(len(lengths)))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref, n in zip(refs, lengths, strict=True):
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
        g.apply(ev.ItemCompleted(edge=PROMPTS, item=ref.id, instance=E0, num_tokens=n))
    # During the first iteration: the prior (and at least the progress).
    assert g.expected_remaining_tokens(ROLLOUT) == pytest.approx(1000.0)

    g.apply(ev.IterationStarted(iteration=1, time_s=10.0))
    refs = (ev.ItemRef(ItemId("b0"), GroupId("h"), 10), ev.ItemRef(ItemId("b1"), GroupId("h"), 10))
    g.apply(ev.ItemsEnqueued(edge=PROMPTS, items=refs))
    for ref in refs:
        g.apply(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=E0))
    progress_to(g, 150.0, 2, t0=10.0)
    # Requests 150 tokens in: the last iteration's 200, 1000 and 5000 survive.
    assert g.expected_remaining_tokens(ROLLOUT) == pytest.approx((200 + 1000 + 5000) / 3 - 150)
    # At 1,150 tokens only the 5,000 survives; past the longest, a token is left at least.
    progress_to(g, 1000.0, 2, t0=11.0)
    assert g.expected_remaining_tokens(ROLLOUT) == pytest.approx(5000 - 1150)
    progress_to(g, 5000.0, 2, t0=12.0)
    assert g.expected_remaining_tokens(ROLLOUT) == pytest.approx(1.0)
    assert g.expected_longest_remaining(ROLLOUT) >= 1.0
