"""The policy a launched SGLang server loads when the run's model is a random-init
architecture (``model.path`` unset): written once as a Hugging Face checkpoint (config,
weights from the run's seed, and the tokenizer built in code) to a directory of its
own, which the server gets as ``--model-path`` and which is removed when the engine
closes. A server so started holds exactly the weights a torch rollout engine of the
same run would start with."""

import logging
import shutil
import tempfile

from dynarl.workers.config import ModelConfig

logger = logging.getLogger(__name__)


class PolicyCheckpoint:
    """A random-init policy written for a launched server; :meth:`remove` it after."""

    def __init__(self, model: ModelConfig, *, seed: int) -> None:
        from dynarl.workers.tokenizer import load_tokenizer
        from dynarl.workers.torch.model import build_model, save_pretrained

        self.path = tempfile.mkdtemp(prefix="dynarl-sglang-policy-")
        save_pretrained(build_model(model, seed=seed), load_tokenizer(model), self.path)
        logger.info("wrote the random-init policy (seed %d) to %s", seed, self.path)

    def remove(self) -> None:
        """Delete the directory (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
