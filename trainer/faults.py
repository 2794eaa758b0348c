"""Real fault injection: ``--fault KIND@STEP[/PHASE][:RANK],...``.

A rank fault fires at the start of STEP; with ``/PHASE`` it fires instead inside the checkpoint
saved at STEP, as that save reaches PHASE (``stage``, ``plan``, ``write``, ``finalize``: see
``trainer.events.SAVE_PHASES``), so tests can hit a save in flight without depending on timing.

Each fault fires once per run, also across restarts: a marker file in ``RUN_DIR/faults/`` is
created atomically (``O_EXCL``) just before the fault fires, with its ``fault`` event. The kinds
of :data:`EVERY_TIME` stand for a bug in the model, the data or the code instead: they fire each
time their step is reached, on a state resumed from before it too (``trainer.rank.failures``
ends the job once one has used its retries).

Rank kinds are fired by the rank itself (:class:`FaultInjector`). Node kinds
(``node-loss@STEP:NODE``, ``partition@STEP:NODE:SECONDS``) hit a whole replica's host from
outside: :class:`NodeFaultInjector` runs in the launcher, watches the run's steps and acts
through the cluster harness (:class:`NodeControl`, see ``trainer.emulation.netns``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from trainer import cgroup
from trainer.errors import ParameterError
from trainer.events import EVENTS_FILE, SAVE_PHASES, EventLog, FaultFired
from trainer.process import launcher_pid

EXIT_CODE = 13
RANK_KINDS = {
    "exception": "raised in the step (in-process restart)",
    "sigkill": "the rank is killed (in-job restart)",
    "hang": "the rank blocks inside C (hang detection, in-job restart)",
    "exit": f"the rank exits with code {EXIT_CODE} (in-job restart)",
    "sigterm": (
        "the rank's container is preempted (every rank checkpoints; the run ends when every node is, else goes on)"
    ),
    "corrupt-event": "the rank appends a torn line (no newline, not UTF-8) to events.jsonl (skipped and reported)",
    "enospc": "the rank's next write fails: disk full (the job ends with a fatal event)",
    "corrupt-local": (
        "the rank flips a byte of its newest local snapshot, then raises (in-process restart skips that snapshot)"
    ),
    "lose-save": (
        "with /PHASE: the save's unpublished folder is deleted under it (that save fails; a final one fails the run)"
    ),
    "oom": (
        "the rank allocates until the kernel's OOM killer ends it (in-job restart, reported as oom with its "
        "peak RSS); needs a memory-limited cgroup"
    ),
    "bug": (
        "the step raises the same exception every time it is reached "
        "(a bug: one retry, then the job ends with a fatal event)"
    ),
    "nan": (
        "the rank's parameters turn NaN, so the step's loss does, every time "
        "(a bug: no checkpoint after it is published)"
    ),
}
EVERY_TIME = frozenset({"bug", "nan"})
"""Kinds that fire each time their step is reached, not once per run."""
NODE_KINDS = {
    "node-loss": "node-loss@STEP:NODE, the replica's host dies (--netns)",
    "partition": "partition@STEP:NODE:SECONDS, the host is cut off for SECONDS (--netns)",
}
FAULT_KINDS = {**RANK_KINDS, **NODE_KINDS}
_SPEC = re.compile(
    r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?:/(?P<phase>[a-z]+))?(?::(?P<rank>\d+))?(?::(?P<seconds>\d+(?:\.\d+)?))?$"
)
FAULTS_DIR = "faults"


class InjectedFault(RuntimeError):
    """The soft fault raised by an ``exception`` fault."""


class InjectedBug(RuntimeError):
    """The exception a ``bug`` fault raises each time its step is reached."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault."""

    kind: str
    step: int
    rank: int = 0
    phase: str = ""
    """Empty: at the start of the step; else the phase of the step's checkpoint it fires in."""

    @property
    def key(self) -> str:
        """Stable identity used for the once-per-run marker."""
        where = f"{self.step}/{self.phase}" if self.phase else f"{self.step}"
        return f"{self.kind}@{where}:{self.rank}"


@dataclass(frozen=True, slots=True)
class NodeFault:
    """One scheduled fault of a whole replica's host (fired by the launcher, not by a rank)."""

    kind: str
    step: int
    node: int
    seconds: float = 0.0
    """How long the host's link stays down (``partition``)."""

    @property
    def key(self) -> str:
        """Stable identity used for the once-per-run marker."""
        return f"{self.kind}@{self.step}:{self.node}"


