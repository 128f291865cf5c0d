"""A run's pipeline in plain numbers: what the control plane needs to know of a run's
configuration (instance sizes, initial devices, batch shape). The configuration tree
builds one (:meth:`~dynarl.api.config.DynaRLConfig.pipeline_layout`);
:mod:`dynarl.control.pipeline` turns it into a hypergraph.
"""

import msgspec


class PipelineLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A run's pipeline in numbers.

    Attributes:
        num_devices: devices in the job.
        rollout_tp, inference_tp: devices per rollout engine and inference replica.
        rollout_tail_tp: devices per engine the rollout's tail may regroup into (0:
            none).
        actor_devices_per_replica: devices per data-parallel trainer replica.
        actor_initial_devices, rollout_initial_devices, inference_initial_devices:
            devices each component starts with.
        rollout_max_running: requests an engine decodes at once.
        max_new_tokens: longest response.
        actor_steps_per_iteration: optimizer steps per iteration.
        actor_steps_in_arrival_order: minibatches are whole groups in completion order.
        samples_per_minibatch: sequences per optimizer step.
        allow_uneven_micro_batches: any data-parallel size is valid.
        u_low: KV usage below which an engine counts as under-used.
        uses_inference: whether the pipeline has an inference stage (else the actor
            trains on the engines' own log-probs, and inference holds no devices).
    """

    num_devices: int
    rollout_tp: int
    inference_tp: int
    actor_devices_per_replica: int
    actor_initial_devices: int
    rollout_initial_devices: int
    inference_initial_devices: int
    rollout_max_running: int
    max_new_tokens: int
    actor_steps_per_iteration: int
    actor_steps_in_arrival_order: bool
    samples_per_minibatch: int
    allow_uneven_micro_batches: bool
    u_low: float
    uses_inference: bool = True
    rollout_tail_tp: int = 0
