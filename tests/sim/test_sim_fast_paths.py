"""The simulator's fast paths give what the plain computations give: the engines'
reserved future tokens kept incrementally, the world's alarm (a deadline or a wake-up)
and the virtual-time loop's own clock."""

import asyncio
import random
import socket

from dynarl.core.ids import ItemId
from dynarl.core.virtual_time import VirtualClock, VirtualTimeLoop
from dynarl.sim.alarm import Alarm
from dynarl.sim.reserve import Reservations


def test_reservations_match_the_sum_over_running_jobs() -> None:
    """Jobs admitted near and far from their finish, removed early or not, with steps
    jumping past the clip: the total is ``sum(min(finish - step, clip))`` every time."""
    rng = random.Random(7)
    clip = 50
    res = Reservations(clip)
    running: dict[ItemId, tuple[int, int]] = {}  # id -> (seq, finish step)
    step = seq = 0
    for _ in range(3000):
        step += rng.choice((0, 0, 1, 3, 40))
        for item in [i for i, (_, f) in running.items() if f <= step]:
            res.remove(item, finish_step=running.pop(item)[1])
        if running and rng.random() < 0.2:  # an abort or a retraction
            item = rng.choice(sorted(running))
            res.remove(item, finish_step=running.pop(item)[1])
        if rng.random() < 0.6:
            item = ItemId(f"j{rng.randrange(40)}")  # ids come back, as resumed jobs do
            if item not in running:
                seq += 1
                finish = step + rng.randint(1, 3 * clip)
                running[item] = (seq, finish)
                res.add(item, seq, finish_step=finish, step=step)
        assert res.total(step) == sum(min(f - step, clip) for _, f in running.values())


def test_alarm_rings_at_its_deadline_or_when_set() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        alarm, times = Alarm(), []
        await alarm.wait(2.5)  # nobody sets it: the deadline
        times.append(loop.time())
        loop.call_later(1.0, alarm.set)
        await alarm.wait(10.0)  # set after 1 s
        times.append(loop.time())
        assert alarm.is_set()
        await alarm.wait(10.0)  # still set: returns at once
        times.append(loop.time())
        alarm.clear()
        await alarm.wait(0.5)
        times.append(loop.time())
        return times

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        assert runner.run(main()) == [2.5, 3.5, 3.5, 4.0]


def test_virtual_clock_reads_and_sleeps_on_its_loop() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        clock = VirtualClock(loop)
        await clock.sleep(3.0)
        return clock.now(), loop.time()

    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start_s=1.0)) as runner:
        assert runner.run(main()) == (4.0, 4.0)


def test_virtual_time_loop_serves_real_io_before_time_jumps() -> None:
    """With no I/O of its own the loop skips the poll before each jump; a socket it
    watches is still served at the virtual time its data came, not after the next
    timer."""

    async def main() -> tuple[list[tuple[bytes, float]], float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        got: list[tuple[bytes, float]] = []
        loop.add_reader(a.fileno(), lambda: got.append((a.recv(16), loop.time())))
        try:
            b.send(b"x")
            await asyncio.sleep(10.0)
            b.send(b"y")
            await asyncio.sleep(0.0)  # a pass with callbacks ready polls too
            await asyncio.sleep(5.0)
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()
        return got, loop.time()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        assert runner.run(main()) == ([(b"x", 0.0), (b"y", 10.0)], 15.0)
