"""The decode probe's grid (:func:`probe_points`), its refusal of a busy engine and its
failure when a probe request does not complete, on the reference engine in this
process; which engines a run probes."""

import anyio
import pytest

from dynarl.workers.decode_probe import probe_decode, probe_points
from dynarl.workers.errors import WorkerError
from dynarl.workers.protocol import DecodeProbe
from dynarl.workers.rollout import Completion, GenerateRequest, RolloutEngine

PROBE = DecodeProbe(new_tokens=32, short_prompt=16)


@pytest.mark.parametrize(
    ("max_running", "kv_tokens", "max_seq_len", "points"),
    [
        # The default engine: a batch of 64, prompts up to 256 - 64 - 1 tokens.
        (64, 16384, 256, [(1, 16), (1, 191), (64, 16), (64, 191)]),
        # A KV cache of 1000 tokens: 12 requests of 16 + 64 fit; 1000 // 12 - 64 = 19.
        (64, 1000, 256, [(1, 16), (1, 19), (12, 16), (12, 19)]),
        # The KV cache holds one short request only: one load, one prompt.
        (64, 80, 256, [(1, 16)]),
        # A model too short for 2 x 32 new tokens and a prompt: nothing to measure.
        (64, 16384, 64, []),
        # Room for a prompt of 7 tokens only: the short prompt shrinks to it.
        (4, 16384, 72, [(1, 7), (4, 7)]),
    ],
)
def test_the_grid_is_what_the_engine_limits_allow(
    max_running: int, kv_tokens: int, max_seq_len: int, points: list[tuple[int, int]]
) -> None:
    got = probe_points(PROBE, max_running=max_running, kv_tokens=kv_tokens, max_seq_len=max_seq_len)
    assert got == points


def reference_engine() -> RolloutEngine:
    pytest.importorskip("torch")
    from dynarl.workers import backends
    from dynarl.workers.config import ModelConfig, RolloutConfig
    from dynarl.workers.protocol import RolloutRole

    role = RolloutRole(model=ModelConfig(max_seq_len=96), rollout=RolloutConfig())
    return backends.rollout_backend(role.rollout).build_rollout(role, name="t", num_threads=1)


async def test_an_engine_holding_requests_is_not_measured() -> None:
    engine = reference_engine()
    busy = GenerateRequest(request_id="busy", prompt_ids=(5, 6, 7))
    await engine.submit([busy], sink=Ignored())  # its loop is not running: it stays
    with pytest.raises(WorkerError, match="holds 1 requests"):
        await probe_decode(
            engine, PROBE, engine_devices=1, kv_tokens=16384, max_seq_len=96, token_ids=[4, 5]
        )


class Ignored:
    """A sink for a request whose outcome the test does not read."""

    def done(self, completion: Completion) -> None: ...
    def aborted(self, request: GenerateRequest) -> None: ...
    async def flush(self) -> None: ...
    async def fail(self, error: Exception) -> None: ...


async def test_a_probe_request_aborted_fails_the_probe() -> None:
    engine = reference_engine()
    probe = DecodeProbe(new_tokens=40)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        tg.start_soon(abort_once_busy, engine)
        with pytest.raises(WorkerError, match=r"probe request \S+ was aborted"):
            await probe_decode(
                engine,
                probe,
                engine_devices=1,
                kv_tokens=16384,
                max_seq_len=96,
                token_ids=list(range(4, 60)),
            )
        tg.cancel_scope.cancel()


async def abort_once_busy(engine: RolloutEngine) -> None:
    while not engine.num_requests:  # noqa: ASYNC110 (the engine signals no submission)
        await anyio.sleep(0.001)
    await engine.abort(None)


def test_a_run_probes_both_engine_sizes_only_where_it_may_regroup_and_lacks_their_costs() -> None:
    from dynarl.api.config import DynaRLConfig
    from dynarl.api.config_io import apply_overrides
    from dynarl.api.engine_probe import engine_sizes_to_probe
    from dynarl.control.pipeline import build_pipeline
    from dynarl.control.predictor import Predictor
    from dynarl.control.predictor_profile import Profile, ProfileRow
    from dynarl.control.topology import ROLLOUT

    def sizes(overrides: list[str], profile: Profile | None = None) -> tuple[int, ...]:
        cfg = apply_overrides(DynaRLConfig(), ["cluster.num_devices=4", *overrides])
        spec = build_pipeline(cfg.pipeline_layout())[0]
        return engine_sizes_to_probe(cfg, Predictor.for_pipeline(spec, profile=profile))

    tail = ["rollout.tail_tp=2", "scheduler.mode=dynamic"]
    assert sizes(tail) == (1, 2)
    assert sizes(["scheduler.mode=dynamic"]) == ()  # no tail size: nothing to compare
    assert sizes(["rollout.tail_tp=2", "scheduler.mode=static-colocated"]) == ()  # never regroups

    def rows(unit: int) -> list[ProfileRow]:
        return [
            ProfileRow(
                component=ROLLOUT,
                devices=unit,
                load=n,
                throughput=100.0 * n**0.5,
                context=64.0,
                engine_devices=0 if unit == 1 else unit,
            )
            for n in (1, 8, 32)
        ]

    # A profile with the narrow engines' costs only: both are measured, alike.
    assert sizes(tail, Profile(rows=tuple(rows(1)))) == (1, 2)
    assert sizes(tail, Profile(rows=tuple(rows(1) + rows(2)))) == ()
