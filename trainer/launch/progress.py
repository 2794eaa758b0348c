"""A live view of a training run from its events: a bar (step, loss, tokens/s, restarts) and a
line for each fault and each recovery as it happens. ``rfsdp train`` and ``rfsdp pipeline
run-local`` show the same view.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from trainer.events import Event, EventTail, FaultFired, Restart, Step


class TrainingProgress:
    """Follows ``run_dir``'s events and shows them (nothing where ``show`` is false).

    Args:
        run_dir: the run directory.
        last: the run's last step.
        show: draw the bar and print the lines.
        out: where to draw (default: stdout).
        start: byte offset of ``events.jsonl`` to follow from (default: its size now).
    """

    def __init__(
        self, run_dir: Path, last: int, *, show: bool = True, out: TextIO | None = None, start: int | None = None
    ) -> None:
        self.last, self.show, self.restarts = last, show, 0
        self._tail = EventTail(run_dir, start=start)
        columns = (TextColumn("train"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        self._bar = Progress(*columns, console=Console(file=out) if out else None, disable=not show)
        self._task = self._bar.add_task(f"step 0/{last}", total=last)

    def __enter__(self) -> TrainingProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.poll()
        self._bar.__exit__(kind, error, tb)

    def print(self, line: str) -> None:
        """A line above the bar."""
        if self.show:
            self._bar.console.print(line, highlight=False, markup=False, soft_wrap=True)  # a log keeps whole lines

    def poll(self) -> list[Event]:
        """Show the events written since the last call, and return them."""
        events = self._tail.new()
        for e in events:
            if isinstance(e, Step):
                self._bar.update(self._task, completed=e.step, description=e.describe(self.last, self.restarts))
            elif isinstance(e, FaultFired):
                self.print(e.describe())
            elif isinstance(e, Restart):
                self.restarts += 1
                self.print(e.describe())
        return events
