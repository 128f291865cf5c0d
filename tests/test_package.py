"""The package stays light and its recipes load."""

import subprocess
import sys

import recipes

from dynarl.api.config import DynaRLConfig


def test_import_dynarl_imports_no_heavy_backend() -> None:
    code = (
        "import sys, dynarl, dynarl.control.controller, dynarl.control.modes, dynarl.api.config_io;"
        "heavy = [m for m in ('torch', 'transformers', 'sglang', 'megatron', 'ray')"
        " if m in sys.modules]; print(heavy); sys.exit(bool(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_recipes_are_functions_returning_configs() -> None:
    assert isinstance(recipes.default(), DynaRLConfig)
    assert recipes.math_tiny() == recipes.default()
