"""Loading weights into a live model in process: any subset of its parameters, checked
whole before anything is written, so a bad update leaves the old weights in place.

(The distributed path, a broadcast from the trainer, is
:mod:`dynarl.workers.torch.weight_sync`.)
"""

from collections.abc import Mapping

import torch
from torch import nn

from dynarl.workers.errors import WeightSyncError


@torch.no_grad()
def load_weights(model: nn.Module, named_tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``named_tensors`` into ``model``'s parameters of those names (dtypes are
    converted). Raises :class:`WeightSyncError`, loading nothing, when a name is not a
    parameter or a shape differs."""
    own = dict(model.named_parameters())
    for name, tensor in named_tensors.items():
        parameter = own.get(name)
        if parameter is None:
            raise WeightSyncError(
                f"weight {name!r} is not a parameter of {type(model).__name__}; send the "
                "names of model.named_parameters() (without wrapper prefixes like 'module.')"
            )
        if parameter.shape != tensor.shape:
            raise WeightSyncError(
                f"weight {name!r} has shape {list(tensor.shape)} but the model's parameter "
                f"has {list(parameter.shape)}; the sender must have the receiver's architecture"
            )
    for name, tensor in named_tensors.items():
        own[name].copy_(tensor)
