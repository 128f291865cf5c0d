"""Accelerator profiles as data: the few numbers the cost models read."""

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from dynarl.sim.errors import SimError


class GpuProfile(msgspec.Struct, frozen=True, kw_only=True):
    """One accelerator's published peak figures.

    Attributes:
        name: table key, e.g. ``"H100"``.
        hbm_bytes_per_s: HBM bandwidth.
        bf16_flops_per_s: dense bf16 peak (no sparsity).
        memory_bytes: HBM capacity.
        nvlink_bytes_per_s: NVLink bandwidth per direction per device.
        nic_bytes_per_s: inter-node bandwidth per device (one NIC per device).
    """

    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    memory_bytes: int
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float


H100 = GpuProfile(
    name="H100",
    hbm_bytes_per_s=3.35e12,
    bf16_flops_per_s=989e12,
    memory_bytes=80 * 10**9,
    nvlink_bytes_per_s=450e9,
    nic_bytes_per_s=50e9,  # 400 Gb/s RoCE per GPU
)
"""NVIDIA H100 SXM 80 GB (the reference experiments' device)."""

H200 = GpuProfile(
    name="H200",
    hbm_bytes_per_s=4.8e12,
    bf16_flops_per_s=989e12,
    memory_bytes=141 * 10**9,
    nvlink_bytes_per_s=450e9,
    nic_bytes_per_s=50e9,
)
"""NVIDIA H200 SXM 141 GB."""

A100 = GpuProfile(
    name="A100",
    hbm_bytes_per_s=2.039e12,
    bf16_flops_per_s=312e12,
    memory_bytes=80 * 10**9,
    nvlink_bytes_per_s=300e9,
    nic_bytes_per_s=25e9,  # 200 Gb/s HDR per GPU
)
"""NVIDIA A100 SXM 80 GB."""

GPUS: Mapping[str, GpuProfile] = MappingProxyType({p.name: p for p in (H100, H200, A100)})
"""Every built-in profile by name."""


def gpu(name: str) -> GpuProfile:
    """The built-in profile called ``name`` (case-insensitive).

    Raises:
        SimError: no such profile; the message lists the known ones.
    """
    for key, profile in GPUS.items():
        if key.lower() == name.lower():
            return profile
    raise SimError(
        f"unknown GPU {name!r}; known: {', '.join(GPUS)}, cpu-1t (the reference CPU "
        "workers), or the path of a profile file `dynarl profile` wrote (or build a "
        "GpuProfile)"
    )
