"""The allocation timeline picture: device x time, coloured by component, one panel
per run (scheduling mode), as a figure that shows itself in a notebook.

Importing this module imports matplotlib (the ``cli`` extra), but never pyplot: it
selects no backend and keeps no global figure state. dynarl imports it lazily, so
``import dynarl`` does not load matplotlib.
"""

import io
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dynarl.obs.timeline import FREE, MIGRATING, Interval, Mark, TimelineLine, ToolLoad

COLOURS = {
    "rollout": "#4c72b0",
    "inference": "#55a868",
    "actor": "#c44e52",
    "reward": "#8172b2",
    "tool": "#937860",
    MIGRATING: "#dd8452",
    FREE: "#e5e5e5",
}
"""Colour of each component (others get grey)."""

DPI = 110
"""Resolution of the PNG pictures, files and notebook output alike."""


class TimelineFigure(Figure):
    """A matplotlib ``Figure`` that IPython shows as a PNG.

    A figure built without pyplot has no backend to show it, so ``display(fig)`` in
    Jupyter would print only ``<Figure ...>`` unless ``%matplotlib inline`` is on; this
    one renders itself (where the inline backend is on, IPython uses its own renderer
    and ignores this). Everything else, ``savefig`` included, is a plain ``Figure``.
    """

    def _repr_png_(self) -> bytes:
        """The figure as PNG bytes, for IPython's rich display."""
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()


def plot_timeline(lines: Sequence[TimelineLine], path: str | Path, *, title: str = "") -> None:
    """Draw ``lines`` (from :func:`~dynarl.obs.timeline.read_timeline`) to ``path``
    (PNG): one panel per run, devices on the y axis, iteration ends as dashed lines."""
    timeline_figure(lines, title=title).savefig(path, dpi=DPI)


def timeline_figure(lines: Sequence[TimelineLine], *, title: str = "") -> Figure:
    """The picture of :func:`plot_timeline` as a matplotlib ``Figure`` (a
    :class:`TimelineFigure`).

    Built without pyplot, so it touches no global figure state or backend: save it
    with ``fig.savefig(...)``, or show it in a notebook with ``display(fig)``, which
    renders it as a PNG without ``%matplotlib inline``.
    """
    runs = list(dict.fromkeys(line.run for line in lines))
    if not runs:
        runs = [""]
    num_devices = 1 + max((iv.device for iv in lines if isinstance(iv, Interval)), default=0)
    end = max((iv.end_s for iv in lines if isinstance(iv, Interval)), default=1.0)
    fig = TimelineFigure(figsize=(12, 1.2 + 0.04 * num_devices * len(runs) + 1.0 * len(runs)))
    axes = fig.subplots(len(runs), 1, squeeze=False, sharex=True)
    seen: dict[str, None] = {}
    for ax, run in zip(axes[:, 0], runs, strict=True):
        by: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for line in lines:
            if isinstance(line, Interval) and line.run == run:
                by.setdefault((line.device, line.component), []).append(
                    (line.start_s, line.end_s - line.start_s)
                )
                seen[line.component] = None
        for (device, component), spans in by.items():
            ax.broken_barh(spans, (device, 1.0), facecolors=COLOURS.get(component, "#999999"))
        for line in lines:
            if isinstance(line, Mark) and line.run == run and line.what == "iteration_end":
                ax.axvline(line.time_s, color="black", linestyle="--", linewidth=0.8)
        loads = [x for x in lines if isinstance(x, ToolLoad) and x.run == run]
        if loads:  # the tool component, off the devices: sessions out on tool calls
            tools = ax.twinx()
            tools.step(
                [0.0, *(x.time_s for x in loads), end],
                [0, *(x.num_in_tool for x in loads), loads[-1].num_in_tool],
                where="post",
                color=COLOURS["tool"],
                linewidth=1.0,
            )
            tools.set_ylim(bottom=0)
            tools.set_ylabel("in tools", fontsize=8)
            seen["tool"] = None
        ax.set_xlim(0, end)
        ax.set_ylim(0, num_devices)
        ax.invert_yaxis()
        ax.set_ylabel("device")
        ax.set_title(run, loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("time (s)")
    handles = [Patch(color=COLOURS.get(c, "#999999"), label=c) for c in seen]
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig
