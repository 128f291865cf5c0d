"""The reference experiments' settings (DynaRL, OSDI'26) as simulator recipes.

Math: R1-Distill-Qwen 1.5B / 7B / 32B with GRPO, 512 prompts x 16 = 8,192 sequences
per iteration, 4 minibatches, responses up to 28,672 tokens; trainer TP 2/4/8, rollout
TP 1/2/4, inference TP 2/4/8; 128 (160 for 32B) running requests per engine. Initial
placement at 64 GPUs: actor 16, rollout 40, inference 8 (32B: 32, 24, 8), doubled at
128. Agentic: the same models and placements on a multi-turn workload with a code tool
(4 s timeout) and an 8K response cap.
"""

from typing import Literal

from dynarl.api.config import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    DynaRLConfig,
    InferenceConfig,
    RolloutConfig,
    RunConfig,
)
from dynarl.control.config import SchedulerConfig, SchedulingMode
from dynarl.sim.config import SimConfig, SimulatedRun

Size = Literal["1.5b", "7b", "32b"]
SIZES: tuple[Size, ...] = ("1.5b", "7b", "32b")

_TP = {"1.5b": (2, 1, 2), "7b": (4, 2, 4), "32b": (8, 4, 8)}  # actor, rollout, inference
_MODEL = {"1.5b": "R1-Distill-Qwen-1.5B", "7b": "R1-Distill-Qwen-7B", "32b": "R1-Distill-Qwen-32B"}


def paper_setting(
    workload: Literal["math", "agentic"],
    size: Size,
    num_devices: int = 64,
    *,
    mode: SchedulingMode = "dynamic",
    num_iterations: int = 3,
    seed: int = 0,
) -> SimulatedRun:
    """The reference setting ``workload``-``size`` on ``num_devices`` H100s (a multiple
    of 64 scales the 64-GPU placement). The rollout's engines run at the reference's
    ``tp`` and may be regrouped at twice it for the tail (``rollout.tail_tp``: the
    dynamic scheduler decides; the static modes keep ``tp``)."""
    scale = num_devices / 64
    actor_d, rollout_d, inference_d = (32, 24, 8) if size == "32b" else (16, 40, 8)
    actor_tp, rollout_tp, inference_tp = _TP[size]
    job = DynaRLConfig(
        cluster=ClusterConfig(num_devices=num_devices),
        rollout=RolloutConfig(
            backend="sglang",
            tp=rollout_tp,
            tail_tp=2 * rollout_tp,
            initial_devices=round(rollout_d * scale),
            max_running_requests=160 if size == "32b" else 128,
            max_new_tokens=28672 if workload == "math" else 8192,
        ),
        inference=InferenceConfig(
            backend="megatron", tp=inference_tp, initial_devices=round(inference_d * scale)
        ),
        actor=ActorConfig(backend="megatron", tp=actor_tp, initial_devices=round(actor_d * scale)),
        # The reference system trains minibatches of whole groups as they complete.
        algorithm=AlgorithmConfig(
            num_prompts=512, group_size=16, n_minibatches=4, minibatch_order="completion"
        ),
        scheduler=SchedulerConfig(mode=mode),
        run=RunConfig(num_iterations=num_iterations, seed=seed, run_dir="runs/sim"),
    )
    return SimulatedRun(job=job, sim=SimConfig(model=_MODEL[size], workload=workload))


def math_1_5b_64() -> SimulatedRun:
    """Math, 1.5B, 64 GPUs."""
    return paper_setting("math", "1.5b", 64)


def math_7b_64() -> SimulatedRun:
    """Math, 7B, 64 GPUs (the reference's timeline figure)."""
    return paper_setting("math", "7b", 64)


def math_32b_64() -> SimulatedRun:
    """Math, 32B, 64 GPUs."""
    return paper_setting("math", "32b", 64)


def agentic_7b_64() -> SimulatedRun:
    """Agentic, 7B, 64 GPUs."""
    return paper_setting("agentic", "7b", 64)
