"""The torch reference RL loop in one process: rollout, reward, advantages, GRPO steps, weight
reload, one stage after the other.

It is not the distributed runtime (no scheduling, no devices move): it is the plain
synchronous loop the runtime must agree with, small enough to read in one sitting, and
what tests and benchmarks compare against. Every stage uses the real components: the
continuous-batching :class:`~dynarl.workers.torch.engine.RolloutEngine`, a
:class:`~dynarl.envs.verifier.Verifier`, :func:`~dynarl.rl.batch.with_advantages`,
the :class:`~dynarl.rl.grpo.GrpoLoss` on a single-rank
:class:`~dynarl.workers.torch.trainer.ElasticTrainer`.

The behaviour policy's log-probs are the engine's own (they equal a teacher-forced
forward at temperature 1), so no separate inference pass is needed; with
``algorithm.kl_coef > 0`` a frozen copy of the initial model supplies reference
log-probs.
"""

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dynarl.core.errors import ConfigError
from dynarl.envs.config import DataConfig
from dynarl.envs.prompts import Prompt, PromptSampler, prompt_sampler
from dynarl.envs.synthetic import SyntheticTask
from dynarl.envs.verifier import MatchVerifier, Verifier, score_all
from dynarl.rl.batch import Trajectory, from_completion, split_minibatches, with_advantages
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.grpo import GrpoLoss
from dynarl.rl.requests import group_requests, prompt_ids, response_text
from dynarl.workers.config import ActorConfig, ModelConfig, RolloutConfig
from dynarl.workers.rollout import Completion, GenerateRequest
from dynarl.workers.tokenizer import load_tokenizer
from dynarl.workers.torch.engine import RolloutEngine
from dynarl.workers.torch.logprobs import sequence_logprobs
from dynarl.workers.torch.model import build_model
from dynarl.workers.torch.trainer import ElasticTrainer
from dynarl.workers.torch.trainer_config import TrainerConfig

logger = logging.getLogger(__name__)


class _Run(Protocol):
    @property
    def seed(self) -> int: ...

    @property
    def num_iterations(self) -> int: ...


class LoopConfig(Protocol):
    """The sections the loop reads (a :class:`~dynarl.api.config.DynaRLConfig` has
    them all)."""

    @property
    def model(self) -> ModelConfig: ...

    @property
    def rollout(self) -> RolloutConfig: ...

    @property
    def actor(self) -> ActorConfig: ...

    @property
    def algorithm(self) -> AlgorithmConfig: ...

    @property
    def data(self) -> DataConfig: ...

    @property
    def run(self) -> _Run: ...


class IterationMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What one iteration of the loop measured.

    Attributes:
        iteration: 0-based index.
        mean_reward: mean verifier reward over the iteration's responses.
        solved_fraction: responses with reward 1.
        mean_response_tokens, median_response_tokens, max_response_tokens: response
            lengths in tokens (EOS included).
        truncated_fraction: responses that hit ``max_new_tokens`` without stopping.
        loss, grad_norm: means over the iteration's optimizer steps.
        rollout_s, train_s, elapsed_s: wall time of generation, of the optimizer steps
            and of the whole iteration.
    """

    iteration: int
    mean_reward: float
    solved_fraction: float
    mean_response_tokens: float
    median_response_tokens: float
    max_response_tokens: int
    truncated_fraction: float
    loss: float
    grad_norm: float
    rollout_s: float
    train_s: float
    elapsed_s: float


class InprocessLoop:
    """The loop's state: engine, trainer, prompt order and iteration count.

    Args:
        config: the run's configuration (``model``, ``rollout``, ``actor``,
            ``algorithm``, ``data`` and ``run`` are read).
        sampler: where prompts come from (default: from ``config.data``).
        verifier: the reward rule (default: :class:`MatchVerifier`).
    """

    def __init__(
        self,
        config: LoopConfig,
        *,
        sampler: PromptSampler | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        if config.algorithm.partial_rollouts:
            raise ConfigError(
                "the reference loop is the plain on-policy loop: it does not carry requests "
                "over (partial rollouts run in `dynarl run` and the simulator); set "
                "algorithm.over_sample_prompts=0",
                field="algorithm.over_sample_prompts",
            )
        self.config = config
        seed = config.run.seed
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(config.model)
        self.sampler = sampler or prompt_sampler(
            config.data, seed=seed, generator=SyntheticTask(seed=seed).prompt
        )
        self.verifier: Verifier = verifier or MatchVerifier()
        self.trainer = ElasticTrainer.build(
            functools.partial(build_model, config.model, seed=seed, tokenizer=self.tokenizer),
            loss_fn=GrpoLoss.from_config(config.algorithm),
            config=TrainerConfig.of_actor(config.actor, seed=config.run.seed),
            device=torch.device("cpu"),
            group=None,
        )
        self.engine = RolloutEngine.from_config(config.model, config.rollout, seed=seed)
        self._sync_weights(version=0)
        self.reference: PreTrainedModel | None = None
        if config.algorithm.kl_coef > 0:
            self.reference = build_model(config.model, seed=seed, tokenizer=self.tokenizer)
        self.iteration = 0

    def run_iteration(self) -> IterationMetrics:
        """One iteration: generate, score, train ``n_minibatches`` steps, reload."""
        started = time.perf_counter()
        algo = self.config.algorithm
        prompts = self.sampler.take(algo.num_prompts)
        requests = self._requests(prompts)
        completions = self.engine.generate(requests)
        rollout_s = time.perf_counter() - started

        # Completions arrive in finishing order; put them back in request order.
        by_id = {c.request_id: c for c in completions}
        ordered = [by_id[r.request_id] for r in requests]
        groups = [p for p in range(len(prompts)) for _ in range(algo.group_size)]
        rewards = score_all(
            self.verifier,
            [(prompts[g], self.decode(c)) for g, c in zip(groups, ordered, strict=True)],
        )
        refs = self._reference_logprobs(ordered)
        trajectories = with_advantages(
            [
                from_completion(c, group_id=g, reward=r, ref_logprobs=ref)
                for c, g, r, ref in zip(ordered, groups, rewards, refs, strict=True)
            ]
        )
        train_started = time.perf_counter()
        losses, norms = self._train(trajectories)
        self._sync_weights(version=self.iteration + 1)
        train_s = time.perf_counter() - train_started

        lengths = np.array([len(c.output_ids) for c in ordered])
        metrics = IterationMetrics(
            iteration=self.iteration,
            mean_reward=float(np.mean(rewards)),
            solved_fraction=float(np.mean(np.array(rewards) >= 1.0)),
            mean_response_tokens=float(lengths.mean()),
            median_response_tokens=float(np.median(lengths)),
            max_response_tokens=int(lengths.max()),
            truncated_fraction=float(np.mean([c.finish_reason == "length" for c in ordered])),
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(norms)),
            rollout_s=rollout_s,
            train_s=train_s,
            elapsed_s=time.perf_counter() - started,
        )
        logger.info(
            "iteration %d: reward %.3f, solved %.2f, %.1f tokens/response (max %d), %.2f s",
            metrics.iteration,
            metrics.mean_reward,
            metrics.solved_fraction,
            metrics.mean_response_tokens,
            metrics.max_response_tokens,
            metrics.elapsed_s,
        )
        self.iteration += 1
        return metrics

    def encode(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids (after a BOS token when the tokenizer has one)."""
        return prompt_ids(self.tokenizer, prompt)

    def decode(self, completion: Completion) -> str:
        """The response text the verifier sees: the output without its final EOS."""
        return response_text(self.tokenizer, completion)

    def _requests(self, prompts: Sequence[Prompt]) -> list[GenerateRequest]:
        config = self.config
        return group_requests(
            config.algorithm,
            config.rollout,
            [self.encode(p) for p in prompts],
            seed=config.run.seed,
            iteration=self.iteration,
        )

    def _reference_logprobs(
        self, completions: Sequence[Completion]
    ) -> list[tuple[float, ...] | None]:
        if self.reference is None:
            return [None] * len(completions)
        scores = sequence_logprobs(
            self.reference,
            [c.prompt_ids + c.output_ids for c in completions],
            starts=[len(c.prompt_ids) for c in completions],
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        return [tuple(s.tolist()) for s in scores]

    def _train(self, trajectories: Sequence[Trajectory]) -> tuple[list[float], list[float]]:
        minibatches = split_minibatches(
            trajectories,
            self.config.algorithm.n_minibatches,
            seed=[self.config.run.seed, self.iteration],
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        losses, norms = [], []
        for arrays in minibatches:
            step = self.trainer.train_step({k: torch.from_numpy(v) for k, v in arrays.items()})
            losses.append(step.loss)
            norms.append(step.grad_norm)
        return losses, norms

    def _sync_weights(self, *, version: int) -> None:
        self.engine.load_weights(
            {name: p.detach() for name, p in self.trainer.model.named_parameters()},
            version=version,
        )


def run_inprocess(
    config: LoopConfig,
    *,
    num_iterations: int | None = None,
    sampler: PromptSampler | None = None,
    verifier: Verifier | None = None,
    on_iteration: Callable[[IterationMetrics], None] | None = None,
) -> list[IterationMetrics]:
    """Run the reference loop for ``num_iterations`` (default ``config.run.num_iterations``)
    and return every iteration's metrics; ``on_iteration`` sees each as it finishes."""
    loop = InprocessLoop(config, sampler=sampler, verifier=verifier)
    history = []
    for _ in range(config.run.num_iterations if num_iterations is None else num_iterations):
        metrics = loop.run_iteration()
        history.append(metrics)
        if on_iteration is not None:
            on_iteration(metrics)
    return history
