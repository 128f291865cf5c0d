"""Measure a rollout engine's decode costs before it serves: a few decode steps on a
grid of batch sizes and context lengths, from which the controller's predictor fits
its step model for an engine of that size before any request of the run ran on one.

The dynamic mode's tail regroup (``rollout.tail_tp``;
:mod:`dynarl.control.policies.resize`) weighs engines of ``rollout.tp`` devices against
engines of ``tail_tp`` and needs the decode costs of both sizes. A run learns the
narrow engines' costs as they serve, but nothing of the wide ones until a regroup has
been made, and the policy makes none it cannot score: without a profile that measured
them (``scheduler.predictor_profile``), a fresh run would never regroup. So the world
probes one engine of each size as the run starts (:meth:`RealWorld.start
<dynarl.api.world.RealWorld.start>`), with the same engines and the same step model
the run then refines online.

A probe point submits ``load`` requests of ``prompt`` random tokens that ignore the
end-of-sequence token, twice: with ``new_tokens`` and with ``2 * new_tokens`` to
generate. Both runs prefill as many tokens, so the difference of their wall times is
``new_tokens`` decode steps of the whole batch alone: the engine's decode throughput
at that load, each request holding ``prompt + 1.5 new_tokens`` tokens on average over
those steps. The same on every backend (the SGLang server does not say how long its
steps took). Prompts are drawn at random, afresh for each run, so that no prefix cache
serves a run's prefill from an earlier one's. A point's requests run together: their
load is capped by the engine's batch and KV capacity.
"""

import random
import time
from collections.abc import Sequence

import anyio

from dynarl.workers.errors import WorkerError
from dynarl.workers.protocol import DecodeProbe, DecodeSample, RolloutRole
from dynarl.workers.rollout import Completion, GenerateRequest, RolloutEngine, SamplingParams


def probe_points(
    probe: DecodeProbe, *, max_running: int, kv_tokens: int, max_seq_len: int
) -> list[tuple[int, int]]:
    """The ``(load, prompt tokens)`` points measured on an engine that runs
    ``max_running`` requests at once in ``kv_tokens`` tokens of KV cache, for a model of
    ``max_seq_len``: one request and a full batch (as many as fit in the KV cache at
    the longest run, ``prompt + 2 new_tokens`` each), each at a short prompt and at the
    longest one a full batch fits; fewer points where the limits leave no room."""
    longest = 2 * probe.new_tokens
    seq_room = max_seq_len - longest - 1
    short = min(probe.short_prompt, seq_room)
    if short < 1:
        return []
    batch = max(1, min(max_running, kv_tokens // (short + longest)))
    long = min(seq_room, kv_tokens // batch - longest)
    loads = sorted({1, batch})
    prompts = sorted({short, max(short, long)})
    return [(load, prompt) for load in loads for prompt in prompts]


class _Settled:
    """A probe's sink: counts its requests out, any outcome but a completion fails."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.error: str | None = None
        self.event = anyio.Event()

    def _settle(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()

    def done(self, completion: Completion) -> None:
        self._settle()

    def aborted(self, request: GenerateRequest) -> None:
        self.error = f"probe request {request.request_id} was aborted"
        self._settle()

    async def flush(self) -> None:
        return None

    async def fail(self, error: Exception) -> None:
        self.error = f"the engine failed: {error}"
        self.left = 0
        self.event.set()


async def _timed(engine: RolloutEngine, requests: Sequence[GenerateRequest]) -> float:
    """Seconds from submitting ``requests`` until the last one finished.

    Raises:
        WorkerError: a request did not complete (aborted, or the engine failed).
    """
    sink = _Settled(len(requests))
    start = time.perf_counter()
    await engine.submit(requests, sink)
    await sink.event.wait()
    if sink.error is not None:
        raise WorkerError(f"decode probe: {sink.error}")
    return time.perf_counter() - start


async def probe_decode(
    engine: RolloutEngine,
    probe: DecodeProbe,
    *,
    engine_devices: int,
    kv_tokens: int,
    max_seq_len: int,
    token_ids: Sequence[int],
) -> list[DecodeSample]:
    """Measure ``engine`` (of ``engine_devices`` devices, ``kv_tokens`` of KV cache,
    a model of ``max_seq_len``; its run loop serving) at each point of
    :func:`probe_points`, prompts drawn from ``token_ids``. A point whose longer run
    was not slower than its shorter one (noise) gives no sample.

    Raises:
        WorkerError: the engine holds requests, or a probe request did not complete.
    """
    if engine.num_requests:
        raise WorkerError(
            f"the engine holds {engine.num_requests} requests: a probe measures an idle "
            "engine (its batch alone); finish or abort them first"
        )
    rng = random.Random(probe.seed)
    n = probe.new_tokens
    points = probe_points(
        probe,
        max_running=engine.max_running_requests,
        kv_tokens=kv_tokens,
        max_seq_len=max_seq_len,
    )
    samples: list[DecodeSample] = []
    for k, (load, prompt) in enumerate(points):
        seconds: list[float] = []
        for steps in (n, 2 * n):
            # Fresh prompts each run, so that no prefix cache serves the second's prefill.
            sampling = SamplingParams(
                max_new_tokens=steps, ignore_eos=True, seed=rng.getrandbits(31)
            )
            requests = [
                GenerateRequest(
                    request_id=f"probe-{k}-{steps}-{i}",
                    prompt_ids=tuple(rng.choices(token_ids, k=prompt)),
                    sampling=sampling,
                )
                for i in range(load)
            ]
            seconds.append(await _timed(engine, requests))
        if seconds[1] > seconds[0]:
            samples.append(
                DecodeSample(
                    engine_devices=engine_devices,
                    load=load,
                    context=prompt + 1.5 * n,
                    throughput=load * n / (seconds[1] - seconds[0]),
                )
            )
    return samples


async def probe_role(
    engine: RolloutEngine, role: RolloutRole, probe: DecodeProbe
) -> list[DecodeSample]:
    """:func:`probe_decode` on ``engine``, which serves ``role``: its devices, KV cache
    and model from the role, prompts drawn from its tokenizer's ordinary tokens."""
    from dynarl.workers.tokenizer import load_tokenizer  # transformers: not at import

    tokenizer = await anyio.to_thread.run_sync(lambda: load_tokenizer(role.model))
    special = set(tokenizer.all_special_ids)
    return await probe_decode(
        engine,
        probe,
        engine_devices=len(role.engine_devices),
        kv_tokens=role.kv_capacity_tokens,
        max_seq_len=role.model.max_seq_len,
        token_ids=[t for t in range(len(tokenizer)) if t not in special],
    )
