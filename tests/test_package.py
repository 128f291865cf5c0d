"""The package stays light, its layers import one way, and its recipes load."""

import ast
import subprocess
import sys
from pathlib import Path

import recipes

from dynarl.api.config import DynaRLConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "dynarl"


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


def test_the_run_config_loads_neither_the_simulator_nor_numpy() -> None:
    """Every worker process imports the config tree: it must not drag in the
    simulator (or numpy, or a backend)."""
    code = (
        "import sys, dynarl.api.config;"
        "loaded = sorted(m for m in sys.modules if m.startswith('dynarl.sim')"
        " or m.split('.')[0] in ('numpy', 'torch', 'zmq'));"
        "print(loaded); sys.exit(bool(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_only_the_backend_table_imports_the_torch_backend() -> None:
    """Nothing outside ``workers/torch/`` imports it: the run reaches backends through
    their role protocols and the table (which imports by name, at run time)."""
    offenders = {
        str(path.relative_to(SRC)): hits
        for path in SRC.rglob("*.py")
        if SRC / "workers" / "torch" not in path.parents
        # the Megatron backend is built on the torch backend's trainer pool, worker
        # loop, buckets, state transfer and weight sync (reused, not copied)
        and SRC / "workers" / "megatron" not in path.parents
        and "fake_sglang" not in path.parts  # a fake backed by the torch engine
        # a random-init policy written as a checkpoint for a launched SGLang server
        and path != SRC / "workers" / "sglang" / "checkpoint.py"
        and (hits := [n for n in _imports(path) if n.startswith("dynarl.workers.torch")])
    }
    assert offenders == {}


def test_no_module_below_the_facade_imports_it() -> None:
    """The run's components get their own sections; only the application's edges (the
    facade, the CLI, the simulator and the test fakes that drive whole runs) import
    ``dynarl.api``."""
    allowed = {
        "api",
        "sim",
        "testing",
        "cli.py",
        "cli_display.py",
        "cli_profile.py",
        "cli_run.py",
        "cli_sim.py",
        "cli_sources.py",
        "config_doc.py",
        "__init__.py",
    }
    offenders = {
        str(path.relative_to(SRC)): hits
        for path in SRC.rglob("*.py")
        if path.relative_to(SRC).parts[0] not in allowed
        and (hits := [n for n in _imports(path) if n.startswith("dynarl.api")])
    }
    assert offenders == {}


def test_nothing_the_run_is_made_of_imports_the_simulator() -> None:
    """The simulator stands in for the hardware: it drives the control plane and reads
    what real runs record, never the other way round (a trace's records live in
    ``obs/``)."""
    parts = ("control", "data", "workers", "rl", "envs", "launch", "obs", "core")
    offenders = {
        str(path.relative_to(SRC)): hits
        for path in SRC.rglob("*.py")
        if path.relative_to(SRC).parts[0] in parts
        and (hits := [n for n in _imports(path) if n.startswith("dynarl.sim")])
    }
    assert offenders == {}
