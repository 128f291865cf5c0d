"""Releasing and re-acquiring a model's parameter memory inside a live process, so a
device can serve another component without restarting the worker (SGLang's
``release_memory_occupation`` / ``resume_memory_occupation`` for the ``weights`` tag)."""

import torch
from torch import nn


class ParameterMemory:
    """Frees a model's parameter storage and allocates it again.

    Only parameters are released; buffers (rotary tables and the like) are small and
    are not restored by loading weights, so they stay. After :meth:`resume` the
    parameters hold their old values if the release kept a host backup, and undefined
    values otherwise, until weights are loaded (:attr:`has_valid_weights` says which).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._shapes: dict[str, torch.Size] = {}
        self._backup: dict[str, torch.Tensor] | None = None
        self._released = False
        self._valid = True

    @property
    def released(self) -> bool:
        """Whether the parameters' storage is released."""
        return self._released

    @property
    def has_valid_weights(self) -> bool:
        """Whether the parameters hold real weights (not released, not garbage)."""
        return self._valid and not self._released

    def mark_loaded(self) -> None:
        """Record that every parameter was just written with real weights."""
        self._valid = True

    @torch.no_grad()
    def release(self, *, host_backup: bool) -> None:
        """Free the parameters' storage, first copying them to host memory if
        ``host_backup`` (on a CPU device that copy costs as much as what is freed)."""
        if self._released:
            return
        self._backup = {} if host_backup else None
        for name, parameter in self._model.named_parameters():
            self._shapes[name] = parameter.shape
            if self._backup is not None:
                self._backup[name] = parameter.data.to("cpu", copy=True)
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        self._released = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @torch.no_grad()
    def resume(self) -> None:
        """Allocate the parameters again, restoring the backup when there is one."""
        if not self._released:
            return
        for name, parameter in self._model.named_parameters():
            empty = torch.empty(self._shapes[name], dtype=parameter.dtype, device=parameter.device)
            if self._backup is not None:
                empty.copy_(self._backup[name])
            parameter.data = empty
        self._valid = self._backup is not None
        self._backup = None
        self._released = False
