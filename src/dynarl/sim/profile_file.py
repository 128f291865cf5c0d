"""A measured device profile as a file: what ``dynarl profile`` writes and
``dynarl sim --profile FILE`` (``sim.gpu=FILE``) reads.

The file is one JSON object, :class:`ProfileFile`: a format version, the measured
costs (a :class:`~dynarl.sim.cpu_profile.CpuProfile`: decode step against batch and
context held, prefill, log-prob inference, the optimizer step, transfer bandwidth, the
migration setup times, from version 2 how the host's slots slow each other down, and
from version 3 the reference engine's serving and cache-rebuild costs, from version 4
the controller process's CPU per response and per generated token and the host's
cores), the model
section the costs were measured with, and where they were measured. A simulation
applies it only to the model it was measured on.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from dynarl.sim.controller_cpu import ControllerCost
from dynarl.sim.cpu_device import CPU_1T, CpuProfile
from dynarl.sim.errors import SimError
from dynarl.workers.config import ModelConfig

PROFILE_VERSION = 4
"""Format version written in every profile file. Version 2 added the host-sharing
curve (``device.host_slowdown``), version 3 the reference engine's cost per step of its
worker loop and of rebuilding its padded cache (``device.step_dispatch_s``,
``join_per_held_token_s``, ``leave_per_held_token_s``), version 4 the controller
process as a tenant of the host (``device.controller_cpu_per_request_s``,
``controller_cpu_per_token_s``) and the host's cores (``device.host_cores``); an older
file reads as one without them (the simulated slots are independent, the costs not
charged, the controller not counted), while a dynarl that reads only older versions
refuses a newer file rather than ignore them."""

READABLE_VERSIONS = (1, 2, 3, 4)
"""Format versions :func:`read_profile` reads."""


_FIELD_VERSIONS = {
    "host_slowdown": 2,
    "step_dispatch_s": 3,
    "join_per_held_token_s": 3,
    "leave_per_held_token_s": 3,
    "controller_cpu_per_request_s": 4,
    "controller_cpu_per_token_s": 4,
    "host_cores": 4,
}
"""The format version that introduced each later ``device`` field."""


class ProfileFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A profile file's contents.

    Attributes:
        profile_version: the format version (:data:`PROFILE_VERSION`).
        device: the measured costs of one device slot.
        model: the model section the costs were measured with.
        measured: which of ``device``'s fields were measured on this machine (the rest
            are the built-in CPU profile's, e.g. migration setup times, which only a
            whole run measures).
        host: where they were measured (platform, cores, torch version, threads).
    """

    profile_version: int
    device: CpuProfile
    model: ModelConfig
    measured: tuple[str, ...] = ()
    host: str = ""


def write_profile(path: str | Path, profile: ProfileFile) -> None:
    """Write ``profile`` to ``path`` as indented JSON (overwriting it)."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")


def read_profile(path: str | Path) -> ProfileFile:
    """Read a profile file written by :func:`write_profile` (``dynarl profile``).

    Raises:
        SimError: the file is missing, not JSON, of another format version, or a field
            is missing or malformed; the message names the file, the field and the fix.
    """
    path = Path(path)
    fix = f"write one with `dynarl profile --out {path}`"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SimError(f"profile file {path}: cannot read it ({exc.strerror}); {fix}") from None
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise SimError(f"profile file {path} is not JSON ({exc}); {fix}") from None
    version = data.get("profile_version") if isinstance(data, dict) else None
    if version not in READABLE_VERSIONS:
        raise SimError(
            f"profile file {path}: profile_version={version!r}, this dynarl reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; {fix}"
        )
    device = data.get("device")
    for field, since in _FIELD_VERSIONS.items():
        if version < since and isinstance(device, dict) and field in device:
            raise SimError(
                f"profile file {path}: device.{field} is a version {since} field; set "
                f"profile_version to {since}, or {fix}"
            )
    try:
        return msgspec.convert(data, ProfileFile)
    except msgspec.ValidationError as exc:
        raise SimError(f"profile file {path}: {exc}; {fix}") from None


def is_profile_path(name: str) -> bool:
    """Whether ``sim.gpu=name`` names a profile file rather than a built-in profile."""
    return name.lower().endswith(".json") or "/" in name


MEASURED = (
    "threads",
    "decode_step_s",
    "decode_per_request_s",
    "decode_per_context_token_s",
    "prefill_overhead_s",
    "prefill_per_token_s",
    "step_dispatch_s",
    "join_per_held_token_s",
    "leave_per_held_token_s",
    "inference_overhead_s",
    "inference_per_token_s",
    "train_overhead_s",
    "train_per_token_s",
    "train_per_token_context_s",
    "transfer_bytes_per_s",
)
"""The :class:`~dynarl.sim.cpu_profile.CpuProfile` fields a profiling run measures;
the others (migration setup times, data-parallel efficiency) are the built-in CPU
profile's."""


