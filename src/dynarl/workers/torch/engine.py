"""The reference rollout engine: continuous batching over a ``transformers`` causal LM.

Synchronous and steppable, like nano-vllm's ``LLMEngine``: :meth:`RolloutEngine.step`
decides (admit a prefill batch, or decode the running batch), executes one forward
pass, and applies the sampled tokens, returning what each request produced. A worker
process loop, a test and a notebook all drive the same core.

Its surface is the one the SGLang backend implements: requests with sampling params and
a priority, ``abort`` returning partial output, weight updates from a distributed group
carrying a version, and release/resume of memory occupation.
"""

import collections
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch
from transformers import PreTrainedModel

from dynarl.data.request_order import FifoOrder, RequestOrder
from dynarl.workers.config import ModelConfig, RolloutConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.rollout import (
    Completion,
    EngineLoad,
    GenerateRequest,
    StepOutput,
    TokenDelta,
)
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch import weight_sync, weights
from dynarl.workers.torch.batch_cache import BatchCache
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.memory import ParameterMemory
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.prefix_cache import CachedPrefix, PrefixCache
from dynarl.workers.torch.sampler import sample, uniform
from dynarl.workers.torch.scheduler import Scheduler
from dynarl.workers.torch.sequence import Sequence
from dynarl.workers.torch.waiting import OrderedWaitingList, WaitingQueue
from dynarl.workers.weights import WeightManifest

logger = logging.getLogger(__name__)

MemoryTag = Literal["weights", "kv_cache"]
"""What :meth:`RolloutEngine.release_memory_occupation` can release (SGLang's tags)."""

ALL_MEMORY: tuple[MemoryTag, ...] = ("weights", "kv_cache")
"""Every memory tag."""

THROUGHPUT_WINDOW_S = 5.0
"""How far back :meth:`RolloutEngine.stats` looks to measure generation throughput."""


