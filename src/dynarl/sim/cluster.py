"""The modelled cluster of a configuration: every cost model and the workload, built
once from the config tree, and the profile those models would show a profiling run.

:class:`ClusterModel` is what :class:`~dynarl.sim.world.SimWorld` and the
work-conserving bound read; :func:`sim_profile` seeds the real controller's predictor
with the throughputs these models deliver (as a short profiling run would measure),
so the simulated controller starts from the same knowledge a real one would.
"""

import math
from collections.abc import Sequence

import msgspec

from dynarl.control.predictor_profile import PrefillCost, Profile, ProfileRow
from dynarl.control.throughput_fit import busy_devices
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT
from dynarl.obs.trace_records import Request
from dynarl.sim.config import SimulatedRun
from dynarl.sim.costs import (
    ActorCost,
    InferenceCost,
    MigrationCostModel,
    WeightSyncCost,
    attended_context,
    expected_longest,
)
from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.errors import SimError
from dynarl.sim.hardware import GpuProfile, gpu
from dynarl.sim.host import HostSharing
from dynarl.sim.models import ModelProfile, model
from dynarl.sim.replay import ReplayWorkload
from dynarl.sim.traces import read_trace
from dynarl.sim.workloads import AgenticWorkload, MathWorkload, ToolLatency


class ClusterModel(msgspec.Struct, frozen=True, kw_only=True):
    """Cost models and workload of one simulated configuration.

    ``padded_batches``: an optimizer step costs its minibatch padded to the longest
    sample (the reference CPU trainer), not its tokens. ``train_after_rollout``: the
    first optimizer step waits for the whole iteration to be scored
    (``algorithm.minibatch_order=seeded``: minibatches are split at random over the
    whole iteration), instead of starting on the first complete minibatch of groups
    (``completion``, as the reference system trains). ``host``: the devices are slots
    sharing one host's cores and slow each other down by this measured curve; ``None``
    (every GPU profile): devices are independent.
    """

    gpu: GpuProfile
    model: ModelProfile
    engine: EngineConfig
    inference: InferenceCost
    actor: ActorCost
    migration: MigrationCostModel
    weight_sync: WeightSyncCost
    workload: MathWorkload | AgenticWorkload | ReplayWorkload
    padded_batches: bool = False
    train_after_rollout: bool = False
    host: HostSharing | None = None

    @classmethod
    def for_gpu(cls, run: SimulatedRun) -> "ClusterModel":
        """Build every model from ``run`` on its GPU (``sim.gpu``, a built-in GPU
        profile; :func:`~dynarl.sim.cluster_build.build_cluster` also takes CPU
        profiles): its ``sim`` section and the job's component sections (parallel
        sizes, batch caps, batch shape, length cap)."""
        cfg, sim, algo = run.job, run.sim, run.job.algorithm
        replay = None if sim.trace is None else trace_workload(run)
        device, shape = gpu(sim.gpu), model(sim.model)
        workload: MathWorkload | AgenticWorkload | ReplayWorkload
        if replay is not None:
            workload = replay
        elif sim.workload == "math":
            workload = MathWorkload(
                num_prompts=algo.num_prompts + algo.over_sample_prompts,
                group_size=algo.group_size,
                median_output_tokens=sim.median_output_tokens,
                max_output_tokens=cfg.rollout.max_new_tokens,
                lengths=sim.output_lengths,
            )
        else:
            workload = AgenticWorkload(
                num_prompts=algo.num_prompts + algo.over_sample_prompts,
                group_size=algo.group_size,
                mean_tool_calls=sim.mean_tool_calls,
                max_tool_calls=sim.max_tool_calls,
                first_turn_median_tokens=sim.first_turn_median_tokens,
                turn_decay=sim.turn_decay,
                tool_output_median_tokens=sim.tool_output_median_tokens,
                max_output_tokens=cfg.rollout.max_new_tokens,
                tool=ToolLatency(
                    mean_s=sim.tool_mean_s, sigma=sim.tool_sigma, timeout_s=sim.tool_timeout_s
                ),
            )
        return cls(
            gpu=device,
            model=shape,
            engine=EngineConfig(
                gpu=device,
                model=shape,
                tp=cfg.rollout.tp,
                max_running_requests=cfg.rollout.max_running_requests,
            ),
            inference=InferenceCost(
                gpu=device,
                model=shape,
                tp=cfg.inference.tp,
                num_forwards=cfg.inference_forwards,
            ),
            actor=ActorCost(
                gpu=device,
                model=shape,
                tp=cfg.actor.tp,
                pp=cfg.actor.pp,
                n_minibatches=algo.n_minibatches,
            ),
            migration=MigrationCostModel(),
            weight_sync=WeightSyncCost(),
            workload=workload,
            train_after_rollout=algo.minibatch_order == "seeded",
        )


