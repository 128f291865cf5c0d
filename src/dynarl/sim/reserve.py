"""The KV tokens a modelled engine's admission reserves for its running jobs' future:
each job's remaining tokens up to a clip (SGLang's ``CLIP_MAX_NEW_TOKENS``), summed,
kept as the jobs come and go instead of summed over the batch at every admission.

A running job gains one token a step, so it has ``finish - step`` tokens left and
reserves ``min(finish - step, clip)``: the clip while its finish is further than that,
``finish - step`` from then on. The jobs within the clip are counted and their finish
steps summed; those beyond it are counted, and each moves over, on a heap, at the step
it comes within the clip. The total is exact (integers), in O(log jobs) per job.
"""

import heapq

from dynarl.core.ids import ItemId


class Reservations:
    """The running jobs' reserved future tokens (see the module docstring).

    Args:
        clip: the most future tokens reserved for one job.
    """

    def __init__(self, clip: int) -> None:
        self.clip = clip
        self._num_near = 0
        self._near_finish_sum = 0  # finish steps of the jobs within the clip
        self._far: dict[ItemId, int] = {}  # job beyond the clip -> its admission's seq
        self._far_heap: list[tuple[int, int, ItemId]] = []  # (step within clip, seq, id)

    def add(self, item: ItemId, seq: int, *, finish_step: int, step: int) -> None:
        """Job ``item`` (admission ``seq``, unique per admission) runs from ``step``
        and finishes at ``finish_step``."""
        if finish_step - step > self.clip:
            self._far[item] = seq
            heapq.heappush(self._far_heap, (finish_step - self.clip, seq, item))
        else:
            self._num_near += 1
            self._near_finish_sum += finish_step

    def remove(self, item: ItemId, *, finish_step: int) -> None:
        """Job ``item``, added with ``finish_step``, stops running."""
        if self._far.pop(item, None) is None:
            self._num_near -= 1
            self._near_finish_sum -= finish_step

    def total(self, step: int) -> int:
        """Future tokens reserved at ``step``: ``min(finish - step, clip)`` summed over
        the running jobs (``step`` never goes back)."""
        heap, far = self._far_heap, self._far
        while heap and heap[0][0] <= step:
            near_from, seq, item = heapq.heappop(heap)
            if far.get(item) != seq:
                continue  # it stopped running since
            del far[item]
            self._num_near += 1
            self._near_finish_sum += near_from + self.clip
        return self._near_finish_sum - self._num_near * step + len(far) * self.clip
