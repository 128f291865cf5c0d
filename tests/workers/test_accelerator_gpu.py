"""``cluster.accelerator=cuda`` on a GPU (machines with CUDA only):
``bench/gpu/accelerator_run.py`` runs two-iteration ``dynarl run``s whose workers must
show up on the GPU, with the torch backends and with the Megatron trainer and
inference worker."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu" / "accelerator_run.py"


def check(name: str) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", name],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(620)
def test_a_run_on_cuda_trains_with_its_workers_on_the_gpu() -> None:
    check("torch")


@pytest.mark.timeout(620)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_a_megatron_run_on_cuda_trains_with_its_workers_on_the_gpu() -> None:
    check("megatron")
