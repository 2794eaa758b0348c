"""Real fault injection: ``--fault KIND@STEP[:RANK],...`` (grammar in design.md).

Each fault fires once per run, also across restarts: a marker file in ``RUN_DIR/faults/`` is
created atomically (``O_EXCL``) just before the fault fires, after its ``fault`` event.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.events import EventLog

RANK_KINDS = ("exception", "sigkill", "hang", "exit")
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")
EXIT_CODE = 13


class InjectedFault(RuntimeError):
    """The soft fault raised by an ``exception`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault."""

    kind: str
    step: int
    rank: int = 0

    @property
    def key(self) -> str:
        """Stable identity used for the once-per-run marker."""
        return f"{self.kind}@{self.step}:{self.rank}"


def parse_fault_spec(spec: str, *, steps: int, world_size: int) -> list[Fault]:
    """Parse and check a fault spec against the run.

    Raises:
        ValueError: naming ``--fault`` and the offending item.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"--fault: {item!r} is not KIND@STEP[:RANK]")
        fault = Fault(m["kind"], int(m["step"]), int(m["rank"] or 0))
        if fault.kind not in RANK_KINDS:
            raise ValueError(f"--fault: unknown kind {fault.kind!r} in {item!r} (known: {', '.join(RANK_KINDS)})")
        if not 1 <= fault.step <= steps:
            raise ValueError(f"--fault: step {fault.step} in {item!r} is outside the run (1..{steps})")
        if fault.rank >= world_size:
            raise ValueError(f"--fault: rank {fault.rank} in {item!r} is outside the world (size {world_size})")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires this rank's scheduled faults at their steps, once per run."""

    def __init__(self, faults: list[Fault], run_dir: Path, rank: int, events: EventLog) -> None:
        self.pending = {f.step: f for f in faults if f.rank == rank}
        self.marker_dir = Path(run_dir) / "faults"
        self.events = events

    def maybe_fire(self, step: int) -> None:
        """Fire the fault scheduled for ``step`` on this rank, unless it already fired."""
        fault = self.pending.get(step)
        if fault is None or not self._claim(fault):
            return
        self.events.emit("fault", kind=fault.kind, step=step)
        if fault.kind == "exception":
            raise InjectedFault(f"injected exception at step {step}")
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "exit":
            os._exit(EXIT_CODE)
        if fault.kind == "hang":
            while True:  # blocked inside C (the sleep syscall), as a stuck kernel or driver would be
                time.sleep(3600)

    def _claim(self, fault: Fault) -> bool:
        self.marker_dir.mkdir(exist_ok=True)
        try:
            os.close(os.open(self.marker_dir / fault.key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
