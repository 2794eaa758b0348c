"""The event kinds of ``events.jsonl``: one typed record per kind, and their JSON form."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

EVENTS_FILE = "events.jsonl"
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
    (a rank's torn or corrupt local snapshot at resume, written by that rank); ``local_tier_off``:
    ``step``, ``reason`` (the local tier stepped aside); ``mirror_incomplete``: ``step``, ``reason``
    (at the end, the mirror had lost an event or an upload).
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
class NodesPreempted(Event):
    """Some nodes, not all, were asked to stop (a drained node, an evicted pod), written by rank 0
    once ``step`` is checkpointed. Their ranks leave; the session goes on from ``step`` once
    their replacements join (a ``restart``, layer ``in_job``). With every node asked, the session
    ends instead (``run_end`` preempted).
    """

    KIND: ClassVar[str] = "nodes_preempted"
    step: int
    nodes: list[int]
    """The node ranks (``GROUP_RANK``) asked to stop."""
    nnodes: int
    others: str = "wait"
    """``wait`` in the rendezvous, or ``relaunch``: the rendezvous store went with a node that
    left, so the others' launchers end too and their supervisor (a pod's ``restartPolicy``)
    starts them again into the new one."""

    def describe(self) -> str:
        """One line for a person: which nodes, and what the others do."""
        which = ", ".join(map(str, self.nodes))
        then = (
            "wait for the replacement" if self.others == "wait" else "are relaunched with it (it held the rendezvous)"
        )
        return f"node {which} of {self.nnodes} preempted at step {self.step}, checkpointed: the others {then}"


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


FATAL_REASONS = ("non_transient", "bug")
"""Why a job ended for good (``Fatal.reason``): an error whose cause is outside the job (a full
disk, a forbidden path, corrupt data), or a suspected bug that came back after its retries."""
FAILURE_CATEGORIES = ("infrastructure", "bug")
"""The class of a failure (``Failure.category``; ``trainer.rank.failures`` decides)."""


@dataclass(frozen=True, kw_only=True)
class Failure(Event):
    """An exception that ended this rank's attempt of the training function, classified
    (``trainer.rank.failures``): ``category`` ``infrastructure`` (``kind`` ``collective``: a
    peer or link lost; ``io``: an OS error known to be transient) or ``bug`` (``kind``
    ``exception``, or ``nonfinite_loss``: the loss turned NaN or Inf). A bug's ``occurrence``
    counts this rank's failures of the same ``error_type`` and ``origin`` at the same ``step``
    in the session, this one included. Or an OOM kill (infrastructure, ``kind`` ``oom``, with
    ``peak_rss_mb``), which the rank cannot write: its worker does (``trainer.launch.worker``).
    Other faults that never reach Python (a signal, a hang, a lost node) write none: they are
    infrastructure.
    """

    KIND: ClassVar[str] = "failure"
    category: str
    """One of ``FAILURE_CATEGORIES``."""
    kind: str
    error_type: str
    """The exception's qualified type (``trainer.faults.InjectedBug``)."""
    error: str
    """``Type: message``."""
    origin: str
    """``file:line`` of the innermost frame of project or user code (not torch, NVRx or the standard library)."""
    step: int | None
    """The step the rank was in (None: before its first step)."""
    occurrence: int = 1
    peak_rss_mb: float | None = None
    """An ``oom``'s peak resident memory of the rank in MiB (the kernel's, as the rank's parent saw it end)."""

    def describe(self) -> str:
        """One line for a person: which failure, where and how it was taken."""
        at = f"step {self.step}" if self.step is not None else "start-up"
        again = f", occurrence {self.occurrence}" if self.occurrence > 1 else ""
        where = f" at {self.origin}" if self.origin else ""  # an OOM kill has no line of code
        return f"{self.category} failure ({self.kind}) at {at} on rank {self.rank}: {self.error}{where}{again}"


@dataclass(frozen=True, kw_only=True)
class Fatal(Event):
    """An error no restart can fix, by the rank that met it, which then ends its job (exit code
    ``trainer.errors.FATAL_EXIT_CODE``). ``reason`` ``non_transient``: a full disk, a forbidden
    path, corrupt data; ``bug``: the same exception at the same ``step`` and ``origin`` came back
    after its retries (``--max-bug-retries``), or the loss turned NaN or Inf, with its
    ``traceback``. ``job``: the rendezvous id of that job; its launcher's later restarts of the
    ranks exit at once.
    """

    KIND: ClassVar[str] = "fatal"
    error: str
    job: str
    reason: str = "non_transient"
    """One of ``FATAL_REASONS``."""
    step: int | None = None
    origin: str | None = None
    traceback: str | None = None


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
        RunStart,
        Step,
        Checkpoint,
        CheckpointFailed,
        Mirror,
        MirrorFailed,
        MirrorRestore,
        RunWarning,
        FaultFired,
        Failure,
        Restart,
        Fatal,
        NodesPreempted,
        RunEnd,
        SystemSample,
    )
}
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
