"""The backend table: which implementation each role's ``backend`` names, imported
only when a run needs it.

``rollout.backend``, ``inference.backend`` and ``actor.backend`` each name a row of
:data:`BACKENDS`. :func:`check` refuses, with a :class:`~dynarl.ConfigError` naming the
field and the fix, a name whose packages are missing here (and the extra that installs
them), a backend not built yet, and section values the backend cannot honour (a
tensor-parallel size the torch engine does not shard): a name is never replaced by
another backend. :func:`load` imports the implementation (the only place outside a
backend's package that does).
"""

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from dynarl.core.errors import ConfigError
from dynarl.workers.backend_protocols import (
    InferenceBackend,
    ReferenceProfiler,
    RolloutBackend,
    TrainerBackend,
)
from dynarl.workers.config import ActorConfig, InferenceConfig, RolloutConfig
from dynarl.workers.sglang import config as sglang_config

Role = Literal["rollout", "inference", "actor"]
"""The roles a backend implements."""


@dataclass(frozen=True)
class Backend:
    """One row of the table.

    Attributes:
        requires: top-level modules that must be importable for it to run here.
        extra: the ``dynarl`` extra that installs them.
        built: whether this version of dynarl ships it.
        max_tp, max_pp: the largest tensor- and pipeline-parallel sizes it shards.
        note: what to use instead, or where it stands, for the error message.
        check_section: refuses section values it cannot honour here (raises
            :class:`~dynarl.ConfigError`), beyond the parallel sizes.
        import_warnings: how the warnings its modules give when they load begin,
            where they concern no user (silenced where those modules are preloaded).
    """

    requires: tuple[str, ...]
    extra: str
    built: bool
    max_tp: int | None = None
    max_pp: int | None = 1
    note: str = ""
    check_section: Callable[[Any], None] | None = None
    import_warnings: tuple[str, ...] = ()


_TORCH = Backend(requires=("torch", "transformers"), extra="torch", built=True, max_tp=1)


# megatron-core says so once per module when it loads; its local layers are used here
_NO_FUSED_KERNELS = ("Transformer Engine and Apex are not installed",)
_MEGATRON_INFERENCE = Backend(
    requires=("torch", "transformers", "megatron.core"),
    extra="megatron",
    built=True,
    max_tp=1,
    note="one inference replica per process; set inference.tp=1",
    import_warnings=_NO_FUSED_KERNELS,
)
_MEGATRON_ACTOR = Backend(
    requires=("torch", "transformers", "megatron.core"),
    extra="megatron",
    built=True,
    max_tp=None,
    max_pp=None,
    import_warnings=_NO_FUSED_KERNELS,
)


BACKENDS: Mapping[Role, Mapping[str, Backend]] = {
    "rollout": {
        "torch": _TORCH,
        "sglang": Backend(
            requires=("httpx", "prometheus_client"),
            extra="sglang",
            built=True,
            max_pp=None,
            check_section=lambda section: sglang_config.check_launch(
                section.sglang, installed=_installed("sglang"), tail_tp=section.tail_tp
            ),
        ),
    },
    "inference": {
        "torch": _TORCH,
        "megatron": _MEGATRON_INFERENCE,
    },
    "actor": {
        "torch": _TORCH,
        "megatron": _MEGATRON_ACTOR,
    },
}
"""Every backend, by role and name."""


def reference_profiler() -> ReferenceProfiler:
    """The torch backend's profiler (imported now: it loads torch)."""
    module: ReferenceProfiler = importlib.import_module("dynarl.workers.torch.profiling")
    return module


def _torch() -> object:
    return importlib.import_module("dynarl.workers.torch.backend").BACKEND


def _sglang() -> object:
    return importlib.import_module("dynarl.workers.sglang.backend").BACKEND


def _megatron() -> object:
    return importlib.import_module("dynarl.workers.megatron.backend").BACKEND