def profile_from(
    measured: Mapping[str, float], *, name: str = "cpu-measured", threads: int = 1
) -> CpuProfile:
    """A :class:`CpuProfile` with the measured costs (fitted terms clipped at zero) and
    :data:`~dynarl.sim.cpu_profile.CPU_1T`'s migration and sync setup times."""
    m = {k: max(0.0, v) for k, v in measured.items()}
    return msgspec.structs.replace(
        CPU_1T,
        name=name,
        threads=threads,
        decode_step_s=m["decode_a_s"],
        decode_per_request_s=m["decode_per_request_s"],
        decode_per_context_token_s=m["decode_per_context_s"],
        prefill_overhead_s=m["prefill_overhead_s"],
        prefill_per_token_s=m["prefill_per_token_s"],
        step_dispatch_s=m.get("step_dispatch_s", 0.0),
        join_per_held_token_s=m.get("join_per_held_token_s", 0.0),
        leave_per_held_token_s=m.get("leave_per_held_token_s", 0.0),
        inference_overhead_s=m["inference_overhead_s"],
        inference_per_token_s=m["inference_per_token_s"],
        # raw figures of older benches fitted a cost per micro-batch too
        train_overhead_s=m["train_overhead_s"] + m.get("train_per_micro_batch_s", 0.0),
        train_per_token_s=m["train_per_token_s"],
        train_per_token_context_s=m.get("train_per_token_context_s", 0.0),
        transfer_bytes_per_s=m.get("transfer_bytes_per_s") or None,
    )


def measured_profile(
    costs: Mapping[str, float],
    *,
    model: ModelConfig,
    threads: int,
    host: str,
    name: str,
    host_slowdown: Sequence[float] | None = None,
    host_cores: int = 0,
    controller: ControllerCost | None = None,
) -> ProfileFile:
    """The profile file of a profiling run's ``costs`` (and, measured with two or more
    slots, its host-sharing curve; the cores of the host, if given; and the controller
    process's CPU fitted from a real run, if given) on ``model``."""
    device = profile_from(costs, name=name, threads=threads)
    fields: tuple[str, ...] = MEASURED
    if host_slowdown is not None:
        device = msgspec.structs.replace(device, host_slowdown=tuple(host_slowdown))
        fields = (*fields, "host_slowdown")
    if host_cores:
        device = msgspec.structs.replace(device, host_cores=host_cores)
        fields = (*fields, "host_cores")
    if controller is not None:
        device = msgspec.structs.replace(
            device,
            controller_cpu_per_request_s=controller.per_request_s,
            controller_cpu_per_token_s=controller.per_token_s,
        )
        fields = (*fields, "controller_cpu_per_request_s", "controller_cpu_per_token_s")
    return ProfileFile(
        profile_version=PROFILE_VERSION, device=device, model=model, measured=fields, host=host
    )
