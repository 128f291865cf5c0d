"""The small simulated cluster several simulator tests share: 16 devices, the actor on
4 (tensor parallel 2), rollout on 10 one-device engines, inference on 2 (one replica
of tensor parallel 2). Append the workload's overrides."""

SIXTEEN_DEVICES = [
    "cluster.num_devices=16",
    "actor.initial_devices=4",
    "rollout.initial_devices=10",
    "inference.initial_devices=2",
    "actor.tp=2",
    "inference.tp=2",
]
