"""Log-prob inference through megatron-core's forward (``inference.backend=megatron``):
the policy and, when configured, a frozen reference, each a ``GPTModel`` holding the
weights of the HF model of the run (a checkpoint, or the seed's random init, as the
torch backend builds it).

Weights arrive from the trainer in the HF layout, as the manifest of the sync
describes them (:mod:`dynarl.workers.torch.weight_sync`): they land in an HF-layout
copy, which checks the manifest first, then convert into the policy. One process serves one replica
(``inference.tp=1``: the backend table refuses more).
"""

import logging
from collections.abc import Sequence

import anyio
import torch

from dynarl.workers.config import InferenceConfig, ModelConfig
from dynarl.workers.errors import BadRequestError
from dynarl.workers.inference import InferenceProgress, LogprobRequest, LogprobResult
from dynarl.workers.megatron import convert
from dynarl.workers.megatron.model import (
    Architecture,
    build_gpt,
    causal_logits,
    single_process_groups,
)
from dynarl.workers.megatron.spec import ModelSpec
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch import weight_sync
from dynarl.workers.torch.buckets import Group
from dynarl.workers.torch.errors import EngineError
from dynarl.workers.torch.memory import ParameterMemory
from dynarl.workers.weights import WeightManifest, WeightReceiver, WeightSyncGroup

logger = logging.getLogger(__name__)


class MegatronInference:
    """Scores samples with Megatron GPT models, one call at a time.

    Args:
        policy, reference: the models (``reference`` ``None``: no reference log-probs).
        receiver: the HF-layout model weight syncs land in.
        arch: their architecture.
        micro_batch_size: samples per forward pass.
        pad_token_id: token at padded positions (masked out).
        name: for error messages.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        reference: torch.nn.Module | None,
        receiver: torch.nn.Module,
        arch: Architecture,
        micro_batch_size: int,
        pad_token_id: int,
        name: str,
    ) -> None:
        self.policy = policy.eval()
        self.reference = reference.eval() if reference is not None else None
        self.receiver = receiver
        self.arch = arch
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = pad_token_id
        self.name = name
        self.sync = weight_sync.Membership()
        """Its place in the weight-sync group."""
        self._version = 0
        self._num_done = 0
        self._num_pending = 0
        self._lock = anyio.Lock()
        self._memory = [ParameterMemory(m) for m in (policy, reference) if m is not None]

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        inference: InferenceConfig,
        *,
        seed: int,
        name: str,
        device: torch.device | None = None,
    ) -> "MegatronInference":
        """The worker of ``model`` (loaded, or random-init from ``seed``), on ``device``
        (default: the CPU)."""
        device = device or torch.device("cpu")
        spec = ModelSpec(model=model, seed=seed)
        arch = spec.architecture()
        hf = spec.hf_model(device=device)
        state = convert.to_megatron({n: p.detach() for n, p in hf.named_parameters()}, arch)
        groups = single_process_groups()
        policy = build_gpt(arch, groups, device=device)
        convert.load_into(policy, state)
        reference = None
        if inference.compute_ref_logprobs:
            reference = build_gpt(arch, groups, device=device)
            convert.load_into(reference, state)
            reference.requires_grad_(False)
        tokenizer = load_tokenizer(model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(
            policy,
            reference=reference,
            receiver=hf,
            arch=arch,
            micro_batch_size=inference.micro_batch_size,
            pad_token_id=int(pad),
            name=name,
        )

    @property
    def device(self) -> torch.device:
        """Where the models run (the weight-sync group is NCCL on a GPU, else gloo)."""
        return next(self.policy.parameters()).device

    @property
    def weight_version(self) -> int:
        """Version of the policy weights."""
        return self._version

    def progress(self) -> InferenceProgress:
        """Samples scored and waiting."""
        return InferenceProgress(num_done=self._num_done, num_pending=self._num_pending)

    async def score(self, requests: Sequence[LogprobRequest]) -> list[LogprobResult]:
        """Log-probs of ``requests``' response tokens, in order."""
        for request in requests:
            if not 1 <= request.response_start <= len(request.token_ids):
                raise BadRequestError(
                    f"sample {request.item_id!r} has {len(request.token_ids)} tokens and "
                    f"response_start={request.response_start}; it must be in 1..len(token_ids)"
                )
        async with self._lock:
            self._num_pending = len(requests)
            try:
                return await anyio.to_thread.run_sync(self._score_all, list(requests))
            finally:
                self._num_pending = 0

    def _score_all(self, requests: list[LogprobRequest]) -> list[LogprobResult]:
        if any(memory.released for memory in self._memory):
            raise EngineError(f"{self.name}: the weights are released; resume_memory() first")
        results = []
        for start in range(0, len(requests), self.micro_batch_size):
            batch = requests[start : start + self.micro_batch_size]
            policy = self._logprobs(self.policy, batch)
            reference = self._logprobs(self.reference, batch) if self.reference else None
            for i, request in enumerate(batch):
                results.append(
                    LogprobResult(
                        item_id=request.item_id,
                        logprobs=policy[i],
                        ref_logprobs=reference[i] if reference is not None else None,
                        weight_version=self._version,
                    )
                )
            self._num_done += len(batch)
            self._num_pending -= len(batch)
        return results

    @torch.inference_mode()
    def _logprobs(
        self, model: torch.nn.Module, batch: list[LogprobRequest]
    ) -> list[tuple[float, ...]]:
        width = max(len(r.token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, request in enumerate(batch):
            ids[row, : len(request.token_ids)] = torch.tensor(request.token_ids)
            mask[row, : len(request.token_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = causal_logits(model, ids, mask, vocab_size=self.arch.vocab_size)
        out = []
        for row, request in enumerate(batch):
            end = len(request.token_ids)
            scores = torch.log_softmax(
                logits[row, request.response_start - 1 : end - 1].float(), -1
            )
            targets = ids[row, request.response_start : end]
            out.append(tuple(scores.gather(-1, targets[:, None]).squeeze(-1).tolist()))
        return out

    async def release_memory(self) -> None:
        """Free the models' parameters (keeping a host copy: the reference cannot be
        sent again)."""
        async with self._lock:
            for memory in self._memory:
                memory.release(host_backup=True)

    async def resume_memory(self) -> None:
        """Allocate the parameters again and restore them."""
        async with self._lock:
            for memory in self._memory:
                memory.resume()

    async def join_weight_sync(self, group: WeightSyncGroup) -> None:
        """Join the trainer's weight-sync group."""
        await self.sync.join(group, device=self.device)

    async def receive_weights(self, manifest: WeightManifest) -> int:
        """Receive the policy weights the trainer broadcasts now (HF layout, as
        ``manifest`` describes them) and load them into the policy; returns their
        version."""
        if self.sync.group is None:
            raise EngineError(f"{self.name} is in no weight-sync group; join one first")
        async with self._lock:
            self._version = await anyio.to_thread.run_sync(self._receive, self.sync.group, manifest)
            return self._version

    def _receive(self, group: Group, manifest: WeightManifest) -> int:
        version = weight_sync.receive_by_manifest(self.receiver, manifest, group=group)
        hf = {n: p.detach() for n, p in self.receiver.named_parameters()}
        convert.load_into(self.policy, convert.to_megatron(hf, self.arch))
        return version

    def adopt_weight_sync(self, other: WeightReceiver) -> bool:
        """Take ``other``'s membership if it is a torch-transport engine of this
        process (the torch backend's engines share the transport)."""
        return self.sync.adopt(getattr(other, "sync", None))

    async def leave_weight_sync(self) -> None:
        """Leave the weight-sync group."""
        await self.sync.leave()
