"""DynaRL in a real Jupyter kernel, driven cell by cell as a notebook user would: the run
opens in one cell and is stepped, drawn and closed in others (ipykernel runs each cell
as its own asyncio task), the figure shows as a PNG without ``%matplotlib inline``, and
closing leaves no worker process."""

import base64
import json
import sys
from pathlib import Path

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KERNEL_NAME = "dynarl-test"
STEP_CELL, FIGURE_CELL = 2, 3

# The cheapest real pipeline (two device slots: actor, rollout), as in test_facade.py.
OVERRIDES = [
    "scheduler.mode=static-disaggregated",
    "run.checkpoint_every=0",
    "cluster.num_devices=2",
    "rollout.initial_devices=1",
    "inference.initial_devices=0",
    "algorithm.old_logprobs=rollout",
    "algorithm.num_prompts=8",
    "run.num_iterations=1",
]


def test_the_timeline_figure_is_a_png_to_ipython_without_the_inline_backend() -> None:
    """IPython's own display formatter (what ``display(fig)`` calls) gets a PNG from the
    figure, with no matplotlib backend chosen; the figure stays a plain ``Figure``."""
    pytest.importorskip("IPython")
    pytest.importorskip("matplotlib")
    from IPython.core.formatters import DisplayFormatter
    from matplotlib.figure import Figure

    from dynarl.obs.plot import timeline_figure
    from dynarl.obs.timeline import Interval

    fig = timeline_figure(
        [Interval(run="dynamic", device=0, component="rollout", start_s=0.0, end_s=2.0)],
        title="one interval",
    )
    assert isinstance(fig, Figure)
    data, _ = DisplayFormatter().format(fig)
    assert data["image/png"].startswith(PNG_MAGIC)


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec running this interpreter, with every Jupyter and IPython directory
    in ``tmp_path`` so that nothing is written to the home folder."""
    from ipykernel.kernelspec import write_kernel_spec

    jupyter = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(jupyter / "data"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(jupyter / "runtime"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(jupyter / "config"))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter / "path"))
    monkeypatch.setenv("IPYTHONDIR", str(jupyter / "ipython"))
    # The kernel chooses its own matplotlib backend (inline), as in a user's Jupyter.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    spec = write_kernel_spec(jupyter / "path" / "kernels" / KERNEL_NAME)
    argv = json.loads((Path(spec) / "kernel.json").read_text())["argv"]
    assert argv[0] == sys.executable
    return KERNEL_NAME


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_opened_stepped_drawn_and_closed_across_cells(
    tmp_path: Path, kernel_name: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("nbclient")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    overrides = [*OVERRIDES, f"run.run_dir={tmp_path / 'run'}"]
    sources = [
        "import contextlib, json, multiprocessing, os\n"
        "from dynarl import DynaRL\n"
        "from dynarl.api.config import DynaRLConfig\n"
        "from dynarl.api.config_io import apply_overrides\n"
        f"cfg = apply_overrides(DynaRLConfig(), {overrides!r})",
        "stack = contextlib.AsyncExitStack()\nrl = await stack.enter_async_context(DynaRL(cfg))",
        "stats = await rl.step()\n"
        "workers = [p.pid for p in multiprocessing.active_children()]\n"
        "print(json.dumps({'iteration': stats.iteration, 'workers': workers}))",
        "fig = rl.timeline_figure()\nfrom IPython.display import display\ndisplay(fig)",
        "await stack.aclose()",
        "def alive(pid):\n"
        "    try:\n"
        "        os.kill(pid, 0)\n"
        "    except ProcessLookupError:\n"
        "        return False\n"
        "    return True\n"
        "left = [p.pid for p in multiprocessing.active_children()]\n"
        "print(json.dumps({'children': left, 'alive': [p for p in workers if alive(p)]}))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=200,
        startup_timeout=60,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    failure, failed_at = None, len(nb.cells)
    try:
        client.execute()
    except CellExecutionError as exc:
        failure = exc
        failed_at = max(i for i, cell in enumerate(nb.cells) if cell.get("execution_count"))
    message = f"notebook cell {failed_at + 1} of {len(nb.cells)} failed:\n{failure}"
    if failed_at <= FIGURE_CELL:
        pytest.fail(message, pytrace=False)

    stepped = json.loads(_stdout(nb.cells[STEP_CELL].outputs))
    assert stepped["iteration"] == 0
    assert stepped["workers"], "the run's workers are child processes of the kernel"
    figure = nb.cells[FIGURE_CELL].outputs
    pngs = [o["data"]["image/png"] for o in figure if "image/png" in o.get("data", {})]
    assert len(pngs) == 1, figure
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)
    if failure is not None:
        pytest.fail(message, pytrace=False)
    assert json.loads(_stdout(nb.cells[-1].outputs)) == {"children": [], "alive": []}


def _stdout(outputs: list[dict[str, object]]) -> str:
    return "".join(str(o["text"]) for o in outputs if o.get("name") == "stdout")
