"""The events contract: ``RUN_DIR/events.jsonl``, the append-only record every other part reads.

Every event kind is a typed record below (:data:`EVENT_TYPES`); :class:`EventLog` writes them and
:func:`read_events` reads them back. The questions other parts ask of a run (each step's final
loss, the restarts, the checkpoint stalls, goodput) are answered here and nowhere else, so the
trainer, the validator, MLflow tracking, the notebook and the benchmarks cannot disagree.
``docs/events.md`` documents the same kinds and fields (a test holds the two together).

On disk each line is one JSON object: ``event`` (the kind), ``time`` (unix seconds), ``rank``
(-1: the launcher) and the kind's fields. Lines are appended under a POSIX lock so that several
processes (on several hosts, over NFS too) can share the file. An append is whole or absent, and
starts on a new line even after a line torn by a writer killed mid-write; readers take any bytes
(torn lines, bytes that are not UTF-8) and skip what is not an event. A reserve file beside the
log keeps room for the last words of a run (``fatal``, ``run_end``) on a full volume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import socket
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

EVENTS_FILE = "events.jsonl"
RESERVE_FILE = ".events.reserve"
"""Beside ``events.jsonl``: room held for the last words of a run on a full volume (:class:`EventLog`)."""
RESERVE_BYTES = 64 * 1024
_RESERVE_CHUNK = 16 * 1024
SAVE_PHASES = ("stage", "plan", "write", "finalize")
"""The phases of a checkpoint save, in order: a ``fault`` event's ``phase`` is one of them."""
RESTART_LAYERS = ("in_process", "in_job")
CHECKPOINT_TIERS = ("durable", "local")
"""Where a checkpoint lives: ``durable`` (DCP on the shared volume) or ``local`` (this node's
memory, ``--local-ckpt-every``)."""
RESTART_SOURCES = (*CHECKPOINT_TIERS, "peer")
"""What a recovery resumed from (``Restart.source``): a durable checkpoint, every rank's own local
snapshot, or local snapshots of which at least one came from a peer's replica (``--local-replicas``)."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has; ``time``, ``rank`` and ``host`` are stamped by :meth:`EventLog.emit`."""

    KIND: ClassVar[str] = ""
    time: float = 0.0
    rank: int = 0
    host: str = ""
    """The writer's host name: times written on one host share a clock."""


@dataclass(frozen=True, kw_only=True)
class RunStart(Event):
    """A fresh start, or a deliberate resume of a run that ended (``run_end``). A start that
    continues a run which never ended (a replica replaced by its supervisor) is a recovery and
    writes ``restart`` (``in_job``) instead.
    """

    KIND: ClassVar[str] = "run_start"
    config: dict[str, Any]
    resumed_from_step: int
    world_size: int
    phases: dict[str, float] | None = None
    """Seconds after the launcher started at which each stage of rank 0's start ended (rank 0's
    clock), in order: the same stages as a recovery's (``restart``), up to ``resumed``."""


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """A completed training step (a step redone after a fault is written again)."""

    KIND: ClassVar[str] = "step"
    step: int
    loss: float
    """Exact float, mean over ranks."""
    step_time_s: float
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Throughput of this step (NaN for a step of no measurable time)."""
        return self.tokens / self.step_time_s if self.step_time_s > 0 else float("nan")

    def describe(self, last: int, restarts: int) -> str:
        """One line of progress for a person (``last``: the run's last step)."""
        return f"step {self.step}/{last}  loss {self.loss:.4f}  {self.tokens_per_s:,.0f} tok/s  restarts {restarts}"


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    """A checkpoint was published (``tier`` ``durable``), or every rank's local snapshot of a
    step is complete (``tier`` ``local``).
    """

    KIND: ClassVar[str] = "checkpoint"
    step: int
    mode: str
    """``async`` or ``sync``."""
    blocking_s: float
    """How long the training loop was stalled."""
    total_s: float
    """From the start of the save until it was published."""
    bytes: int
    """Durable: the checkpoint's files; local: rank 0's snapshot file."""
    phases: dict[str, float] | None = None
    """Rank 0's seconds per phase of the save, in order (``Checkpointer.save`` and ``LocalTier.save`` name them)."""
    tier: str = "durable"
    """One of ``CHECKPOINT_TIERS``."""

    @property
    def write_mb_s(self) -> float:
        """Write throughput, MB/s over ``total_s``."""
        return self.bytes / self.total_s / 1e6 if self.total_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    """A save failed: nothing was published; it is retried at the next interval."""

    KIND: ClassVar[str] = "checkpoint_failed"
    step: int
    mode: str
    error: str
    tier: str = "durable"
    """One of ``CHECKPOINT_TIERS``."""


@dataclass(frozen=True, kw_only=True)
class Mirror(Event):
    """A checkpoint is complete in object storage and the remote ``latest`` names it."""

    KIND: ClassVar[str] = "mirror"
    step: int
    uri: str
    bytes: int
    upload_s: float
    attempts: int


@dataclass(frozen=True, kw_only=True)
class MirrorFailed(Event):
    """An upload failed; training goes on. ``retry_in_s`` ``None``: given up (local retention
    removed the checkpoint, or the run ended).
    """

    KIND: ClassVar[str] = "mirror_failed"
    step: int | None
    attempt: int | None
    error: str
    retry_in_s: float | None


@dataclass(frozen=True, kw_only=True)
class MirrorRestore(Event):
    """An empty run dir was resumed from the remote checkpoint."""

    KIND: ClassVar[str] = "mirror_restore"
    step: int
    uri: str
    bytes: int
    download_s: float


@dataclass(frozen=True, kw_only=True)
class RunWarning(Event):
    """Something was repaired or skipped. ``kind`` ``checkpoint_skipped``: ``step``, ``reason`` (a
    torn or corrupt checkpoint at resume); ``latest_repaired``: ``step``, ``was`` (``latest`` named
    another checkpoint than the one resumed from); ``local_snapshot_skipped``: ``step``, ``reason``
    (a rank's torn or corrupt local snapshot at resume, written by that rank).
    """

    KIND: ClassVar[str] = "warning"
    kind: str
    step: int
    reason: str | None = None
    was: str | None = None


@dataclass(frozen=True, kw_only=True)
class FaultFired(Event):
    """An injected fault, written just before it fires. ``phase``: only for a fault inside a save;
    ``node``, ``seconds``: only for node faults (``rank`` -1).
    """

    KIND: ClassVar[str] = "fault"
    kind: str
    step: int
    phase: str | None = None
    node: int | None = None
    seconds: float | None = None

    def describe(self) -> str:
        """One line for a person: which fault, where and when."""
        where = f"node {self.node}" if self.rank < 0 else f"rank {self.rank}"
        inside = f", in the save's {self.phase} phase" if self.phase else ""
        return f"fault {self.kind} at step {self.step} on {where}{inside}"


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    """A recovery, written at the first step completed after it."""

    KIND: ClassVar[str] = "restart"
    layer: str
    """``in_process`` or ``in_job``."""
    attempt: int
    resumed_from_step: int
    source: str = "durable"
    """What it resumed from (one of ``RESTART_SOURCES``)."""
    lost_steps: int
    """Steps done since ``resumed_from_step`` that had to be redone."""
    recovery_s: float
    """From the fault to the first step completed after it."""
    phases: dict[str, float] | None = None
    """Seconds after the fault at which each stage of the recovery ended (rank 0's clock), in order."""

    def describe(self) -> str:
        """One line for a person: which layer recovered, from where, at what cost."""
        return (
            f"restart {self.attempt} ({self.layer}): resumed from step {self.resumed_from_step}, "
            f"{self.lost_steps} steps redone, back {self.recovery_s:.1f} s after the fault"
            + {"local": " (local snapshot)", "peer": " (local snapshot, from a peer's replica)"}.get(self.source, "")
        )


@dataclass(frozen=True, kw_only=True)
class RunEnd(Event):
    """The end of a session: ``completed``, ``stopped`` (``--stop-at-step``) or ``preempted``
    (SIGTERM: the step reached is checkpointed) by rank 0, or ``failed`` with ``exit_code`` by
    the launcher (``rank`` -1) when restarts ran out. ``saved_step``: the step of the checkpoint
    the run ends with, published (rank 0 writes no end without it: a failed last save fails the
    session instead).
    """

    KIND: ClassVar[str] = "run_end"
    status: str
    step: int | None = None
    exit_code: int | None = None
    saved_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Fatal(Event):
    """An error no restart can fix (a full disk, a forbidden path, corrupt data), by the rank that
    met it, which then ends its job (exit code ``trainer.errors.FATAL_EXIT_CODE``). ``job``: the
    rendezvous id of that job; its launcher's later restarts of the ranks exit at once.
    """

    KIND: ClassVar[str] = "fatal"
    error: str
    job: str


@dataclass(frozen=True, kw_only=True)
class SystemSample(Event):
    """What one node's machine was doing (``--system-metrics-every``), written by the node's first
    local rank: utilisation and memory, per GPU where NVML sees GPUs.
    """

    KIND: ClassVar[str] = "system"
    node: int
    """The node (replica) rank: ``GROUP_RANK`` of the launcher."""
    metrics: dict[str, float]
    """Named as MLflow's own system metrics (``cpu_utilization_percentage``, ``gpu_0_memory_usage_megabytes``)."""


EVENT_TYPES: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (
        RunStart, Step, Checkpoint, CheckpointFailed, Mirror, MirrorFailed, MirrorRestore, RunWarning, FaultFired, Restart, Fatal, RunEnd,
        SystemSample,
    )
}  # fmt: skip
E = TypeVar("E", bound=Event)


