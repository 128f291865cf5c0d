"""The adapter against a real SGLang server (GPU machines with sglang 0.5.x only):
``bench/gpu/sglang_check.py`` launches one, generates, aborts and resumes, and syncs
weights. Give the model with ``DYNARL_SGLANG_MODEL``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_real_sglang_server_generates_aborts_resumes_and_takes_weights() -> None:
    pytest.importorskip("sglang")
    model = os.environ.get("DYNARL_SGLANG_MODEL")
    if not model:
        pytest.skip("set DYNARL_SGLANG_MODEL to a local model directory")
    script = Path(__file__).parents[3] / "bench" / "gpu" / "sglang_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--model-path", model],
        check=False,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
