"""The reference CPU workers as a simulator profile: measured costs, not peak figures.

A CPU device slot (one process, ``threads`` torch threads) running the tiny random-init
model is not bandwidth- or FLOP-bound the way a GPU is: every call pays a fixed Python
and dispatch cost of milliseconds, and the work on top grows with the (padded) tokens.
:class:`~dynarl.sim.cpu_device.CpuProfile` holds those costs as ``bench/profile_cpu.py``
measures them, and :func:`cpu_cluster` turns them into the simulator's cost models:

- a decode step costs ``decode_step_s + decode_per_request_s x running requests +
  decode_per_context_token_s x context held`` (the engine model's ``a + c x batch + b x
  context``, with ``b`` as an effective memory bandwidth), the context read at the
  longest running row's width (the reference engine's cache is left-padded), plus
  ``step_dispatch_s`` for the worker's loop driving the step;
- the padded cache is rebuilt when rows join (a prefill into a running batch) and when
  they leave: ``join_per_held_token_s`` and ``leave_per_held_token_s`` per token held;
- prefill, log-prob inference and training cost a fixed time per call plus a time per
  token; training pays for padded tokens (every minibatch is padded to its longest
  sample); with ``algorithm.minibatch_order=seeded`` (the default) the first step
  waits for the whole rollout to be scored, as the reference GRPO loop does, while with
  ``completion`` minibatches of whole groups train as they finish;
- migrations, weight sync and the per-iteration bookkeeping cost what real runs of
  ``bench/e2e_cpu.py`` measured.

:class:`ReplayWorkload` replays measured per-request lengths, iteration by iteration,
so a prediction can be checked against the very run it describes.
"""

import string
from collections.abc import Mapping, Sequence

from dynarl.api.config import DynaRLConfig
from dynarl.core.ids import GroupId, ItemId
from dynarl.obs.trace_records import Request
from dynarl.sim.cluster import ClusterModel
from dynarl.sim.config import SimulatedRun
from dynarl.sim.costs import (
    ActorCost,
    DataParallelEfficiency,
    InferenceCost,
    MigrationCost,
    MigrationCostModel,
    WeightSyncCost,
)
from dynarl.sim.cpu_device import CPU_PROFILES, CpuProfile
from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.errors import SimError
from dynarl.sim.hardware import GpuProfile
from dynarl.sim.models import ModelProfile
from dynarl.sim.profile_file import is_profile_path, read_profile
from dynarl.sim.replay import ReplayWorkload
from dynarl.sim.workloads import MathWorkload
from dynarl.workers.config import ModelConfig

_BUILTIN_VOCAB = 4 + len(string.printable)
"""Vocabulary of the built-in character-level tokenizer (4 special tokens, then the
printable ASCII characters); see :func:`dynarl.workers.tokenizer.build_tokenizer`."""


def cpu_profile(name: str) -> CpuProfile | None:
    """The built-in CPU profile called ``name`` (case-insensitive), the measured one in
    the profile file ``name`` names (a path: ``*.json`` or with a ``/``), or ``None``.

    Raises:
        SimError: ``name`` is a path and not a readable profile file.
    """
    if is_profile_path(name):
        return read_profile(name).device
    for key, profile in CPU_PROFILES.items():
        if key.lower() == name.lower():
            return profile
    return None


def model_profile(config: ModelConfig, *, vocab_size: int = _BUILTIN_VOCAB) -> ModelProfile:
    """The simulator's shape of the model a real run builds from ``config`` (random
    init with the built-in tokenizer unless ``vocab_size`` says otherwise)."""
    return ModelProfile(
        name=f"{config.arch}-h{config.hidden_size}-l{config.num_layers}",
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        vocab_size=vocab_size,
        intermediate_size=config.intermediate_size,
        tie_embeddings=False,
        bytes_per_param=4 if config.dtype == "float32" else 2,
    )


