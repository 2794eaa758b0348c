"""What a person sees of a local pipeline run (``rfsdp pipeline run-local``): a line as each step
starts and ends, the training's live progress bar, and a line for each fault and recovery as it
happens. The steps' own output (kfp.local's executor logs, the ranks' lines) goes to a log file.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from trainer.events import EVENTS_FILE
from trainer.launch.progress import TrainingProgress

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# kfp.local's own lines (kfp/local/task_dispatcher.py), after their colours are taken out.
_STARTED = re.compile(r"Executing task '([^']+)'")
_ENDED = re.compile(r"Task '([^']+)' finished with status (\w+)")


@contextlib.contextmanager
def steps_to_log(log: Path, workspace: Path, last_step: int) -> Iterator[None]:
    """Inside, this process's stdout and stderr go to ``log`` (at the descriptors: kfp.local's
    steps inherit them), and the terminal shows the steps and the training of the run whose
    ``events.jsonl`` appears or grows under ``workspace`` (``last_step``: its last step).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log, "ab") as f:
        watcher = _Watcher(log, workspace, last_step, terminal)  # before the switch: it reads where the log ends
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        watcher.start()
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        watcher.stop()
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)
        terminal.close()


class _Watcher:
    """Polls the log for kfp.local's step lines and the workspace for the run's events."""

    def __init__(self, log: Path, workspace: Path, last_step: int, terminal: TextIO) -> None:
        self._thread = threading.Thread(target=self._run, name="local-view", daemon=True)
        self.log, self.workspace, self.last_step, self.terminal = log, workspace, last_step, terminal
        self._log_offset = log.stat().st_size
        self._known = {
            p: p.stat().st_size for p in workspace.glob(f"*/run/{EVENTS_FILE}")
        }  # a resumed run's earlier events
        self._progress: TrainingProgress | None = None
        self._step_started: dict[str, float] = {}
        self._done = threading.Event()

    def start(self) -> None:
        """Follow the log and the workspace every 0.2 s, in the background."""
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self._poll()

    def stop(self) -> None:
        """Show what is left, then stop."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self._poll()
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress.print(line)  # above the bar
        else:
            self.terminal.write(line + "\n")

    def _poll(self) -> None:
        with open(self.log, "rb") as f:
            f.seek(self._log_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        for line in _ANSI.sub("", complete.decode(errors="replace")).splitlines():
            if started := _STARTED.search(line):
                self._step_started[started[1]] = time.monotonic()
                self._say(f"{started[1]}: started")
            elif ended := _ENDED.search(line):
                self._poll_events()  # what the step wrote comes before its end
                seconds = time.monotonic() - self._step_started.get(ended[1], time.monotonic())
                self._say(f"{ended[1]}: {ended[2].lower()} in {seconds:.0f} s")
        self._poll_events()

    def _poll_events(self) -> None:
        if self._progress is None:
            for events in self.workspace.glob(f"*/run/{EVENTS_FILE}"):
                if events.stat().st_size > self._known.get(events, 0):
                    progress = TrainingProgress(
                        events.parent, self.last_step, out=self.terminal, start=self._known.get(events, 0)
                    )
                    self._progress = progress.__enter__()
                    break
        if self._progress is not None:
            self._progress.poll()