def to_record(event: Event) -> dict[str, Any]:
    """The JSON object of an event, as written to ``events.jsonl``."""
    return {"event": event.KIND, **dataclasses.asdict(event)}


def from_record(record: dict[str, Any]) -> Event | None:
    """The typed event of a JSON object (None: not an event of a known kind, or incomplete)."""
    cls = EVENT_TYPES.get(record.get("event")) if isinstance(record, dict) else None
    if cls is None:
        return None
    names = _field_names(cls)
    try:
        return cls(**{k: v for k, v in record.items() if k in names})
    except TypeError:  # a required field is missing
        return None


@functools.cache
def _field_names(cls: type[Event]) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


class EventLog:
    """Appends events of one rank to a run directory's ``events.jsonl``.

    An append is whole or absent: a write cut short (a full volume, a quota, a file size limit)
    is undone under the lock and raises an ``OSError`` with the cause's errno, naming the file.
    Each append starts on a new line, so a line torn by a writer killed mid-write (which no
    reader can use) never takes the next event with it.

    The last words of a run, ``fatal`` and ``run_end``, must reach the file on a full volume
    too: the ranks restarted by ft_launcher, the launcher and ``rfsdp train`` learn from the
    ``fatal`` event that no restart can help. After its first append, a log makes sure
    ``RUN_DIR/.events.reserve`` holds :data:`RESERVE_BYTES` (incompressible, so really
    allocated); a last word that meets a full volume shrinks the reserve a chunk at a time,
    under the lock, and tries again.
    """

    LAST_WORDS: ClassVar[tuple[type[Event], ...]] = (Fatal, RunEnd)

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.reserve = Path(run_dir) / RESERVE_FILE
        self.rank = rank
        self.host = socket.gethostname()
        self._reserve_checked = False

    def emit(self, event: E) -> E:
        """Append one event, stamped with the time, this log's rank and host; returns the stamped event.

        Raises:
            OSError: nothing was appended (the errno of the cause; the message names the file).
        """
        event = dataclasses.replace(event, time=time.time(), rank=self.rank, host=self.host)
        line = (json.dumps(to_record(event)) + "\n").encode()
        last_word = isinstance(event, self.LAST_WORDS)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            # O_APPEND alone is atomic on a local file system, not on NFS (a ReadWriteMany volume),
            # where the client appends at the end it last saw; taking a POSIX lock makes it
            # revalidate the file first. A writer that dies releases its lock with it.
            fcntl.lockf(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a writer died mid-line: end that line first
                line = b"\n" + line
            while True:
                try:
                    _append_whole(fd, line, size, self.path)
                    break
                except OSError as e:
                    if not (last_word and e.errno in (errno.ENOSPC, errno.EDQUOT) and _release_reserve(self.reserve)):
                        raise
        finally:
            os.close(fd)
        if not self._reserve_checked and not last_word:  # (a last word may have just used it)
            self._reserve_checked = True
            _make_reserve(self.reserve)
        return event


def _append_whole(fd: int, data: bytes, size: int, path: Path) -> None:
    """Append ``data`` to ``fd`` (opened ``O_APPEND``, locked, ``size`` bytes long): all of it,
    or nothing (a short write is continued; an error truncates the file back to ``size``).
    """
    done = 0
    try:
        while done < len(data):
            written = os.write(fd, data[done:])
            if written <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += written
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        code = e.errno if e.errno is not None else errno.EIO
        raise OSError(code, f"{e.strerror or e}: no event appended ({done} of {len(data)} bytes written, undone)", str(path)) from e


def _make_reserve(path: Path) -> None:
    """Make the reserve of last words whole (best effort: a full volume has no room for it)."""
    with contextlib.suppress(OSError):
        if path.stat().st_size >= RESERVE_BYTES:
            return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _append_whole(fd, os.urandom(RESERVE_BYTES), 0, tmp)  # random: a compressing file system must allocate it
        finally:
            os.close(fd)
        os.replace(tmp, path)  # atomic: of writers racing here, one reserve stays
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _release_reserve(path: Path) -> bool:
    """Give back a chunk of the reserve of last words to the volume; False when none is left.
    Called under the events lock, which every writer of the reserve's size holds.
    """
    try:
        size = path.stat().st_size
        if size > _RESERVE_CHUNK:
            os.truncate(path, size - _RESERVE_CHUNK)
        else:
            path.unlink()
    except OSError:
        return False
    return size > 0


def read_events(run_dir: Path, kinds: Iterable[type[Event]] | None = None) -> list[Event]:
    """All events of a run (of ``kinds`` only, when given), in file order; see :func:`iter_events`."""
    return list(iter_events(run_dir, kinds))


def iter_events(run_dir: Path, kinds: Iterable[type[Event]] | None = None) -> Iterator[Event]:
    """A run's events in file order, read line by line; lines that are not events (torn by
    killed writers, foreign bytes) are skipped. With ``kinds``, a line of another kind (the kind
    is written first) is skipped unparsed: a run of days writes millions of lines, mostly steps
    and checkpoints.
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    wanted = None if kinds is None else frozenset(cls.KIND for cls in kinds)
    with path.open("rb") as lines:
        for _, event, _ in _parse(lines, wanted):
            if event is not None:
                yield event


def parse_event_lines(text: str | bytes) -> Iterator[Event]:
    """The events in ``text``, skipping lines that are not events (see :func:`_parse`)."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    for _, event, _ in _parse(data.split(b"\n")):
        if event is not None:
            yield event


def corrupt_lines(run_dir: Path) -> list[int]:
    """Line numbers (from 1) of ``events.jsonl`` that are not (only) an event: torn or foreign
    lines, which every reader skips, and the torn start of a line glued to a complete event
    (reported once, by the run's summary).
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    with path.open("rb") as lines:
        return [n for n, _, whole in _parse(lines) if not whole]


_KIND_PREFIX = b'{"event": "'
"""How every line :class:`EventLog` writes begins (see :func:`to_record`). ``json.dumps`` escapes
every quote inside a value, so these bytes occur in a line only where an event begins."""


def _parse(lines: Iterable[bytes], wanted: frozenset[str] | None = None) -> Iterator[tuple[int, Event | None, bool]]:
    """Each line's number, its event (None: none) and whether the line is that event and
    nothing else. Any bytes are taken. A line that is not an event but holds a complete event
    after the start of another (what a writer killed mid-line left, glued to the next writer's
    line by an older writer) yields that complete event: the last place an event begins. Lines
    whose last event's written kind is not ``wanted`` are left out unparsed.
    """
    skip = len(_KIND_PREFIX)
    for n, line in enumerate(lines, start=1):
        line = line.rstrip(b"\n")
        if not line:
            continue
        at = line.rfind(_KIND_PREFIX)
        if wanted is not None and at >= 0:
            kind = line[at + skip : line.find(b'"', at + skip)]
            if kind.decode("utf-8", "replace") not in wanted:
                continue
        event = _event_of(line)
        if event is not None:
            yield n, event, True
        else:
            yield n, _event_of(line[at:]) if at > 0 else None, False


def _event_of(data: bytes) -> Event | None:
    """The event ``data`` holds, all of it (None: anything else)."""
    try:
        return from_record(json.loads(data.decode("utf-8")))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested beyond the parser
        return None


class EventTail:
    """Follows a run's ``events.jsonl`` as it grows: each :meth:`new` returns the events
    appended since the last call (complete lines only).

    Args:
        run_dir: the run directory.
        start: the byte offset to follow from (default: the file's size now).
    """

    def __init__(self, run_dir: Path, *, start: int | None = None) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self._seen = start if start is not None else self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[Event]:
        """Events completed since the last call (those present at construction are skipped)."""
        if not self.path.exists() or self.path.stat().st_size <= self._seen:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._seen)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._seen += len(complete)
        return list(parse_event_lines(complete))


def first_run_start_line(path: Path) -> bytes | None:
    """The raw line of the first ``run_start`` in an events file (a run dir's identity): from
    where that event begins, should a torn line precede it on the same line.
    """
    with open(path, "rb") as f:
        for line in f:
            for _, event, whole in _parse([line], frozenset({RunStart.KIND})):
                if isinstance(event, RunStart):
                    return line if whole else line[line.rfind(_KIND_PREFIX) :]
    return None


# --------------------------------------------------------------------------- the questions asked of a run


def select(events: Iterable[Event], kind: type[E]) -> list[E]:
    """The events of one kind, in order."""
    return [e for e in events if isinstance(e, kind)]


def final_steps(events: Iterable[Event]) -> dict[int, Step]:
    """The final trajectory: each step's last ``step`` event (re-executed steps log again)."""
    return {e.step: e for e in select(events, Step)}


def final_losses(events: Iterable[Event]) -> dict[int, float]:
    """Each step's final loss: the last ``step`` event for it wins."""
    return {step: e.loss for step, e in final_steps(events).items()}


def sessions(events: Iterable[Event]) -> list[list[Event]]:
    """Split events into sessions: each starts at a ``run_start`` (a fresh start or a resume).

    In-process and in-job restarts stay inside their session (they write no ``run_start``).
    Events before the first ``run_start`` (none are written by the trainer) are dropped.
    """
    out: list[list[Event]] = []
    for e in events:
        if isinstance(e, RunStart):
            out.append([e])
        elif out:
            out[-1].append(e)
    return out


def latest_end(events: list[Event]) -> RunEnd | None:
    """How the latest session ended (None: it has not, or it died without a word)."""
    runs = sessions(events)
    ends = select(runs[-1], RunEnd) if runs else []
    return ends[-1] if ends else None


def session_finished(events: list[Event]) -> bool:
    """Whether the latest session ended well: completed, stopped at ``--stop-at-step``, or
    preempted with its checkpoint published.
    """
    end = latest_end(events)
    return end is not None and end.status in ("completed", "stopped", "preempted")


def fatal_error(events: Iterable[Event], job: str | None = None, *, since: float = 0.0) -> Fatal | None:
    """The latest ``fatal`` event (of ``job``, when given; written at ``since`` or later), or None."""
    found = [e for e in events if isinstance(e, Fatal) and job in (None, e.job) and e.time >= since]
    return found[-1] if found else None


@dataclass
class RunHistory:
    """What a starting rank needs of the events written before it, folded in one pass and without
    keeping the events: a run of days writes millions of lines, and rank 0 reads them at every
    (re)start, recoveries included (:func:`read_history`).
    """

    restarts: int = 0
    """``restart`` events in the whole file."""
    restarts_in_session: int = 0
    """``restart`` events since the last ``run_start``."""
    session_open: bool = False
    """Whether the last ``run_start`` / ``run_end`` is a ``run_start``: a session that never ended."""
    max_step: int | None = None
    """The highest step of the incarnation that ran last: since the last ``run_start``, or since
    the last ``restart``'s own incarnation began (its first step, written right before it)."""
    last_step: int | None = None
    """The step of the last ``step`` event."""
    fault: FaultFired | None = None
    """The last ``fault`` since the last ``restart`` or ``run_start`` (file order, no clock)."""
    last_step_time: dict[str, float] = dataclasses.field(default_factory=dict)
    """Host -> the time of its last ``step`` event."""
    last_step_time_before_fault: dict[str, float] = dataclasses.field(default_factory=dict)
    """``last_step_time`` as it was when :attr:`fault` was written."""

    KINDS: ClassVar[tuple[type[Event], ...]] = (Step, FaultFired, Restart, RunStart, RunEnd)
    """The kinds that change a history: lines of other kinds need not be parsed."""

    @classmethod
    def of(cls, events: Iterable[Event]) -> RunHistory:
        """The history of ``events``, in file order."""
        history = cls()
        for event in events:
            history.add(event)
        return history

    def add(self, event: Event) -> None:
        """Fold in the next event in file order."""
        if isinstance(event, Step):
            self.last_step = event.step
            self.max_step = event.step if self.max_step is None else max(self.max_step, event.step)
            self.last_step_time[event.host] = max(event.time, self.last_step_time.get(event.host, event.time))
        elif isinstance(event, FaultFired):
            self.fault, self.last_step_time_before_fault = event, dict(self.last_step_time)
        elif isinstance(event, Restart | RunStart):
            self.fault = None
            if isinstance(event, Restart):
                self.restarts += 1
                self.restarts_in_session += 1
                self.max_step = self.last_step  # steps before it were the failed incarnation's, counted by this restart
            else:
                self.restarts_in_session, self.session_open, self.max_step = 0, True, None
        elif isinstance(event, RunEnd):
            self.session_open = False


def read_history(run_dir: Path) -> RunHistory:
    """The :class:`RunHistory` of a run's ``events.jsonl``: only the lines of its kinds are parsed."""
    return RunHistory.of(iter_events(run_dir, RunHistory.KINDS))


def recovery_layer(history: RunHistory, *, in_process_iteration: int, in_job_restart: int) -> str | None:
    """Which layer brought this incarnation of the trainer back (None: a fresh or deliberate start).

    A replica restarted by its supervisor (a pod's ``restartPolicy``, the netns harness) runs a
    fresh ft_launcher whose restart count is 0 again: it is recognised by the run it continues,
    whose last session never ended (a ``run_start`` after the last ``run_end``).
    """
    if in_process_iteration:
        return "in_process"
    if in_job_restart:
        return "in_job"
    return "in_job" if history.session_open else None


def describe_restart(
    history: RunHistory, *, layer: str, resumed_from: int, first_step: Step, marks: dict[str, float] | None = None, source: str = "durable"
) -> Restart:
    """The ``restart`` event for a recovery, from the history of the events written before it.

    ``recovery_s`` runs from the fault to ``first_step``, the first step completed after it, on
    one clock: from the ``fault`` event when the host that wrote it also wrote ``first_step``;
    otherwise (a fault on another host, or not injected) from the last step that host completed
    before the fault, which may add up to one step's time. ``lost_steps`` are the steps done since
    ``resumed_from`` that must be redone. ``marks`` (unix times on the first step's host, in order)
    become ``phases``, as seconds after the fault; marks before it (a process that outlived the
    fault) are left out. ``source``: the tier resumed from.
    """
    fault = history.fault
    if fault is not None and fault.host == first_step.host:
        start = fault.time
    else:  # the last step this host completed before the fault (in file order: no other clock involved)
        before = history.last_step_time_before_fault if fault is not None else history.last_step_time
        start = before.get(first_step.host, first_step.time)
    return Restart(
        layer=layer,
        attempt=1 + history.restarts,
        resumed_from_step=resumed_from,
        source=source,
        lost_steps=max(0, (resumed_from if history.max_step is None else history.max_step) - resumed_from),
        recovery_s=first_step.time - start,
        phases={**{k: t - start for k, t in (marks or {}).items() if t >= start}, "first_step": first_step.time - start},
    )


def durable_checkpoints(events: Iterable[Event]) -> list[Checkpoint]:
    """The published durable checkpoints (``checkpoint`` events of tier ``durable``), in order:
    what validation, mirroring and the durable stall figures are about.
    """
    return [e for e in select(events, Checkpoint) if e.tier == "durable"]


def restarts_with_faults(events: Iterable[Event]) -> list[tuple[Restart, FaultFired | None]]:
    """Each ``restart`` with the injected ``fault`` that caused it (None: a fault not injected)."""
    out: list[tuple[Restart, FaultFired | None]] = []
    fault = None
    for e in events:
        if isinstance(e, FaultFired):
            fault = e
        elif isinstance(e, Restart):
            out.append((e, fault))
            fault = None
    return out


def summarize(events: list[Event]) -> dict[str, float | int | None]:
    """Summary figures of a run from its events (``None`` where a figure is undefined).

    Definitions:
        * ``wall_time_s``: summed over sessions, the time from a session's ``run_start`` to its
          last event (gaps between a stopped run and its resume are not wall time of the job).
        * ``useful_time_s``: the sum of ``step_time_s`` over the final trajectory, i.e. over each
          step's *last* ``step`` event; steps lost to a fault and re-executed count once.
        * ``goodput``: ``useful_time_s / wall_time_s``. It excludes startup, checkpoint stalls,
          lost work and recovery, and also the small per-step bookkeeping outside the timed
          step, so even a fault-free run stays a little below 1.
        * ``ckpt_overhead``: the summed ``blocking_s`` of published checkpoints / ``wall_time_s``
          (the share of wall time the training loop was stopped for durable checkpoints).
        * Every ``checkpoint*`` / ``ckpt_*`` figure is of the durable tier only; the local tier
          (``--local-ckpt-every``) has its own: ``local_snapshots`` (complete on every rank),
          ``local_blocking_s_p50|max`` (the loop's stall per snapshot) and ``local_overhead``
          (their summed stall / ``wall_time_s``).
        * ``restarts_<layer>``, ``recovery_s_mean|p50|max`` (fault to first completed step
          after it), ``lost_steps`` (summed) and ``lost_steps_max`` (the most one recovery lost)
          from the ``restart`` events.
        * ``ckpt_write_mb_s_mean``: mean over checkpoints of ``bytes / total_s`` in MB/s
          (from the start of a save until it was published).
        * ``tokens_per_s``: tokens of the final trajectory / ``useful_time_s``.
        * ``final_step`` / ``final_loss``: the last step of the final trajectory and its loss.

    Args:
        events: the run's events in file order (see :func:`read_events`).

    Returns:
        Figure name -> value.
    """
    steps = final_steps(events)
    restarts = select(events, Restart)
    ckpts = durable_checkpoints(events)
    local = [e.blocking_s for e in select(events, Checkpoint) if e.tier == "local"]
    recovery = [e.recovery_s for e in restarts]
    blocking = [e.blocking_s for e in ckpts]
    wall = sum(s[-1].time - s[0].time for s in sessions(events))
    useful = sum(e.step_time_s for e in steps.values())
    tokens = sum(e.tokens for e in steps.values())
    last = max(steps, default=None)
    return {
        "steps_executed": len(select(events, Step)),
        "final_step": last,
        "final_loss": steps[last].loss if last is not None else None,
        "faults": len(select(events, FaultFired)),
        "restarts": len(restarts),
        **{f"restarts_{layer}": sum(e.layer == layer for e in restarts) for layer in RESTART_LAYERS},
        "recovery_s_mean": statistics.fmean(recovery) if recovery else None,
        "recovery_s_p50": statistics.median(recovery) if recovery else None,
        "recovery_s_max": max(recovery, default=None),
        "lost_steps": sum(e.lost_steps for e in restarts),
        "lost_steps_max": max((e.lost_steps for e in restarts), default=None),
        "checkpoints": len(ckpts),
        "checkpoints_failed": len(select(events, CheckpointFailed)),
        "ckpt_blocking_s_total": sum(blocking),
        "ckpt_blocking_s_mean": statistics.fmean(blocking) if blocking else None,
        "ckpt_blocking_s_p50": statistics.median(blocking) if blocking else None,
        "ckpt_blocking_s_max": max(blocking, default=None),
        "ckpt_total_s_mean": statistics.fmean(e.total_s for e in ckpts) if ckpts else None,
        "ckpt_write_mb_s_mean": statistics.fmean(e.write_mb_s for e in ckpts) if ckpts else None,
        "wall_time_s": wall,
        "useful_time_s": useful,
        "goodput": useful / wall if wall > 0 else None,
        "ckpt_overhead": sum(blocking) / wall if wall > 0 else None,
        "local_snapshots": len(local),
        "local_blocking_s_p50": statistics.median(local) if local else None,
        "local_blocking_s_max": max(local, default=None),
        "local_overhead": sum(local) / wall if wall > 0 else None,
        "tokens_per_s": tokens / useful if useful > 0 else None,
    }
