"""The Megatron backend on a GPU (machines with CUDA only): ``bench/gpu/megatron_check.py``
checks the logits on ``cuda``, trains over NCCL (with a DP resize and a TP reshard on
two GPUs), and does the same with Megatron's distributed optimizer against AdamW."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_megatron_backend_trains_and_resizes_on_nccl() -> None:
    script = Path(__file__).parents[3] / "bench" / "gpu" / "megatron_check.py"
    out = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
