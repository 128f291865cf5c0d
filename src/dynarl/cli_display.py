"""The progress display of ``dynarl run`` (part of the CLI: it prints).

On a terminal it is a live rich panel: the iteration, the running stage's progress
(rollout responses done/total, optimizer steps), the latest reward and tokens/s, with
partial rollouts what the last iteration carried and how stale its training was, and
the devices each component holds now; every finished iteration also leaves a log line
above it. Otherwise (``--quiet``, or stdout not a terminal) it prints only the log
lines, one per iteration. rich is imported only for the live panel.
"""

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from dynarl.obs.metrics import IterationStats
    from dynarl.rl.progress import Progress

_UNITS = {"rollout": "responses", "train": "optimizer steps", "sync": "weight sync"}


def iteration_line(s: "IterationStats") -> str:
    """One iteration's log line (with partial rollouts, what it carried and how stale
    its training was: see :func:`staleness`)."""
    devices = " ".join(f"{c}={n}" for c, n in s.allocation.items())
    carried = "" if s.partial_rollout is None else f"  {staleness(s)}"
    return (
        f"iter {s.iteration:3d}  reward {s.mean_reward:.3f}  solved {s.solved_fraction:.2f}  "
        f"loss {s.loss:+.4f}  {s.tokens_per_s:7.0f} tok/s  {s.elapsed_s:5.1f} s  "
        f"migrations {len(s.migrations)}{carried}  [{devices}]"
    )


def staleness(s: "IterationStats") -> str:
    """A partial rollout's iteration in words: samples carried in (of which requests
    resumed) and out, the most weight versions a trained sample lags, and the share
    of trained tokens older weights generated; empty without partial rollouts."""
    p = s.partial_rollout
    if p is None:
        return ""
    return (
        f"carried in {p.num_carried_in} (resumed {p.num_resumed}) out {p.num_carried_out}  "
        f"lag {p.max_weight_lag}  stale {p.stale_token_fraction:.0%}"
    )


class RunDisplay:
    """Shows a run's progress; a context manager around the run.

    Args:
        live: draw the live panel (a terminal); else print plain lines.
        num_iterations: the iterations the run goes to (for "iteration i/N").
        console: the ``rich.console.Console`` the live panel draws on (default: stdout).
    """

    def __init__(self, *, live: bool, num_iterations: int, console: Any = None) -> None:
        self.live = live
        self.num_iterations = num_iterations
        self.console = console
        self.allocation: Callable[[], Mapping[str, int]] = dict
        """Devices per component now (``DynaRL.allocation`` once the run exists)."""
        self.status = "starting the worker processes"
        self._progress: Progress | None = None
        self._last: IterationStats | None = None
        self._live: Any = None  # rich.live.Live, while entered

    def __enter__(self) -> Self:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                self._render(),
                console=self.console or Console(),
                refresh_per_second=4,
                transient=True,
            )
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.__exit__(exc_type, exc, traceback)

    def print(self, text: str) -> None:
        """A log line (above the live panel, if any)."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def progress(self, p: "Progress") -> None:
        """The running iteration moved on (``DynaRL``'s ``on_progress``)."""
        self._progress = p
        self._refresh()

    def iteration(self, s: "IterationStats") -> None:
        """An iteration finished."""
        self._last = s
        self._progress = None
        self.status = f"iteration {s.iteration} done"
        self.print(iteration_line(s))
        self._refresh()

    def set_status(self, text: str) -> None:
        """Say what the run does between iterations (starting, saving)."""
        self.status = text
        self._progress = None
        self._refresh()

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Any:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right")
        grid.add_column()
        p = self._progress
        if p is None:
            grid.add_row("status", self.status)
        else:
            grid.add_row("iteration", f"{p.iteration + 1}/{self.num_iterations}")
            bar = Table.grid(padding=(0, 1))
            bar.add_row(
                ProgressBar(total=max(p.total, 1), completed=p.done, width=36),
                f"{p.done}/{p.total} {_UNITS.get(p.stage, '')}",
            )
            grid.add_row(p.stage, bar)
        last = self._last
        if last is not None:
            grid.add_row(
                "reward",
                f"{last.mean_reward:.3f}  (solved {last.solved_fraction:.0%}, "
                f"iteration {last.iteration + 1})",
            )
            grid.add_row("tokens/s", f"{last.tokens_per_s:.0f}  ({last.elapsed_s:.1f} s/iter)")
            if last.partial_rollout is not None:
                grid.add_row("partial", staleness(last))
        devices = self.allocation()
        if devices:
            grid.add_row("devices", "  ".join(f"{c} {n}" for c, n in devices.items()))
        return grid
