"""The end-to-end CPU benchmark's setting: the embedded bracket task, made long-tailed
enough that where devices sit during the rollout tail shows in the iteration time.

Two device slots of one torch thread each, so on a 2-core machine a device is a core
(with more slots than cores an idle slot lends its core to the busy ones, and no
schedule can waste a device). The random-init policy starts by stopping at random (its
EOS probability is about 1 / vocabulary), so early responses are geometric-ish and
capped at ``rollout.max_new_tokens``; as it learns they move to the task's lognormal
lengths (median 6, a few up to 120). Either way a few responses run many times longer
than the median, and the last of them decode at batch one.
"""

from dynarl.api.config import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    DynaRLConfig,
    InferenceConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
)
from dynarl.control.config import SchedulerConfig, SchedulingMode


def e2e_cpu(
    mode: SchedulingMode = "dynamic",
    *,
    num_devices: int = 2,
    num_iterations: int = 6,
    seed: int = 0,
) -> DynaRLConfig:
    """The ``bench/e2e_cpu.py`` setting under scheduling ``mode``: 32 prompts x 8
    samples, responses up to 384 tokens, two minibatches, on ``num_devices`` one-thread
    CPU slots (half rollout and half actor). The actor trains on the engines' own
    log-probs (no inference stage) in every mode, so every mode does the same work: a
    fixed split of two slots has none to spare for inference."""
    rollout = max(1, num_devices // 2)
    return DynaRLConfig(
        cluster=ClusterConfig(num_devices=num_devices, threads_per_device=1),
        model=ModelConfig(max_seq_len=512),
        rollout=RolloutConfig(
            initial_devices=rollout,
            max_running_requests=64,
            kv_capacity_tokens=32768,
            max_new_tokens=384,
        ),
        inference=InferenceConfig(initial_devices=0),
        actor=ActorConfig(initial_devices=num_devices - rollout, micro_batch_size=32),
        algorithm=AlgorithmConfig(
            num_prompts=32, group_size=8, n_minibatches=2, old_logprobs="rollout"
        ),
        scheduler=SchedulerConfig(mode=mode),
        run=RunConfig(
            num_iterations=num_iterations,
            seed=seed,
            checkpoint_every=0,
            run_dir=f"runs/e2e_cpu/{mode}",
        ),
    )
