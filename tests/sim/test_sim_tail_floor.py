"""The tail floor: the longest responses' decode with their KV reads, then the last
minibatch of the longest groups, then the weight sync."""

import msgspec
import pytest
from small_cluster import SIXTEEN_DEVICES

from dynarl.api.config import DynaRLConfig
from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.sim.bound import work_conserving_bound
from dynarl.sim.cluster import ClusterModel, decode_alone_s
from dynarl.sim.cluster_build import build_cluster
from dynarl.sim.config import simulated_run
from dynarl.sim.tail_floor import last_step_s, tail_floor_s


def _requests(lengths: list[list[int]]) -> list[Request]:
    return [
        Request(
            id=ItemId(f"p{g}-s{k}"), group=GroupId(f"p{g}"), prompt_tokens=200, output_tokens=(n,)
        )
        for g, group in enumerate(lengths)
        for k, n in enumerate(group)
    ]


@pytest.fixture
def cluster() -> ClusterModel:
    # 16 devices, rollout TP 1 (16 engines), actor TP 2, four minibatches.
    run = simulated_run(
        DynaRLConfig(),
        [
            *SIXTEEN_DEVICES,
            "rollout.max_running_requests=32",
            "rollout.max_new_tokens=8192",
            "algorithm.num_prompts=8",
            "algorithm.group_size=8",
            "algorithm.n_minibatches=4",
        ],
    )
    return build_cluster(run)


def test_one_longest_request_costs_its_decode_alone(cluster: ClusterModel) -> None:
    # A single request of the longest length cannot split over engines: the floor
    # holds its decode alone, the last step and the sync, and no less.
    reqs = _requests([[8000, 100, 100, 100], [100] * 4, [100] * 4, [100] * 4])
    longest = reqs[0]
    sync = cluster.weight_sync.time_s(cluster.model)
    floor = tail_floor_s(cluster, reqs, 16)
    assert floor >= decode_alone_s(cluster, longest) + last_step_s(cluster, reqs, 16) + sync
    assert floor == pytest.approx(
        decode_alone_s(cluster, longest) + last_step_s(cluster, reqs, 16) + sync, rel=1e-9
    )


def test_many_longest_requests_pay_for_sharing_engines(cluster: ClusterModel) -> None:
    # 64 requests of the longest length on 16 engines: each engine holds 4 of them at
    # least, so they take longer than one alone (the critical path the lower bound
    # uses), by about 3 requests' KV reads.
    reqs = _requests([[8000] * 8 for _ in range(8)])
    eng = cluster.engine
    a, _ = eng.step_coefficients()
    alone = decode_alone_s(cluster, reqs[0])
    kv_each = alone - 8000 * (a + eng.step_per_request_s)
    rollout = tail_floor_s(cluster, reqs, 16) - last_step_s(cluster, reqs, 16)
    rollout -= cluster.weight_sync.time_s(cluster.model)
    engines = 16 // eng.tp
    assert rollout >= alone + (64 / engines - 1) * kv_each - 1e-9
    bound = work_conserving_bound(cluster, reqs, 16)
    assert tail_floor_s(cluster, reqs, 16) > bound.critical_path_s


def test_the_last_step_trains_the_longest_groups(cluster: ClusterModel) -> None:
    # Four minibatches of one group each: the last holds the longest group, whatever
    # the order the groups are listed in.
    short, long = [500] * 4, [6000] * 4
    first = last_step_s(cluster, _requests([long, short, short, short]), 16)
    last = last_step_s(cluster, _requests([short, short, short, long]), 16)
    only_short = last_step_s(cluster, _requests([short] * 4), 16)
    assert first == last > only_short


def test_no_requests_no_floor(cluster: ClusterModel) -> None:
    assert tail_floor_s(cluster, [], 16) == 0.0


def test_the_longest_on_larger_engines_decode_as_those_engines_do(cluster: ClusterModel) -> None:
    # tail_tp puts the longest requests on engines of that size: one longest request
    # then costs its decode alone on a TP-2 engine (the weights read two ways: a
    # shorter step), and at the rollout's own size exactly the default floor.
    reqs = _requests([[8000, 100, 100, 100], [100] * 4, [100] * 4, [100] * 4])
    wide = msgspec.structs.replace(cluster, engine=msgspec.structs.replace(cluster.engine, tp=2))
    after = last_step_s(cluster, reqs, 16) + cluster.weight_sync.time_s(cluster.model)
    assert tail_floor_s(cluster, reqs, 16, tail_tp=1) == tail_floor_s(cluster, reqs, 16)
    floor = tail_floor_s(cluster, reqs, 16, tail_tp=2)
    assert floor == pytest.approx(decode_alone_s(wide, reqs[0]) + after, rel=1e-9)
    assert decode_alone_s(wide, reqs[0]) < decode_alone_s(cluster, reqs[0])
    assert floor < tail_floor_s(cluster, reqs, 16)
