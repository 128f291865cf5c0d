"""Fixtures the reference-engine tests share (none is autouse: a module asks for
``one_thread`` with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel

from dynarl.api.config import ModelConfig
from dynarl.workers.torch.model import build_model


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run like a CPU device slot (one torch thread): tiny kernels on 2 shared cores
    are many times slower with intra-op threads contending."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    """The default tiny model (random init, seed 0)."""
    return build_model(ModelConfig(), seed=0)