def parse_fault_spec(spec: str, *, steps: int, world_size: int, nnodes: int | None = None) -> list[Fault | NodeFault]:
    """Parse and check a fault spec against the run.

    ``nnodes`` bounds the NODE of node kinds; without it (a rank, which does not know the
    node count) only ``NODE < world_size`` is checked, and the launcher checks the rest.

    Raises:
        ParameterError: naming ``fault`` and the offending item.
    """
    faults: list[Fault | NodeFault] = []
    at_step: dict[int, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _SPEC.match(item)
        if not m:
            raise ParameterError(
                "fault",
                f"{item!r} is not KIND@STEP[/PHASE][:RANK] or node-loss@STEP:NODE or partition@STEP:NODE:SECONDS",
            )
        kind, step, target, phase = m["kind"], int(m["step"]), int(m["rank"] or 0), m["phase"] or ""
        if kind not in FAULT_KINDS:
            raise ParameterError("fault", f"unknown kind {kind!r} in {item!r} (known: {', '.join(FAULT_KINDS)})")
        if not 1 <= step <= steps:
            raise ParameterError("fault", f"step {step} in {item!r} is outside the run (1..{steps})")
        # Which fault a recovery answers would be a race; sigterms on several ranks at once
        # preempt their nodes together (the whole job, when they cover every node), which ends no race.
        together = (
            kind == "sigterm"
            and not phase
            and at_step.get(step, "").startswith("sigterm@")
            and "/" not in at_step[step]
        )
        if step in at_step and not together:
            raise ParameterError("fault", f"{at_step[step]} and {item} are both at step {step}: one fault per step")
        at_step[step] = item
        if phase and (kind not in RANK_KINDS or phase not in SAVE_PHASES):
            raise ParameterError(
                "fault", f"{item!r}: /PHASE is one of {', '.join(SAVE_PHASES)}, for {', '.join(RANK_KINDS)}"
            )
        if phase and kind in EVERY_TIME:
            raise ParameterError("fault", f"{item!r}: {kind} fires at the start of its step and takes no /PHASE")
        if kind in RANK_KINDS:
            if m["seconds"] is not None:
                raise ParameterError("fault", f"{item!r}: only partition takes SECONDS")
            if target >= world_size:
                raise ParameterError("fault", f"rank {target} in {item!r} is outside the world (size {world_size})")
            faults.append(Fault(kind, step, target, phase))
            continue
        seconds = float(m["seconds"] or 0)
        if kind == "partition" and not seconds > 0:
            raise ParameterError("fault", f"{item!r} needs the partition's length: partition@STEP:NODE:SECONDS")
        if kind == "node-loss" and m["seconds"] is not None:
            raise ParameterError("fault", f"{item!r}: node-loss takes no SECONDS (node-loss@STEP:NODE)")
        bound, what = (nnodes, "nodes") if nnodes is not None else (world_size, "world size")
        if target >= bound:
            raise ParameterError("fault", f"node {target} in {item!r} is outside the job ({what} {bound})")
        faults.append(NodeFault(kind, step, target, seconds))
    return faults


def claim_fault(run_dir: Path, key: str) -> bool:
    """Atomically mark the fault ``key`` as fired; False when it already fired in this run."""
    marker_dir = Path(run_dir) / FAULTS_DIR
    marker_dir.mkdir(exist_ok=True)
    try:
        os.close(
            os.open(marker_dir / key.replace("/", "%"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        )  # a save phase's "/"
    except FileExistsError:
        return False
    return True


class FaultInjector:
    """Fires this rank's scheduled faults at their steps, once per run, or every time for the
    kinds of :data:`EVERY_TIME` (``local_newest``: this rank's own newest local snapshot, once
    written, which ``corrupt-local`` hits; ``poison``: turns this rank's parameters NaN, for ``nan``;
    ``unwatch``: ends the step's watch, for ``oom``).
    """

    def __init__(
        self,
        faults: list[Fault],
        run_dir: Path,
        rank: int,
        events: EventLog,
        *,
        local_newest: Callable[[], Path] | None = None,
        poison: Callable[[], None] | None = None,
        unwatch: Callable[[], None] = lambda: None,
    ) -> None:
        self.pending = {(f.step, f.phase): f for f in faults if isinstance(f, Fault) and f.rank == rank}
        self.run_dir = Path(run_dir)
        self.events = events
        self.local_newest = local_newest
        self.poison = poison
        self.unwatch = unwatch

    def maybe_fire(self, step: int, phase: str = "") -> None:
        """Fire the fault scheduled for ``step`` (and the save ``phase``) on this rank, unless it
        already fired.
        """
        fault = self.pending.get((step, phase))
        if fault is None or (fault.kind not in EVERY_TIME and not claim_fault(self.run_dir, fault.key)):
            return
        self.events.emit(FaultFired(kind=fault.kind, step=step, phase=phase or None))
        if fault.kind == "bug":  # the same type, message and line every time: what a bug in the code does
            raise InjectedBug(f"injected bug at step {step}")
        if fault.kind == "nan":  # an overflow in this rank's weights: the step's loss and gradients are NaN
            self.poison()
        if fault.kind == "exception":
            raise InjectedFault(f"injected exception at step {step}")
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "exit":
            os._exit(EXIT_CODE)
        if fault.kind == "corrupt-event":  # a writer that died mid-write, holding the lock: a line's start, no newline,
            tear_event_line(self.run_dir, step)  # cut inside a multi-byte character (not UTF-8)
        if fault.kind == "sigterm":  # preemption of this rank's container: its PID 1, ft_launcher, forwards it to the
            os.kill(launcher_pid(), signal.SIGTERM)  # other ranks; this rank gets it now, so the stop step is this one
            os.kill(os.getpid(), signal.SIGTERM)
        if fault.kind == "corrupt-local":  # bit rot in node memory, then a fault that makes the run resume
            newest = self.local_newest()  # its own (not a replica's)
            with open(newest, "r+b") as f:
                f.seek(newest.stat().st_size // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0xFF]))
            raise InjectedFault(f"injected exception at step {step}, after corrupting {newest.name}")
        if fault.kind == "enospc":  # a real write the kernel refuses: /dev/full always answers ENOSPC
            with open("/dev/full", "wb", buffering=0) as full:
                full.write(b"the rank's next write")
        if fault.kind == "lose-save":  # an outside hand (a cleanup job, a volume hiccup) removes the save in progress
            for tmp in (self.run_dir / "checkpoints").glob(f"step_{step:06d}.tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        if fault.kind == "oom":
            # Filling the limit takes seconds: the step watch (trainer.rank.pace) would end the rank
            # before the kernel's OOM killer does, and the kill to report is the kernel's.
            self.unwatch()
            exhaust_memory()
        if fault.kind == "hang":
            while True:  # blocked inside C (the sleep syscall), as a stuck kernel or driver would be
                time.sleep(3600)


OOM_CHUNK = 64 << 20


def exhaust_memory() -> None:
    """Allocate and touch memory until the kernel's OOM killer ends this process: a leak, or a
    batch too large for the container. Only within a memory limit (the launcher refuses ``oom``
    without one), and never past it: a limit the kernel does not enforce raises instead.
    """
    limit = cgroup.memory_limit(cgroup.memory_dir())
    if limit is None:
        raise RuntimeError("oom fault without a memory limit: refusing to take the machine's memory")
    held = []
    for _ in range(limit // OOM_CHUNK + 1):
        held.append(b"\x01" * OOM_CHUNK)  # written, so resident: calloc's untouched pages would not count
    raise RuntimeError(f"oom fault: {len(held) * OOM_CHUNK >> 20} MiB allocated and no OOM kill")


def tear_event_line(run_dir: Path, step: int) -> None:
    """Append what a writer killed in the middle of an event leaves in ``events.jsonl``: the
    start of a ``step`` line, cut inside a multi-byte UTF-8 character, without its newline
    (the next append starts on a new line: ``EventLog.emit``).
    """
    fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        os.write(fd, b'{"event": "step", "step": ' + str(step).encode() + b', "loss": 2.5, "note": "\xc3')
    finally:
        os.close(fd)


@runtime_checkable
class NodeControl(Protocol):
    """What a cluster harness offers to fire node faults: each replica is its own host."""

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of the host, at once."""

    def set_link(self, node: int, up: bool) -> None:
        """Take the host's network link down or bring it back."""


class NodeFaultInjector:
    """Fires node faults from the launcher: when the run reaches a fault's step (the step
    before it completed), claims its marker, acts on the host, then writes its ``fault`` event
    (rank -1); a partition's link comes back ``seconds`` later (see :meth:`tick`).
    """

    def __init__(self, faults: list[Fault | NodeFault], run_dir: Path, control: NodeControl) -> None:
        self.pending = sorted((f for f in faults if isinstance(f, NodeFault)), key=lambda f: f.step)
        self.run_dir = Path(run_dir)
        self.events = EventLog(self.run_dir, rank=-1)
        self.control = control
        self.heal_at: dict[int, float] = {}

    def observe(self, completed_step: int) -> None:
        """The run completed ``completed_step``: fire what is due before the next step."""
        while self.pending and self.pending[0].step <= completed_step + 1:
            fault = self.pending.pop(0)
            if not claim_fault(self.run_dir, fault.key):
                continue  # fired before this launch (a resumed run)
            if fault.kind == "node-loss":
                self.control.kill_node(fault.node)
            else:
                self.control.set_link(fault.node, up=False)
                self.heal_at[fault.node] = time.monotonic() + fault.seconds
            # Written once the fault is in place: what happens after the event happens under it.
            self.events.emit(
                FaultFired(kind=fault.kind, step=completed_step + 1, node=fault.node, seconds=fault.seconds)
            )

    def tick(self) -> None:
        """Bring back the links whose partition is over."""
        for node, deadline in list(self.heal_at.items()):
            if time.monotonic() >= deadline:
                self.control.set_link(node, up=True)
                del self.heal_at[node]
