"""The reference inference worker: per-token log-probs of finished samples under the
current (old) policy and, optionally, a frozen reference model, in micro-batches.

Like the rollout engine it is synchronous and steppable: :meth:`InferenceWorker.step`
scores one micro-batch. Between steps it is at a migration boundary:
:meth:`InferenceWorker.interrupt` hands back the samples not yet scored, and every
sample already scored was returned by the step that scored it.
"""

import collections
import logging
from collections.abc import Iterable, Mapping

import torch
from transformers import PreTrainedModel

from dynarl.workers.config import InferenceConfig, ModelConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import (
    InferenceProgress,
    LogprobRequest,
    LogprobResult,
)
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch import weight_sync, weights
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.logprobs import sequence_logprobs
from dynarl.workers.torch.memory import ParameterMemory
from dynarl.workers.torch.model import build_model
from dynarl.workers.weights import WeightManifest

logger = logging.getLogger(__name__)

__all__ = ["InferenceProgress", "InferenceWorker", "LogprobRequest", "LogprobResult"]


class InferenceWorker:
    """Scores samples micro-batch by micro-batch.

    Args:
        policy: the current policy (its weights are updated every iteration).
        micro_batch_size: samples per forward pass.
        reference: a frozen reference model, or ``None`` for no reference log-probs.
        pad_token_id: token fed at padded positions (masked out).
        temperature: divides the logits before ``log_softmax`` (1: the model's own
            distribution, what the rollout engine reports).
        weight_version: version of the policy weights it starts with.
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        micro_batch_size: int,
        reference: PreTrainedModel | None = None,
        pad_token_id: int = 0,
        temperature: float = 1.0,
        weight_version: int = 0,
    ) -> None:
        if micro_batch_size < 1:
            raise EngineError(f"micro_batch_size={micro_batch_size} must be at least 1")
        self._policy: PreTrainedModel = policy.eval()  # type: ignore[no-untyped-call]
        self._reference: PreTrainedModel | None = None
        if reference is not None:
            self._reference = reference.eval()  # type: ignore[no-untyped-call]
        self._micro_batch_size = micro_batch_size
        self._pad_token_id = pad_token_id
        self._temperature = temperature
        self._version = weight_version
        self._pending: collections.deque[LogprobRequest] = collections.deque()
        self._num_done = 0
        self._memory = [ParameterMemory(m) for m in (policy, reference) if m is not None]

    @classmethod
    def from_config(
        cls,
        model_config: ModelConfig,
        inference_config: InferenceConfig,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> "InferenceWorker":
        """A worker over the model of ``model_config`` (loaded, or random-init from
        ``seed``); with ``compute_ref_logprobs`` a second copy of the same initial
        weights is the frozen reference."""
        tokenizer = load_tokenizer(model_config)
        policy = build_model(model_config, seed=seed, tokenizer=tokenizer, device=device)
        reference = None
        if inference_config.compute_ref_logprobs:
            reference = build_model(model_config, seed=seed, tokenizer=tokenizer, device=device)
            reference.requires_grad_(False)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(
            policy,
            micro_batch_size=inference_config.micro_batch_size,
            reference=reference,
            pad_token_id=pad,
        )

    @property
    def policy(self) -> PreTrainedModel:
        """The policy model."""
        return self._policy

    @property
    def weight_version(self) -> int:
        """Version of the policy weights."""
        return self._version

    def progress(self) -> InferenceProgress:
        """Samples scored since the worker started, and samples waiting."""
        return InferenceProgress(num_done=self._num_done, num_pending=len(self._pending))

    def submit(self, requests: Iterable[LogprobRequest]) -> None:
        """Queue samples to score, in order.

        Raises:
            BadRequestError: a sample's ``response_start`` is not within its tokens.
        """
        requests = list(requests)
        for request in requests:
            if not 1 <= request.response_start <= len(request.token_ids):
                raise BadRequestError(
                    f"sample {request.item_id!r} has {len(request.token_ids)} tokens and "
                    f"response_start={request.response_start}; it must be in 1..len(token_ids)"
                )
        self._pending.extend(requests)

    def step(self) -> list[LogprobResult]:
        """Score the next micro-batch (empty when nothing waits)."""
        if any(memory.released for memory in self._memory):
            raise EngineError("the worker's weights are released; resume_memory_occupation()")
        count = min(self._micro_batch_size, len(self._pending))
        batch = [self._pending.popleft() for _ in range(count)]
        if not batch:
            return []
        sequences = [r.token_ids for r in batch]
        starts = [r.response_start for r in batch]
        policy = self._score(self._policy, sequences, starts)
        reference = self._score(self._reference, sequences, starts) if self._reference else None
        self._num_done += len(batch)
        return [
            LogprobResult(
                item_id=request.item_id,
                logprobs=policy[i],
                ref_logprobs=reference[i] if reference is not None else None,
                weight_version=self._version,
            )
            for i, request in enumerate(batch)
        ]

    def run(self) -> list[LogprobResult]:
        """Score everything waiting."""
        results = []
        while self._pending:
            results.extend(self.step())
        return results

    def interrupt(self) -> list[LogprobRequest]:
        """Stop at this micro-batch boundary: take the samples not yet scored out of the
        worker (to resubmit elsewhere), in order."""
        pending = list(self._pending)
        self._pending.clear()
        logger.info("interrupted with %d samples left", len(pending))
        return pending

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load policy weights in process (any subset) and take ``version``."""
        weights.load_weights(self._policy, named_tensors)
        self._version = version

    def update_weights(self, group: Group, manifest: WeightManifest | None = None) -> int:
        """Receive the policy weights the trainer broadcasts over ``group`` as
        ``manifest`` describes them (see
        :func:`~dynarl.workers.torch.weight_sync.send_by_manifest`; without one,
        :func:`~dynarl.workers.torch.weight_sync.send_weights`); returns their version."""
        if manifest is None:
            self._version = weight_sync.receive_weights(self._policy, group=group)
        else:
            self._version = weight_sync.receive_by_manifest(self._policy, manifest, group=group)
        return self._version

    def release_memory_occupation(self) -> None:
        """Free both models' parameters, keeping a host copy (the reference model cannot
        be sent again, and the policy's copy saves a weight sync when nothing changed)."""
        for memory in self._memory:
            memory.release(host_backup=True)

    def resume_memory_occupation(self) -> None:
        """Allocate and restore the parameters released by
        :meth:`release_memory_occupation`."""
        for memory in self._memory:
            memory.resume()

    def _score(
        self,
        model: PreTrainedModel,
        sequences: list[tuple[int, ...]],
        starts: list[int],
    ) -> list[tuple[float, ...]]:
        scores = sequence_logprobs(
            model,
            sequences,
            starts=starts,
            pad_token_id=self._pad_token_id,
            temperature=self._temperature,
        )
        return [tuple(s.tolist()) for s in scores]