_LOADERS: Mapping[str, Callable[[], object]] = {
    "torch": _torch,
    "sglang": _sglang,
    "megatron": _megatron,
}
"""How each built backend is imported (only when a run needs it)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_name(field: str, name: str, rows: Mapping[str, Backend]) -> Backend:
    """The row of ``rows`` that ``name`` (the value of config ``field``) names, once its
    packages are installed here and it is built.

    Raises:
        ConfigError: the name is unknown, its packages are missing (the message names
            the extra), or it is not built yet.
    """
    backend = rows.get(name)
    if backend is None:
        raise ConfigError(
            f"{field}={name!r} names no backend; known: {', '.join(sorted(rows))}", field=field
        )
    missing = [m for m in backend.requires if not _installed(m)]
    if missing:
        also = f"; {backend.note}" if not backend.built else ""
        raise ConfigError(
            f"{field}={name!r} needs {', '.join(missing)}, which is not installed here: "
            f"pip install 'dynarl[{backend.extra}]'{also}",
            field=field,
        )
    if not backend.built:
        raise ConfigError(f"{field}={name!r}: {backend.note}", field=field)
    return backend


def check(role: Role, section: RolloutConfig | InferenceConfig | ActorConfig) -> Backend:
    """The row ``section.backend`` names for ``role``, once it is known to run here
    with ``section``'s values.

    Raises:
        ConfigError: the name is unknown, its packages are missing (the message names
            the extra), the backend is not built yet, or it cannot honour a value.
    """
    field = f"{role}.backend"
    name = section.backend
    backend = check_name(field, name, BACKENDS[role])
    tp, pp = section.tp, getattr(section, "pp", 1)
    tail = getattr(section, "tail_tp", 0)
    if tail and backend.max_tp is not None and tail > backend.max_tp:
        raise ConfigError(
            f"{role}.tail_tp={tail}: the {name} backend runs each engine on "
            f"{backend.max_tp} device(s), so it cannot regroup them for the tail; unset "
            f"{role}.tail_tp, or set {role}.backend=sglang",
            field=f"{role}.tail_tp",
        )
    if backend.max_tp is not None and tp > backend.max_tp:
        raise ConfigError(
            f"{role}.tp={tp}: the {name} backend does not shard one {role} instance over "
            f"devices (it runs each on {backend.max_tp}); set {role}.tp=1"
            + (" or actor.backend=megatron" if role == "actor" else ""),
            field=f"{role}.tp",
        )
    if backend.max_pp is not None and pp > backend.max_pp:
        raise ConfigError(
            f"{role}.pp={pp}: the {name} backend has no pipeline parallelism; set {role}.pp=1",
            field=f"{role}.pp",
        )
    if backend.check_section is not None:
        backend.check_section(section)
    return backend


def _load(role: Role, section: RolloutConfig | InferenceConfig | ActorConfig) -> object:
    check(role, section)
    return _LOADERS[section.backend]()


def rollout_backend(section: RolloutConfig) -> RolloutBackend:
    """The rollout backend ``section.backend`` names (checked, then imported)."""
    return cast(RolloutBackend, _load("rollout", section))


def inference_backend(section: InferenceConfig) -> InferenceBackend:
    """The inference backend ``section.backend`` names (checked, then imported)."""
    return cast(InferenceBackend, _load("inference", section))


def trainer_backend(section: ActorConfig) -> TrainerBackend:
    """The trainer backend ``section.backend`` names (checked, then imported)."""
    return cast(TrainerBackend, _load("actor", section))


def preload_modules(*sections: RolloutConfig | InferenceConfig | ActorConfig) -> tuple[str, ...]:
    """The modules the backends of ``sections`` import, to load ahead of their first use."""
    names: dict[str, None] = {}
    for backend in _backends_of(sections):
        names.update(dict.fromkeys(backend.requires))
    return tuple(names)


def import_warnings(*sections: RolloutConfig | InferenceConfig | ActorConfig) -> tuple[str, ...]:
    """How the warnings begin that the :func:`preload_modules` of ``sections`` give when
    they load and that concern no user (a process preloading them silences these)."""
    starts: dict[str, None] = {}
    for backend in _backends_of(sections):
        starts.update(dict.fromkeys(backend.import_warnings))
    return tuple(starts)


def _backends_of(
    sections: Sequence[RolloutConfig | InferenceConfig | ActorConfig],
) -> list[Backend]:
    roles: dict[type, Role] = {
        RolloutConfig: "rollout",
        InferenceConfig: "inference",
        ActorConfig: "actor",
    }
    return [BACKENDS[roles[type(section)]][section.backend] for section in sections]