class RolloutEngine:
    """Generates responses for many requests at once, one :meth:`step` at a time.

    Args:
        model: a ``transformers`` causal LM with full-attention layers.
        eos_token_id: token that ends a request unless it sets ``ignore_eos``.
        pad_token_id: token fed at padded positions (masked out).
        max_running_requests: requests decoded at once.
        kv_capacity_tokens: KV tokens the running requests may hold together; at least
            ``max_seq_len``.
        max_prefill_tokens: padded tokens one prefill batch may feed.
        max_seq_len: longest prompt + output (default: the model's
            ``max_position_embeddings``); a request reaching it finishes (``length``).
        order: serving order of the waiting queue (default: FIFO).
        queue: the waiting queue itself, e.g. the data plane's ``RequestQueue``
            (default: a list in ``order``); a bounded one needs room for every request
            the engine holds, since preempted requests go back into it.
        now_s: clock for queue arrival times and throughput (default: monotonic time).
        seed: draws the sampling seeds of requests that bring none.
        weight_version: version of the weights the model starts with.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_id: int | None,
        pad_token_id: int = 0,
        max_running_requests: int = 64,
        kv_capacity_tokens: int = 16384,
        max_prefill_tokens: int = 4096,
        max_seq_len: int | None = None,
        order: RequestOrder | None = None,
        queue: WaitingQueue[Sequence] | None = None,
        now_s: Callable[[], float] = time.monotonic,
        seed: int = 0,
        weight_version: int = 0,
    ) -> None:
        if min(max_running_requests, max_prefill_tokens) < 1:
            raise EngineError(
                f"max_running_requests={max_running_requests} and max_prefill_tokens="
                f"{max_prefill_tokens} must both be at least 1"
            )
        self._model = model.eval()  # type: ignore[no-untyped-call]
        self._eos_token_id = eos_token_id
        self._max_seq_len = max_seq_len or int(model.config.max_position_embeddings)
        if kv_capacity_tokens < self._max_seq_len:
            raise EngineError(
                f"kv_capacity_tokens={kv_capacity_tokens} cannot hold one sequence of "
                f"max_seq_len={self._max_seq_len}; raise the capacity or lower max_seq_len"
            )
        waiting = queue if queue is not None else OrderedWaitingList[Sequence](order or FifoOrder())
        self._scheduler = Scheduler(
            waiting,
            max_running_requests=max_running_requests,
            kv_capacity_tokens=kv_capacity_tokens,
            max_prefill_tokens=max_prefill_tokens,
        )
        self._cache = BatchCache(model, pad_token_id=pad_token_id)
        self._rows: list[Sequence] = []  # running sequences in cache-row order
        self._memory = ParameterMemory(model)
        self._now_s = now_s
        self._seeds = random.Random(seed)
        self._version = weight_version
        # The last few seconds of steps: (end, tokens generated, start).
        self._recent: collections.deque[tuple[float, int, float]] = collections.deque()
        self._prefixes = PrefixCache()
        self._prefill_tokens = 0
        # Steps since the engine started and the seconds they took: [prefill, decode].
        self._steps = [0, 0]
        self._step_s = [0.0, 0.0]
        self._resume_prefill_s = 0.0  # of the prefills' seconds, re-prefills' share
        self._decode_tokens = 0

    @classmethod
    def from_config(
        cls,
        model_config: ModelConfig,
        rollout_config: RolloutConfig,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        order: RequestOrder | None = None,
        queue: WaitingQueue[Sequence] | None = None,
    ) -> "RolloutEngine":
        """An engine over the model of ``model_config`` (loaded or random-init from
        ``seed``) with the limits of ``rollout_config``; ``order`` and ``queue`` as in
        the constructor."""
        tokenizer = load_tokenizer(model_config)
        model = build_model(model_config, seed=seed, tokenizer=tokenizer, device=device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            max_running_requests=rollout_config.max_running_requests,
            kv_capacity_tokens=rollout_config.kv_capacity_tokens,
            max_seq_len=model_config.max_seq_len,
            order=order,
            queue=queue,
            seed=seed,
        )

    @property
    def model(self) -> PreTrainedModel:
        """The model generating tokens."""
        model: PreTrainedModel = self._model
        return model

    @property
    def weight_version(self) -> int:
        """Version of the weights in the model; every output token records it."""
        return self._version

    @property
    def max_running_requests(self) -> int:
        """Requests decoded at once."""
        return self._scheduler.max_running_requests

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return self._scheduler.num_waiting + len(self._scheduler.running)

    def add_request(self, request: GenerateRequest) -> None:
        """Queue ``request`` (fresh, or resumed with partial output).

        Raises:
            BadRequestError: the id is already held here, the prompt is empty, the context
                leaves no room under ``max_seq_len``, or its output is already complete.
        """
        rid = request.request_id
        context_tokens = len(request.prompt_ids) + len(request.output_ids)
        if self._scheduler.holds(rid):
            raise BadRequestError(f"request {rid!r} is already in this engine; use a new id")
        if not request.prompt_ids:
            raise BadRequestError(f"request {rid!r} has an empty prompt; give at least one token")
        if len(request.output_logprobs) != len(request.output_ids):
            raise BadRequestError(f"request {rid!r} needs one output log-prob per output token")
        if context_tokens >= self._max_seq_len:
            raise BadRequestError(
                f"request {rid!r} has {context_tokens} tokens, leaving no room under "
                f"max_seq_len={self._max_seq_len}; shorten the prompt"
            )
        if len(request.output_ids) >= request.sampling.max_new_tokens:
            raise BadRequestError(f"request {rid!r} already has max_new_tokens output tokens")
        seed = request.sampling.seed
        seq = Sequence(
            request,
            seed=seed if seed is not None else self._seeds.getrandbits(63),
            enqueued_s=self._now_s(),
        )
        if request.multi_turn:  # what the waiting queue's order ranks by
            seq.prefix_tokens = self._prefixes.match_tokens(rid, seq.context_ids())
        self._scheduler.add(seq)

    def step(self) -> list[StepOutput]:
        """One iteration: prefill newly admitted requests, or else decode every running
        request by one token. Returns the streamed tokens and completions it produced."""
        if not self._memory.has_valid_weights:
            raise EngineError(
                "the engine's weights are released or not loaded; call "
                "resume_memory_occupation() and load or update the weights first"
            )
        start_s = self._now_s()
        admitted = self._scheduler.admit()
        resumed_share = 0.0
        if admitted:
            contexts = [seq.context_ids() for seq in admitted]
            prefixes = [
                self._take_prefix(seq, c) for seq, c in zip(admitted, contexts, strict=True)
            ]
            fed = [
                len(c) - (p.num_tokens if p is not None else 0)
                for c, p in zip(contexts, prefixes, strict=True)
            ]
            total = sum(fed)
            self._prefill_tokens += total
            # the share of the prefill's time that re-prefills resumed requests
            resumed = sum(n for seq, n in zip(admitted, fed, strict=True) if seq.resumed)
            if total > 0:
                resumed_share = resumed / total
            for seq in admitted:
                seq.resumed = False
            self._fit_prefixes()
            logits = self._cache.prefill(contexts, prefixes)
            self._rows.extend(admitted)
            batch = admitted
        else:
            self._scheduler.preempt_for_decode()
            self._sync_rows()
            if not self._rows:
                return []
            batch = self._rows
            last = torch.tensor([seq.output_ids[-1] for seq in batch], dtype=torch.long)
            logits = self._cache.decode(last)
        outputs, finished = self._apply(batch, logits)
        self._keep_prefixes(finished)
        self._sync_rows()
        self._fit_prefixes()
        end_s = self._now_s()
        self._recent.append((end_s, len(batch), start_s))
        kind = 0 if admitted else 1
        self._steps[kind] += 1
        self._step_s[kind] += end_s - start_s
        if kind:
            self._decode_tokens += len(batch)
        else:
            self._resume_prefill_s += (end_s - start_s) * resumed_share
        return outputs

    def generate(self, requests: Iterable[GenerateRequest]) -> list[Completion]:
        """Add ``requests`` and step until every request here has finished; returns the
        completions in finishing order."""
        for request in requests:
            self.add_request(request)
        done: list[Completion] = []
        while self.num_unfinished:
            done.extend(out for out in self.step() if isinstance(out, Completion))
        return done

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerateRequest]:
        """Take requests out of the engine (all when ``None``; unknown or finished ids
        are ignored) and return each with its partial output and sampling seed, ready to
        resume on any engine."""
        taken = self._scheduler.remove(request_ids)
        self._sync_rows()
        for seq in taken:  # the session resumes elsewhere: its prefix here is dead
            self._prefixes.drop(seq.request_id)
        return [seq.to_request() for seq in taken]

    def end_session(self, session: str) -> None:
        """Drop the cached prefix of ``session`` (a multi-turn episode's request id):
        its episode is over. Unknown sessions are ignored."""
        self._prefixes.drop(session)

    @property
    def prefix_cache(self) -> PrefixCache:
        """The per-session prefix cache (its size and hit counters)."""
        return self._prefixes

    def stats(self) -> EngineLoad:
        """KV usage, running and queued counts, generation throughput, and the steps
        taken since the engine started, by kind, with their seconds.

        The throughput is tokens per second of wall time over the steps of the last
        few seconds: from the first of those steps' start to now (0 after none). The
        control plane integrates it over the time between reports to advance each
        running request, so it counts the gaps between steps (the worker's loop, a
        shared host) as well as the steps.
        """
        now = self._now_s()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        span_s = now - self._recent[0][2] if self._recent else 0.0
        tokens = sum(count for _, count, _ in self._recent)
        return EngineLoad(
            kv_usage=self._scheduler.kv_tokens_held / self._scheduler.kv_capacity_tokens,
            num_running=len(self._scheduler.running),
            num_queued=self._scheduler.num_waiting,
            gen_tokens_per_s=tokens / span_s if span_s > 0 else 0.0,
            kv_tokens=self._scheduler.kv_tokens_held,
            cached_prefix_tokens=self._prefixes.num_tokens,
            prefix_hit_tokens=self._prefixes.hit_tokens,
            prefill_tokens=self._prefill_tokens,
            prefill_steps=self._steps[0],
            decode_steps=self._steps[1],
            prefill_s=self._step_s[0],
            resume_prefill_s=self._resume_prefill_s,
            decode_s=self._step_s[1],
            decode_tokens=self._decode_tokens,
        )

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load weights in process (any subset of the parameters) and take ``version``.

        Running requests go back to the queue with their output so far: their KV was
        computed with the old weights, so they re-prefill under the new ones.
        """
        self._check_resumed()
        weights.load_weights(self._model, named_tensors)
        complete = len(named_tensors) == sum(1 for _ in self._model.parameters())
        self._after_weight_update(version, complete=complete)

    def update_weights(self, group: Group, manifest: WeightManifest | None = None) -> int:
        """Receive the weights the trainer broadcasts over ``group`` as ``manifest``
        describes them (its rank 0 calls
        :func:`~dynarl.workers.torch.weight_sync.send_by_manifest`; without a manifest,
        :func:`~dynarl.workers.torch.weight_sync.send_weights`) and take their version,
        which is returned. Running requests re-prefill, as for
        :meth:`load_weights` — unless the broadcast carries the version the engine
        already holds (the same weights, sent again to a new group member): then their
        KV cache stays valid and they keep running."""
        self._check_resumed()
        held = self._version if self._memory.has_valid_weights else None
        if manifest is None:
            version = weight_sync.receive_weights(self._model, group=group)
        else:
            version = weight_sync.receive_by_manifest(self._model, manifest, group=group)
        if version == held:
            return version
        self._after_weight_update(version, complete=True)
        return version

    def release_memory_occupation(
        self, tags: Iterable[MemoryTag] = ALL_MEMORY, *, host_backup: bool = False
    ) -> None:
        """Free device memory while keeping the process and its requests.

        ``kv_cache``: drop the KV cache; running requests go back to the queue with
        their output so far. ``weights``: free the parameters (kept on the host if
        ``host_backup``; otherwise weights must be loaded again after resuming).
        :meth:`step` refuses to run until weights are back.
        """
        tags = set(tags)
        if "kv_cache" in tags or "weights" in tags:
            self._requeue_running()
        if "weights" in tags:
            self._memory.release(host_backup=host_backup)
        logger.info("released memory occupation: %s", sorted(tags))

    def resume_memory_occupation(self, tags: Iterable[MemoryTag] = ALL_MEMORY) -> None:
        """Allocate released memory again (the KV cache regrows as requests run)."""
        if "weights" in set(tags):
            self._memory.resume()

    def _apply(
        self, batch: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[StepOutput], list[Sequence]]:
        temperatures = torch.tensor([s.request.sampling.temperature for s in batch])
        top_ps = torch.tensor([s.request.sampling.top_p for s in batch])
        uniforms = torch.tensor(
            [uniform(s.seed, len(s.output_ids)) for s in batch], dtype=torch.float64
        )
        token_ids, logprobs = sample(
            logits, temperatures=temperatures, top_ps=top_ps, uniforms=uniforms
        )
        outputs: list[StepOutput] = []
        finished: list[Sequence] = []
        for seq, token_id, logprob in zip(
            batch, token_ids.tolist(), logprobs.tolist(), strict=True
        ):
            seq.append(token_id, logprob, self._version)
            if seq.request.stream:
                outputs.append(
                    TokenDelta(
                        request_id=seq.request_id, token_ids=(token_id,), logprobs=(logprob,)
                    )
                )
            sampling = seq.request.sampling
            if token_id in sampling.stop_token_ids or (
                token_id == self._eos_token_id and not sampling.ignore_eos
            ):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= sampling.max_new_tokens or (
                seq.num_tokens >= self._max_seq_len
            ):
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                finished.append(seq)
                outputs.append(seq.to_completion())
        self._scheduler.finish(finished)
        return outputs, finished

    def _sync_rows(self) -> None:
        """Make the cache rows match the scheduler's running set (rows only leave here)."""
        running = {id(seq) for seq in self._scheduler.running}
        keep = [row for row, seq in enumerate(self._rows) if id(seq) in running]
        if len(keep) != len(self._rows):
            self._cache.keep(keep)
            self._rows = [self._rows[row] for row in keep]

    def _take_prefix(self, seq: Sequence, context_ids: list[int]) -> CachedPrefix | None:
        """The cached prefix ``seq`` reuses at this prefill (taken out of the cache)."""
        if not seq.request.multi_turn:
            return None
        prefix = self._prefixes.take(seq.request_id, context_ids)
        if prefix is not None:
            seq.cached_tokens += prefix.num_tokens
        return prefix

    def _keep_prefixes(self, finished: list[Sequence]) -> None:
        """Keep the KV of finished multi-turn turns for their sessions' next turns."""
        rows = {id(seq): row for row, seq in enumerate(self._rows)}
        for seq in finished:
            if seq.request.multi_turn and id(seq) in rows:
                fed = tuple(seq.context_ids()[:-1])  # the last sampled token was never fed
                self._prefixes.put(seq.request_id, self._cache.row_prefix(rows[id(seq)], fed))

    def _fit_prefixes(self) -> None:
        """Evict cached prefixes (least recently used first) until they fit in the KV
        budget the running requests leave: running requests always come first."""
        held = self._scheduler.kv_tokens_held + len(self._scheduler.running)
        self._prefixes.evict_to(self._scheduler.kv_capacity_tokens - held)

    def _requeue_running(self) -> None:
        self._scheduler.preempt_all()
        self._cache.clear()
        self._prefixes.clear()
        self._rows = []

    def _after_weight_update(self, version: int, *, complete: bool) -> None:
        # Every cached KV, running or kept for a session, was computed with the old
        # weights: _requeue_running drops it all.
        self._requeue_running()
        if complete:
            self._memory.mark_loaded()
        self._version = version
        logger.info("weights updated to version %d", version)

    def _check_resumed(self) -> None:
        if self._memory.released:
            raise EngineError(
                "the engine's weights are released; call "
                "resume_memory_occupation(['weights']) before loading weights"
            )