def sequence_tokens(request: Request) -> int:
    """Tokens a trained sample holds: prompt, every turn and every tool output."""
    return request.total_tokens


def sim_profile(
    cluster: ClusterModel, requests: Sequence[Request], num_devices: int, *, tail_tp: int = 0
) -> Profile:
    """What a short profiling run on ``cluster`` would measure, as predictor seed rows.

    Rollout rows come from the engine's decode step at the context the workload's
    tokens are generated at (token-weighted mean, from ``requests``), a quarter of it
    and four times it; inference and
    actor rows (sample tokens/s) from their cost models at the workload's mean sample
    length and token-weighted attended context (a trainer that pads each minibatch to
    its longest sample, ``cluster.padded_batches``: every sample at the expected
    longest of a minibatch drawn from the workload); migration costs from the migration
    model; the rollout engine's re-prefill cost from its prefill model and KV capacity.
    On slots sharing a host (``cluster.host``) each row's throughput is divided by the
    host's slowdown at the slots its work keeps busy, as such a run would measure (seed
    a predictor with :func:`host_slowdown` so it reads them so). With ``tail_tp``, the
    rollout rows again for engines of that size (``ProfileRow.engine_devices``): what
    the engines regrouped for the rollout's tail run at.
    """
    eng = cluster.engine
    turns = [(r.prompt_tokens, n) for r in requests for n in r.output_tokens]
    tokens = sum(n for _, n in turns) or 1
    # Mean context a generated token reads: prompt plus half its own response.
    context = sum(n * (p + n / 2) for p, n in turns) / tokens
    lengths = [sequence_tokens(r) for r in requests]
    mean_tokens = sum(lengths) / max(len(requests), 1)
    attended = attended_context(lengths)
    samples_per_step = max(1, len(requests) // cluster.actor.n_minibatches)
    rows = _rollout_rows(eng, context, num_devices)
    if tail_tp and tail_tp != eng.tp:
        wide = msgspec.structs.replace(eng, tp=tail_tp)
        rows += _rollout_rows(wide, context, num_devices, engine_devices=tail_tp)
    unit = cluster.inference.tp
    for n in range(unit, num_devices + 1, unit) if cluster.inference.num_forwards else ():
        per_item = cluster.inference.time_s(mean_tokens, unit, attended) / (n // unit)
        rows.append(
            ProfileRow(component=INFERENCE, devices=n, load=1024, throughput=mean_tokens / per_item)
        )
    unit = cluster.actor.replica_devices
    if cluster.padded_batches:  # every row padded to the minibatch's longest (as actor.py)
        longest = expected_longest(lengths, samples_per_step)
        step_tokens, step_context = samples_per_step * longest, longest / 2
    else:
        step_tokens, step_context = samples_per_step * mean_tokens, attended
    for n in range(unit, num_devices + 1, unit):
        step_s = cluster.actor.step_time_s(step_tokens, n, step_context)
        rows.append(
            ProfileRow(
                component=ACTOR,
                devices=n,
                load=samples_per_step,
                throughput=samples_per_step * mean_tokens / step_s,
            )
        )
    mig, shape = cluster.migration, cluster.model
    migration_s = {
        "workload": mig.time_s("workload", shape),
        "reshard": mig.time_s("reshard", shape) + mig.time_s("workload", shape) / 2,
        "reboot": mig.time_s("reboot", shape),
    }
    # prefill_s(n) = n * (fixed + per_context * n / 2) FLOPs at the engine's rate
    s_per_flop = eng.prefill_s(1.0) / shape.prefill_flops(1.0)
    fixed = shape.forward_flops_per_token(0.0)
    prefill = PrefillCost(
        s_per_token=fixed * s_per_flop,
        s_per_token_context=(shape.forward_flops_per_token(1.0) - fixed) * s_per_flop,
        kv_capacity_tokens=float(eng.kv_tokens_capacity),
    )
    if cluster.host is not None:
        # Slots sharing the host: a profiling run on n of them measures what they do
        # together, n / slowdown(n) of one slot alone.
        rows = [
            msgspec.structs.replace(
                r,
                throughput=r.throughput
                / cluster.host.factor(_busy_slots(r, r.engine_devices or eng.tp)),
            )
            for r in rows
        ]
    return Profile(rows=tuple(rows), migration_s=migration_s, prefill={ROLLOUT: prefill})


def _rollout_rows(
    eng: EngineConfig, context: float, num_devices: int, *, engine_devices: int = 0
) -> list[ProfileRow]:
    """Rollout rows of engines ``eng`` (decode steps at ``context`` tokens, a quarter
    and four times it) on every whole number of them up to ``num_devices``, marked as
    engines of ``engine_devices`` devices (0: the rollout's own size)."""
    a, b = eng.step_coefficients()
    cap = eng.max_running_requests
    rows: list[ProfileRow] = []
    for n in range(eng.tp, num_devices + 1, eng.tp):
        engines = n // eng.tp
        for load in (1, 4, 16, 64, 256, 1024, 4096, 16384):
            running = min(load, cap * engines)
            for ctx in (context / 4, context, context * 4):
                # fewer requests than engines: each runs alone on its engine
                per_engine = running / min(running, engines)
                step = a + eng.step_per_request_s * per_engine + b * ctx * per_engine
                rows.append(
                    ProfileRow(
                        component=ROLLOUT,
                        devices=n,
                        load=running,
                        throughput=running / step,
                        context=ctx,
                        engine_devices=engine_devices,
                    )
                )
    return rows


def _busy_slots(row: ProfileRow, unit: int) -> int:
    """Slots a profile row's work keeps computing at once: a rollout request runs on
    one engine of ``unit`` slots; the other stages keep all theirs busy."""
    if row.component == ROLLOUT:
        return math.ceil(busy_devices(row.devices, row.load, unit))
    return row.devices


def host_slowdown(cluster: ClusterModel, num_devices: int) -> tuple[float, ...]:
    """The host curve the predictor of a run on ``cluster``'s ``num_devices`` devices
    is given (``Predictor(host_slowdown=...)``): the one a real run's controller is
    given on that host (:meth:`~dynarl.sim.host.HostSharing.predictor_slowdown`);
    empty for independent devices (every GPU profile)."""
    if cluster.host is None:
        return ()
    return cluster.host.predictor_slowdown(num_devices)


def longest_decode_s(cluster: ClusterModel, requests: Sequence[Request]) -> float:
    """The rollout's critical path: the longest request decoded alone (every step
    pays the engine's fixed cost), whatever the device count."""
    worst = max((decode_alone_s(cluster, r) for r in requests), default=0.0)
    return worst if math.isfinite(worst) else 0.0


def decode_alone_s(cluster: ClusterModel, r: Request) -> float:
    """Seconds to decode ``r`` alone on one engine (every step pays the engine's
    fixed cost), its tool calls included."""
    a, b = cluster.engine.step_coefficients()
    a += cluster.engine.step_per_request_s  # a batch of one
    context, total = float(r.prompt_tokens), 0.0
    for k, n in enumerate(r.output_tokens):
        total += n * a + b * (n * context + n * (n - 1) / 2)
        context += n + (r.tool_output_tokens[k] if k < r.num_tool_calls else 0)
    return total + sum(r.tool_latency_s)


def trace_workload(run: SimulatedRun) -> ReplayWorkload:
    """The replay of ``run.sim.trace``, checked against the job it runs in.

    Raises:
        SimError: the file is not a trace, or its batch shape, longest response or kind
            (single-turn or agentic) disagrees with the job's; the message names the
            field to set (``dynarl sim --workload FILE`` sets them from the trace).
    """
    sim, algo = run.sim, run.job.algorithm
    assert sim.trace is not None, "only a run with a trace replays one"
    replay = ReplayWorkload.of_requests(read_trace(sim.trace).requests, source=sim.trace)
    shape = (replay.num_prompts, replay.group_size)
    if algo.partial_rollouts and shape[1] == algo.group_size:
        if shape[0] < algo.num_prompts + algo.over_sample_prompts:
            raise SimError(
                f"sim.trace={sim.trace} holds {shape[0]} prompts per iteration and a "
                f"partial rollout of {algo.num_prompts} + {algo.over_sample_prompts} "
                "over-sampled groups needs as many fresh ones at its first iteration: "
                f"lower algorithm.over_sample_prompts to {max(0, shape[0] - algo.num_prompts)} "
                "or replay a trace with more prompts per iteration"
            )
    elif shape != (algo.num_prompts, algo.group_size):
        raise SimError(
            f"sim.trace={sim.trace} holds {shape[0]} prompts x {shape[1]} samples per "
            f"iteration and the job {algo.num_prompts} x {algo.group_size}: set "
            f"algorithm.num_prompts={shape[0]} algorithm.group_size={shape[1]} "
            "(`dynarl sim --workload FILE` does)"
        )
    cap = run.job.rollout.max_new_tokens
    if replay.longest_output_tokens > cap:
        raise SimError(
            f"sim.trace={sim.trace} holds a request of {replay.longest_output_tokens} "
            f"generated tokens, above rollout.max_new_tokens={cap}: set "
            f"rollout.max_new_tokens={replay.longest_output_tokens} or more "
            "(`dynarl sim --workload FILE` does)"
        )
    kind = "agentic" if replay.multi_turn else "math"
    if sim.workload != kind:
        raise SimError(
            f"sim.trace={sim.trace} holds {'multi' if replay.multi_turn else 'single'}-turn "
            f"requests, and sim.workload={sim.workload}: set sim.workload={kind} "
            "(`dynarl sim --workload FILE` does)"
        )
    return msgspec.structs.replace(replay, max_output_tokens=cap)
