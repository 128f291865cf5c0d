"""What a Megatron worker builds: the policy of a :class:`~dynarl.workers.config.ModelConfig`
(a checkpoint, or the random-init model of a seed) cut ``tp`` x ``pp`` ways, and which
optimizer trains it.

The Hugging Face model is the source of truth for the weights: a worker builds it
exactly as the torch backend does (so both backends start from the same weights for
the same seed), reads its :class:`~dynarl.workers.megatron.model.Architecture`, and
takes its own shard with :func:`~dynarl.workers.megatron.convert.to_megatron`. The
spec is picklable: it travels to the trainer workers once, at start.
"""

from dataclasses import dataclass

import torch

from dynarl.workers.config import ModelConfig
from dynarl.workers.megatron.model import Architecture


@dataclass(frozen=True)
class ModelSpec:
    """The model of every rank, and how it is split.

    Attributes:
        model: the policy.
        tp, pp: tensor- and pipeline-parallel size of one replica.
        seed: seeds a random-init model (unused with ``model.path``).
        distributed_optimizer: train with Megatron's distributed optimizer (AdamW's
            state sharded over the data-parallel group) instead of torch's AdamW.
        buddy_copies: with the distributed optimizer, keep each rank's slice on the
            next data-parallel rank too (:mod:`~dynarl.workers.megatron.buddy`), so
            the trainer survives a lost rank.
    """

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    seed: int = 0
    distributed_optimizer: bool = False
    buddy_copies: bool = True

    def hf_model(self, *, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The ``transformers`` model: the checkpoint at ``model.path``, or the
        random-init model of ``seed`` (the torch backend's, tensor for tensor)."""
        from dynarl.workers.torch.model import build_model

        module: torch.nn.Module = build_model(self.model, seed=self.seed, device=device)
        return module

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The HF model's parameters by name."""
        return {name: p.detach() for name, p in self.hf_model().named_parameters()}

    def architecture(self) -> Architecture:
        """The shape of the model (from the HF config, without building weights)."""
        from dynarl.workers.tokenizer import load_tokenizer
        from dynarl.workers.torch.model import model_config

        if self.model.path is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.model.path)
        else:
            # build_model's default vocabulary (the torch trainer's)
            config = model_config(self.model, load_tokenizer(self.model))
        arch = Architecture.from_hf_config(config)
        arch.check_parallel(self.tp, self.pp)
        return arch
