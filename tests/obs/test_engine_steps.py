"""The rollout engines' steps per iteration, from their load reports: each report
carries its engine's counts since it started; the meter sums what each adds."""

import pytest

from dynarl.control import events as ev
from dynarl.core.ids import InstanceId
from dynarl.obs.metrics import EngineSteps


def report(
    instance: str,
    prefills: int,
    decodes: int,
    prefill_s: float,
    decode_s: float,
    resume_s: float = 0.0,
) -> ev.EngineStats:
    return ev.EngineStats(
        instance=InstanceId(instance),
        kv_usage=0.1,
        num_running=4,
        num_queued=0,
        prefill_steps=prefills,
        decode_steps=decodes,
        prefill_s=prefill_s,
        decode_s=decode_s,
        resume_prefill_s=resume_s,
    )


def test_what_each_engine_adds_is_summed_per_reading() -> None:
    steps = EngineSteps()
    steps(report("e0", 1, 10, 0.5, 2.0))
    steps(report("e1", 2, 5, 1.0, 1.0, 0.25))  # a quarter second re-prefilled moved requests
    steps(report("e0", 1, 30, 0.5, 6.0))  # 20 more decode steps on e0
    steps(ev.WorkerIdle(instance=InstanceId("e0")))  # not a load report: ignored
    assert steps.take() == pytest.approx(
        {
            "prefill_steps": 3,
            "decode_steps": 35,
            "prefill_s": 1.5,
            "decode_s": 7.0,
            "resume_prefill_s": 0.25,
        }
    )
    # The next reading counts from there: only what the engines did since.
    steps(report("e0", 2, 40, 0.75, 8.0))
    steps(report("e1", 2, 5, 1.0, 1.0, 0.25))  # nothing new
    assert steps.take() == pytest.approx(
        {
            "prefill_steps": 1,
            "decode_steps": 10,
            "prefill_s": 0.25,
            "decode_s": 2.0,
            "resume_prefill_s": 0.0,
        }
    )
    assert steps.take() == {}  # no step since: nothing to say


def test_an_engine_that_started_again_counts_from_zero() -> None:
    steps = EngineSteps()
    steps(report("e0", 3, 100, 1.0, 10.0))
    steps(report("e0", 1, 4, 0.2, 0.4))  # its slot restarted: these are all new
    assert steps.take() == pytest.approx(
        {
            "prefill_steps": 4,
            "decode_steps": 104,
            "prefill_s": 1.2,
            "decode_s": 10.4,
            "resume_prefill_s": 0.0,
        }
    )


def test_engines_that_do_not_count_steps_give_nothing() -> None:
    steps = EngineSteps()
    steps(report("sglang-0", 0, 0, 0.0, 0.0))
    assert steps.take() == {}
