"""``RUN_DIR/events.jsonl``: the append-only record every other part reads (design.md section 3).

Each line is one JSON object with ``event``, ``time`` (unix seconds) and ``rank``. Lines are
written with a single ``O_APPEND`` write so that several processes can share the file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events of one rank to a run directory's ``events.jsonl``."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.rank = rank

    def emit(self, event: str, **fields: object) -> dict:
        """Append one event and return it."""
        record = {"event": event, "time": time.time(), "rank": self.rank, **fields}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(run_dir: Path) -> list[dict]:
    """All events of a run, in file order (torn lines from killed writers are skipped)."""
    path = Path(run_dir) / EVENTS_FILE
    return list(parse_event_lines(path.read_text())) if path.exists() else []


def parse_event_lines(text: str) -> Iterator[dict]:
    """The events in ``text``, skipping torn lines: a process killed mid-write leaves a partial
    line, which the next writer's line then follows on the same line.
    """
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def final_losses(events: list[dict]) -> dict[int, float]:
    """Each step's final loss: the last ``step`` line for it wins (re-executed steps re-log)."""
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def recovery_layer(prior: list[dict], *, in_process_iteration: int, in_job_restart: int) -> str | None:
    """Which layer brought this incarnation of the trainer back (None: a fresh or deliberate start).

    A replica restarted by its supervisor (a pod's ``restartPolicy``, the netns harness) runs a
    fresh ft_launcher whose restart count is 0 again: it is recognised by the run it continues,
    whose last session never ended (a ``run_start`` after the last ``run_end``).
    """
    if in_process_iteration:
        return "in_process"
    if in_job_restart:
        return "in_job"
    sessions = [e["event"] for e in prior if e["event"] in ("run_start", "run_end")]
    return "in_job" if sessions and sessions[-1] == "run_start" else None


def describe_restart(prior: list[dict], *, layer: str, resumed_from: int, first_step_time: float) -> dict:
    """Fields of the ``restart`` event for a recovery, from the events written before it.

    ``recovery_s`` runs from the fault (its ``fault`` event; for a fault that was not injected,
    the last step completed before it) to the first step completed after it. ``lost_steps`` are
    the steps done since ``resumed_from`` that must be redone.
    """
    since = max((e["time"] for e in prior if e["event"] in ("restart", "run_start")), default=0.0)
    faults = [e["time"] for e in prior if e["event"] == "fault" and e["time"] >= since]
    steps = [e for e in prior if e["event"] == "step"]
    fault_time = faults[-1] if faults else max((e["time"] for e in steps), default=first_step_time)
    return {
        "layer": layer,
        "attempt": 1 + sum(e["event"] == "restart" for e in prior),
        "resumed_from_step": resumed_from,
        "lost_steps": max(0, max((e["step"] for e in steps), default=resumed_from) - resumed_from),
        "recovery_s": first_step_time - fault_time,
    }
