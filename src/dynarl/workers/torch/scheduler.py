"""Which requests the rollout engine runs next: admission from the waiting queue under
the running-request and KV-token limits, and preemption when the KV budget runs out.

It touches only queues and :class:`Sequence` state (no tensors), so its decisions are
plain to test. The KV budget is logical: a running sequence holds one slot per prompt
and output token.
"""

from collections.abc import Iterable

import anyio

from dynarl.workers.torch.sequence import Sequence, SequenceStatus
from dynarl.workers.torch.waiting import WaitingQueue


class Scheduler:
    """Waiting and running sequences of one engine, and the limits that bind them.

    Args:
        queue: the waiting queue (its order decides admission order).
        max_running_requests: sequences decoded at once.
        kv_capacity_tokens: KV slots the running sequences may hold together.
        max_prefill_tokens: padded tokens one prefill batch may feed (one sequence is
            always admitted, however long).
    """

    def __init__(
        self,
        queue: WaitingQueue[Sequence],
        *,
        max_running_requests: int,
        kv_capacity_tokens: int,
        max_prefill_tokens: int,
    ) -> None:
        self._queue = queue
        self._max_running = max_running_requests
        self._capacity_tokens = kv_capacity_tokens
        self._max_prefill_tokens = max_prefill_tokens
        self._waiting: dict[str, Sequence] = {}
        # Taken from the queue but not admitted yet (it did not fit): the queue has
        # decided it is next, so it keeps its turn instead of being queued again.
        self._head: Sequence | None = None
        self.running: list[Sequence] = []
        """Running sequences, oldest admission first."""

    @property
    def max_running_requests(self) -> int:
        """Sequences decoded at once."""
        return self._max_running

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission."""
        return len(self._waiting)

    @property
    def kv_tokens_held(self) -> int:
        """KV slots the running sequences hold (the next token of each included)."""
        return sum(seq.num_tokens for seq in self.running)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV slots the running sequences may hold together."""
        return self._capacity_tokens

    def holds(self, request_id: str) -> bool:
        """Whether a waiting or running sequence has this id."""
        return request_id in self._waiting or any(
            seq.request_id == request_id for seq in self.running
        )

    def add(self, seq: Sequence) -> None:
        """Put ``seq`` in the waiting queue (whatever a full queue raises propagates)."""
        seq.status = SequenceStatus.WAITING
        self._queue.put_nowait(seq)
        self._waiting[seq.request_id] = seq

    def admit(self) -> list[Sequence]:
        """Move the sequences to prefill now from the waiting queue to the running set,
        in queue order, while they fit; empty when none fits (then decode)."""
        admitted: list[Sequence] = []
        held = self.kv_tokens_held
        longest = 0
        while len(self.running) + len(admitted) < self._max_running:
            seq = self._next_waiting()
            if seq is None:
                break
            longest_after = max(longest, seq.num_tokens)
            too_many_tokens = held + seq.num_tokens + 1 > self._capacity_tokens
            too_wide = admitted and longest_after * (len(admitted) + 1) > self._max_prefill_tokens
            if too_many_tokens or too_wide:
                self._head = seq
                break
            del self._waiting[seq.request_id]
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            held += seq.num_tokens + 1
            longest = longest_after
        self.running.extend(admitted)
        return admitted

    def preempt_for_decode(self) -> list[Sequence]:
        """Send the newest running sequences back to the queue until one more token per
        running sequence fits in the KV budget; they keep their output and re-prefill."""
        preempted: list[Sequence] = []
        while len(self.running) > 1 and (
            self.kv_tokens_held + len(self.running) > self._capacity_tokens
        ):
            seq = self.running.pop()
            self.add(seq)
            preempted.append(seq)
        return preempted

    def preempt_all(self) -> list[Sequence]:
        """Send every running sequence back to the queue (their KV is gone or stale)."""
        preempted = self.running
        self.running = []
        for seq in preempted:
            self.add(seq)
        return preempted

    def finish(self, finished: Iterable[Sequence]) -> None:
        """Remove finished sequences from the running set."""
        done = {id(seq) for seq in finished}
        for seq in self.running:
            if id(seq) in done:
                seq.status = SequenceStatus.FINISHED
        self.running = [seq for seq in self.running if id(seq) not in done]

    def remove(self, request_ids: Iterable[str] | None) -> list[Sequence]:
        """Take the sequences with these ids (all when ``None``) out of the engine,
        waiting or running; unknown ids are ignored."""
        wanted = None if request_ids is None else set(request_ids)
        taken = [s for s in self.running if wanted is None or s.request_id in wanted]
        self.running = [s for s in self.running if not (wanted is None or s.request_id in wanted)]
        for request_id in list(self._waiting) if wanted is None else wanted:
            seq = self._waiting.pop(request_id, None)
            if seq is not None:
                taken.append(seq)
                if seq is self._head:
                    self._head = None
        for seq in taken:
            seq.status = SequenceStatus.WAITING
        return taken

    def _next_waiting(self) -> Sequence | None:
        if self._head is not None:
            seq, self._head = self._head, None
            return seq
        while len(self._queue):
            try:
                seq = self._queue.get_nowait()
            except anyio.WouldBlock:  # pragma: no cover - a queue shorter than its len
                return None
            # Aborted (or aborted and re-added) sequences are skipped, not searched for.
            if self._waiting.get(seq.request_id) is seq:
                return seq
        return None