class CpuInferenceCost(InferenceCost, frozen=True, kw_only=True):
    """Log-prob inference on CPU slots: a fixed cost per micro-batch plus a cost per
    token (``mfu`` and the device's FLOP rate are unused)."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0

    def time_s(self, num_tokens: float, num_devices: int, mean_context: float = 0.0) -> float:
        """Seconds of one micro-batch of ``num_tokens`` tokens on ``num_devices``."""
        replicas = max(1, num_devices // self.tp)
        return self.overhead_s + self.per_token_s * self.num_forwards * num_tokens / replicas


class CpuActorCost(ActorCost, frozen=True, kw_only=True):
    """The trainer on CPU slots: each rank pays a fixed cost per step plus its share of
    the padded tokens (each the dearer the more context it attends to), slowed by the
    data-parallel efficiency."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_token_context_s: float = 0.0

    def step_time_s(self, num_tokens: float, num_devices: int, mean_context: float = 0.0) -> float:
        """Seconds of one optimizer step over ``num_tokens`` (padded) tokens attending
        to ``mean_context`` tokens each on average."""
        replicas = max(1, num_devices // self.replica_devices)
        per_token = self.per_token_s + self.per_token_context_s * mean_context
        share = per_token * num_tokens / replicas / self.efficiency(replicas)
        return self.overhead_s + share


def replay_workload(
    cfg: DynaRLConfig,
    generated: Sequence[Mapping[str, int]],
    *,
    prompt_tokens: Sequence[Sequence[int]] | None = None,
) -> ReplayWorkload:
    """A replay of a real run's iterations: ``generated[i]`` maps request ids
    (``"{iteration}-{prompt}-{sample}"``) to generated tokens. Prompt lengths come
    from ``prompt_tokens[i][prompt]`` or, by default, from the embedded task's prompt
    sampler (the same prompts the run drew)."""
    algo = cfg.algorithm
    if prompt_tokens is None:
        prompt_tokens = _synthetic_prompt_tokens(cfg, len(generated))
    iterations = []
    for i, tokens in enumerate(generated):
        requests = []
        for p in range(algo.num_prompts):
            for g in range(algo.group_size):
                rid = f"{i}-{p}-{g}"
                requests.append(
                    Request(
                        id=ItemId(f"it{i}-p{p}-s{g}"),
                        group=GroupId(f"it{i}-p{p}"),
                        prompt_tokens=int(prompt_tokens[i][p]),
                        output_tokens=(max(1, int(tokens.get(rid, 1))),),
                    )
                )
        iterations.append(tuple(requests))
    return ReplayWorkload(
        iterations=tuple(iterations),
        num_prompts=algo.num_prompts,
        group_size=algo.group_size,
        max_output_tokens=cfg.rollout.max_new_tokens,
    )


def _synthetic_prompt_tokens(cfg: DynaRLConfig, num_iterations: int) -> list[list[int]]:
    from dynarl.envs.prompts import prompt_sampler
    from dynarl.envs.synthetic import SyntheticTask

    seed = cfg.run.seed
    sampler = prompt_sampler(cfg.data, seed=seed, generator=SyntheticTask(seed=seed).prompt)
    # +1: the BOS token the real loop puts in front of every prompt
    return [
        [len(p.text) + 1 for p in sampler.take(cfg.algorithm.num_prompts)]
        for _ in range(num_iterations)
    ]


def cpu_cluster(
    run: SimulatedRun,
    *,
    profile: CpuProfile | None = None,
    workload: MathWorkload | ReplayWorkload | None = None,
) -> ClusterModel:
    """The simulator's cost models for ``run`` on CPU device slots of ``profile``
    (default: the one ``run.sim.gpu`` names). Without ``workload``, a math workload of
    ``run.sim.median_output_tokens`` (lognormal, capped at ``rollout.max_new_tokens``).

    Raises:
        SimError: ``run.sim.gpu`` names no CPU profile and none is given, or
            ``run.sim.workload`` is not ``math`` (the reference CPU workers run the
            math workload only).
    """
    cfg, sim = run.job, run.sim
    if profile is None:
        _check_model_section(sim.gpu, cfg.model)
    profile = profile or cpu_profile(sim.gpu)
    if profile is None:
        raise SimError(
            f"sim.gpu={sim.gpu!r} is not a CPU profile; known: {', '.join(CPU_PROFILES)}"
        )
    if workload is None and sim.workload != "math":
        raise SimError(
            f"sim.workload={sim.workload!r}: the CPU profile sim.gpu={sim.gpu!r} "
            "models the reference CPU workers, which run the math workload; set "
            "sim.workload=math, or pick a GPU profile (sim.gpu=H100, H200 or A100)"
        )
    shape = model_profile(cfg.model)
    workload = workload or MathWorkload(
        num_prompts=cfg.algorithm.num_prompts,
        group_size=cfg.algorithm.group_size,
        median_output_tokens=sim.median_output_tokens,
        max_output_tokens=cfg.rollout.max_new_tokens,
        prompt_median_tokens=8,
        min_prompt_tokens=2,
        max_prompt_tokens=cfg.model.max_seq_len // 4,
        min_output_tokens=1,
        lengths=sim.output_lengths,
    )
    per_context = profile.decode_per_context_token_s
    # An effective memory bandwidth that makes the engine model's per-context cost the
    # measured one, and a FLOP rate that makes its prefill cost per token the measured one.
    bandwidth = shape.kv_bytes_per_token / max(per_context, 1e-12)
    flops = shape.forward_flops_per_token(0.0) / profile.prefill_per_token_s
    device = GpuProfile(
        name=profile.name,
        hbm_bytes_per_s=bandwidth,
        bf16_flops_per_s=flops,
        memory_bytes=8 * 2**30,
        nvlink_bytes_per_s=1e9,
        nic_bytes_per_s=1e9,
    )
    weights_s = shape.weight_bytes / cfg.rollout.tp / bandwidth
    algo = cfg.algorithm
    efficiency = DataParallelEfficiency(alpha=profile.dp_alpha)
    # Without a measured bandwidth, migration costs are the setup times alone.
    bandwidth = profile.transfer_bytes_per_s or 1e18
    return ClusterModel(
        gpu=device,
        model=shape,
        engine=EngineConfig(
            gpu=device,
            model=shape,
            tp=cfg.rollout.tp,
            max_running_requests=cfg.rollout.max_running_requests,
            step_overhead_s=max(0.0, profile.decode_step_s - weights_s) + profile.step_dispatch_s,
            step_per_request_s=profile.decode_per_request_s,
            prefill_mfu=1.0,
            prefill_overhead_s=profile.prefill_overhead_s + profile.step_dispatch_s,
            padded_kv=True,
            join_per_held_token_s=profile.join_per_held_token_s,
            leave_per_held_token_s=profile.leave_per_held_token_s,
            kv_capacity_tokens=cfg.rollout.kv_capacity_tokens,
        ),
        inference=CpuInferenceCost(
            gpu=device,
            model=shape,
            tp=cfg.inference.tp,
            num_forwards=cfg.inference_forwards,
            efficiency=efficiency,
            overhead_s=profile.inference_overhead_s,
            per_token_s=profile.inference_per_token_s,
        ),
        actor=CpuActorCost(
            gpu=device,
            model=shape,
            tp=cfg.actor.tp,
            pp=cfg.actor.pp,
            n_minibatches=algo.n_minibatches,
            efficiency=efficiency,
            overhead_s=profile.train_overhead_s,
            per_token_s=profile.train_per_token_s,
            per_token_context_s=profile.train_per_token_context_s,
        ),
        migration=MigrationCostModel(
            workload=MigrationCost(
                setup_s=profile.engine_acquire_s, bandwidth_bytes_per_s=bandwidth
            ),
            reshard=MigrationCost(setup_s=profile.reshard_s, bandwidth_bytes_per_s=bandwidth),
            reboot=MigrationCost(setup_s=profile.reboot_s, bandwidth_bytes_per_s=bandwidth),
        ),
        weight_sync=WeightSyncCost(
            setup_s=profile.weight_sync_s + profile.iteration_overhead_s,
            bandwidth_bytes_per_s=bandwidth,
        ),
        workload=workload,
        padded_batches=True,
        train_after_rollout=cfg.algorithm.minibatch_order == "seeded",
        host=profile.host_sharing(),
    )


def _check_model_section(name: str, model_section: ModelConfig) -> None:
    """A profile file's costs hold for the model it was measured with only."""
    if not is_profile_path(name):
        return
    measured = read_profile(name).model
    if model_profile(measured) != model_profile(model_section) or (
        measured.path != model_section.path
    ):
        shape = f"{measured.path or ''} {model_profile(measured).name} {measured.dtype}".strip()
        raise SimError(
            f"sim.gpu={name}: the profile was measured on the model {shape}, and the "
            f"job's model section is {model_profile(model_section).name} "
            f"{model_section.dtype}; simulate the profile's model (set the job's model "
            "section to the file's `model`), or profile this one with "
            "`dynarl profile --set model.<field>=<value>`"
        )
