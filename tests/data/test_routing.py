"""The routing policy: affinity first (must / prefer / none), then power-of-two
choices on load, never onto a full queue."""

from collections import Counter
from dataclasses import dataclass

from dynarl.data import AffinityRouting

from .helpers import item


@dataclass
class Fake:
    name: str
    load: float = 0.0
    has_room: bool = True
    is_full: bool = False
    is_idle: bool = False
    can_start_now: bool = True


def test_none_affinity_prefers_the_less_loaded_of_two() -> None:
    policy = AffinityRouting(seed=1)
    light, heavy = Fake("light", 0.1), Fake("heavy", 0.9)
    picks = Counter(policy.select(item(k), None, [light, heavy]).name for k in range(100))
    assert picks == {"light": 100}


def test_power_of_two_spreads_over_many_equal_instances() -> None:
    policy = AffinityRouting(seed=2)
    fakes = [Fake(f"w{k}") for k in range(8)]
    picks = Counter()
    for k in range(800):
        chosen = policy.select(item(k), None, fakes)
        assert chosen is not None
        chosen.load += 1
        picks[chosen.name] += 1
    assert max(picks.values()) - min(picks.values()) <= 2


def test_prefer_returns_to_the_previous_instance_while_it_has_room() -> None:
    policy = AffinityRouting()
    prev, other = Fake("prev", load=5.0), Fake("other", load=0.0)
    assert policy.select(item(1, affinity="prefer"), prev, [prev, other]) is prev
    prev.has_room = False
    assert policy.select(item(1, affinity="prefer"), prev, [prev, other]) is other
    prev.has_room, prev.is_full = True, True
    assert policy.select(item(1, affinity="prefer"), prev, [prev, other]) is other


def test_prefer_goes_to_an_idle_instance_rather_than_wait_at_its_own() -> None:
    policy = AffinityRouting()
    prev, busy, idle = Fake("prev", load=1.0), Fake("busy", load=1.0), Fake("idle")
    prev.can_start_now = False  # it would only queue the session's next turn
    assert policy.select(item(1, affinity="prefer"), prev, [prev, busy]) is prev
    idle.is_idle = True
    assert policy.select(item(1, affinity="prefer"), prev, [prev, busy, idle]) is idle
    prev.can_start_now = True  # room now: it keeps its session and its KV prefix
    assert policy.select(item(1, affinity="prefer"), prev, [prev, busy, idle]) is prev


def test_must_waits_for_its_instance_and_none_ignores_it() -> None:
    policy = AffinityRouting()
    prev, other = Fake("prev", load=9.0, has_room=False), Fake("other")
    assert policy.select(item(1, affinity="must"), prev, [prev, other]) is prev
    prev.is_full = True
    assert policy.select(item(1, affinity="must"), prev, [prev, other]) is None
    assert policy.select(item(1, affinity="none"), Fake("x"), [prev, other]) is other


def test_no_candidate_with_space_means_backlog() -> None:
    policy = AffinityRouting()
    assert policy.select(item(1), None, []) is None
    assert policy.select(item(1), None, [Fake("a", is_full=True)]) is None
    fulls = [Fake(f"f{k}", load=0.0, is_full=True) for k in range(5)]
    spare = Fake("spare", load=99.0)
    for k in range(20):
        assert policy.select(item(k), None, [*fulls, spare]) is spare
    assert policy.select(item(1), None, fulls) is None
