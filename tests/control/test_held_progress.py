"""An engine's held requests as arrays: the same progress and contexts as reading each
request, in the order the engine took them, through starts, preemptions and leaves."""

import random

from dynarl.control.elements import ItemState, Node
from dynarl.control.plan import InstanceSpec
from dynarl.core.ids import ComponentId, DeviceId, EdgeId, GroupId, InstanceId, ItemId


def test_the_arrays_follow_every_request_in_order_through_churn() -> None:
    rng = random.Random(0)
    node = Node(InstanceSpec(id=InstanceId("e0"), devices=(DeviceId(0),)), ComponentId("r"), 0.0)
    held: dict[ItemId, ItemState] = {}
    serial = 0
    for step in range(400):
        if rng.random() < 0.55 or not held:  # routed here, with progress from before
            st = ItemState(ItemId(f"i{serial}"), GroupId("g"), 0.0, tokens=rng.randint(1, 50))
            st.generated = float(rng.randint(0, 30))
            st.prefix_tokens = rng.choice([0, 400])
            serial += 1
            held[st.id] = st
            node.items[st.id] = EdgeId("prompts")
            node.attach(st)
        else:  # leaves (completes, tool call, requeued), from anywhere in the order
            st = held.pop(rng.choice(list(held)))
            node.detach(st)
            del node.items[st.id]
        node.start_oldest(rng.randint(0, len(held)))
        node.add_tokens(rng.random() * 10)
        if step % 7 == 0:
            node.stop_youngest(rng.randint(0, len(node.started)))  # preempted
        states = [held[i] for i in node.items]
        assert node.held.progress(node.tokens_per_request).tolist() == [
            node.progress_of(st) for st in states
        ]
        assert node.held.contexts(node.tokens_per_request).tolist() == [
            node.context_of(st) for st in states
        ]
    assert len(node.held) == len(held) and serial > 200  # many rows dropped meanwhile
