"""The pipeline driver: a real run's GRPO iterations, each as small stage tasks joined
by memory object streams (:class:`~dynarl.rl.iteration.Iteration`).

::

    prompts ─▶ router ─▶ rollout engines ─▶ results ─┬─▶ reward ─────────────┐
                                                      └─▶ router ─▶ inference ┴─▶ samples
    samples ─▶ groups ─▶ actor steps (when the trainer may step) ─▶ weight sync

Every item goes through the data router: rollout requests to the rollout engines,
finished responses to the inference instances for their behaviour (and reference)
log-probs, and each optimizer step's samples to the trainer's ranks (each to the rank
whose data-parallel shard holds it, :mod:`dynarl.workers.trainer_items`). A response
is rewarded by the verifier while it is scored; once every sample of a group is
rewarded and scored the group is ready, and the actor takes its ``n_minibatches``
optimizer steps (:class:`~dynarl.rl.actor_steps.ActorSteps`). Then the engines get the
new weights.

With an environment (a multi-turn task), each sample is an episode played by the
:class:`~dynarl.rl.episode_runner.EpisodeRunner`: its turns go back and forth between
the engines and the environment (the run's tool component) as router sessions, and
its reward is the environment's; the rest of the pipeline is the same. The runner
outlives an iteration (with partial rollouts an episode can too: it is carried over
mid-session, its environment alive), so the driver closes it: :meth:`Pipeline.aclose`.

With partial rollouts (``algorithm.over_sample_prompts``) an iteration rolls out more
groups than it trains, the groups carried over from the last iteration first; once the
groups it trains are whole it withdraws every request still out, and what it did not
train carries over (:mod:`dynarl.rl.carry` holds the rules and the carried state).

The driver reports the iteration's boundaries and the actor's steps through the
:class:`~dynarl.rl.reporter.EventReporter`, which also carries the router's events.
It holds what outlives an iteration: its collaborators, and what partial rollouts
carry from one iteration to the next.
"""

from collections.abc import Callable
from typing import Any

from anyio.abc import TaskGroup

from dynarl.data.router import Router
from dynarl.envs.config import EnvConfig
from dynarl.envs.environment import EnvironmentSpec
from dynarl.envs.prompts import PromptSampler
from dynarl.envs.verifier import AsyncVerifier
from dynarl.obs.metrics import IterationStats
from dynarl.rl.carry import CarryState
from dynarl.rl.config import AlgorithmConfig
from dynarl.rl.episode import Episode
from dynarl.rl.episode_runner import EpisodeRunner
from dynarl.rl.gate import StepGate
from dynarl.rl.iteration import Iteration
from dynarl.rl.progress import Progress, Weights
from dynarl.rl.reporter import EventReporter
from dynarl.rl.trace import RunTrace
from dynarl.workers.config import RolloutConfig
from dynarl.workers.trainer import Trainer


class Pipeline:
    """Runs a real run's iterations through the data router and the trainer.

    Args:
        algorithm: batch shape, minibatches and their order.
        rollout: sampling parameters of the requests.
        seed: the run's seed (prompt order, request seeds, minibatch splits).
        router: the data router (bound and running; its ``on_event`` is ``reporter``).
        trainer: the actor.
        weights: the weight-sync group.
        gate: says when the actor may step.
        reporter: where the driver's events go.
        sampler: where prompts come from.
        verifier: the reward rule, run off the event loop.
        tokenizer: encodes prompts and decodes responses (the model's).
        uses_inference: old log-probs come from inference instances (else from the
            engines' own, which equal them).
        on_progress: sees the iteration's progress as it happens.
        environment: a multi-turn environment whose episodes are the samples (else
            single-turn responses scored by ``verifier``).
        env: the episodes' limits (with ``environment``).
        max_seq_len: the model's longest context (with ``environment``).
        trace: where each finished iteration's samples are recorded (the run
            directory's ``trace.jsonl``); ``None``: not recorded.
        carried: what the iteration before the first carried over (partial rollouts:
            a resumed run's, from its checkpoint); default nothing.
        tasks: the run's task group (with ``environment``): the environments' steps
            run in it, so that a withdrawn episode's step still running when an
            iteration's training is over goes on beside its weight sync.
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        seed: int,
        router: Router,
        trainer: Trainer,
        weights: Weights,
        gate: StepGate,
        reporter: EventReporter,
        sampler: PromptSampler,
        verifier: AsyncVerifier,
        tokenizer: Any,
        uses_inference: bool,
        on_progress: Callable[[Progress], None] | None = None,
        environment: EnvironmentSpec | None = None,
        env: EnvConfig | None = None,
        max_seq_len: int = 0,
        trace: RunTrace | None = None,
        carried: CarryState | None = None,
        tasks: TaskGroup | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.rollout = rollout
        self.seed = seed
        self.router = router
        self.trainer = trainer
        self.weights = weights
        self.gate = gate
        self.reporter = reporter
        self.sampler = sampler
        self.verifier = verifier
        self.tokenizer: Any = tokenizer  # transformers' (kept untyped: no torch here)
        self.uses_inference = uses_inference
        self.on_progress = on_progress or (lambda p: None)
        self.environment = environment
        self.env = env or EnvConfig()
        self.max_seq_len = max_seq_len
        self.trace = trace
        self.tasks = tasks
        """Where the environments' steps run (else in each iteration's own tasks, which
        then wait for them)."""
        self.carried = carried or CarryState()
        """What the last finished iteration carried over to the next (partial rollouts;
        a checkpoint saves it)."""
        self.trained: list[Episode] = []
        """The samples the last finished iteration trained, in request order."""
        self.runner = (
            None
            if environment is None
            else EpisodeRunner(
                spec=environment,
                limits=self.env,
                max_seq_len=max_seq_len,
                tokenizer=tokenizer,
                router=router,
            )
        )
        """Plays the episodes (with ``environment``)."""

    async def run(self, iteration: int) -> IterationStats:
        """Run iteration ``iteration`` and return what it measured (first waiting for
        the environment steps the last one left running: the episodes they ended carry
        over finished)."""
        if self.runner is not None:
            self.carried = self.carried.ended(await self.runner.settle())
        run = Iteration(self, iteration)
        stats = await run.run()
        self.carried, self.trained = run.carried_out, run.trained
        return stats

    async def aclose(self) -> None:
        """Close the environments of episodes still playing (those carried over to an
        iteration that will not run)."""
        if self.runner is not None:
            await self.runner.aclose()
