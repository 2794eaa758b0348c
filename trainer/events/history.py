"""The questions other parts ask of a run's events: final losses, sessions, restarts, goodput."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from trainer.events.log import iter_events
from trainer.events.records import (
    FAILURE_CATEGORIES,
    RESTART_LAYERS,
    Checkpoint,
    CheckpointFailed,
    E,
    Event,
    Failure,
    Fatal,
    FaultFired,
    NodesPreempted,
    Restart,
    RunEnd,
    RunStart,
    Step,
)


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


def session_failures(events: Iterable[Event]) -> list[Failure]:
    """The ``failure`` events of the latest session (since the last ``run_start``), in order: what
    a suspected bug's retries are counted in, across in-process and in-job restarts alike (a
    deliberate resume, once the cause is fixed, starts counting again).
    """
    found: list[Failure] = []
    for e in events:
        if isinstance(e, RunStart):
            found = []
        elif isinstance(e, Failure):
            found.append(e)
    return found


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
    """The highest step of the attempt that ran last: since the last ``run_start``, or since
    the last ``restart``'s own attempt began (its first step, written right before it)."""
    last_step: int | None = None
    """The step of the last ``step`` event."""
    fault: FaultFired | NodesPreempted | None = None
    """The last ``fault`` (or ``nodes_preempted``: what the next recovery counts from) since the
    last ``restart`` or ``run_start`` (file order, no clock)."""
    last_step_time: dict[str, float] = dataclasses.field(default_factory=dict)
    """Host -> the time of its last ``step`` event."""
    last_step_time_before_fault: dict[str, float] = dataclasses.field(default_factory=dict)
    """``last_step_time`` as it was when :attr:`fault` was written."""

    KINDS: ClassVar[tuple[type[Event], ...]] = (Step, FaultFired, NodesPreempted, Restart, RunStart, RunEnd)
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
        elif isinstance(event, FaultFired | NodesPreempted):
            self.fault, self.last_step_time_before_fault = event, dict(self.last_step_time)
        elif isinstance(event, Restart | RunStart):
            self.fault = None
            if isinstance(event, Restart):
                self.restarts += 1
                self.restarts_in_session += 1
                self.max_step = self.last_step  # steps before it were the failed attempt's, counted by this restart
            else:
                self.restarts_in_session, self.session_open, self.max_step = 0, True, None
        elif isinstance(event, RunEnd):
            self.session_open = False


def read_history(run_dir: Path) -> RunHistory:
    """The :class:`RunHistory` of a run's ``events.jsonl``: only the lines of its kinds are parsed."""
    return RunHistory.of(iter_events(run_dir, RunHistory.KINDS))


def recovery_layer(history: RunHistory, *, in_process_attempt: int, in_job_restart: int) -> str | None:
    """Which layer brought this attempt of the trainer back (None: a fresh or deliberate start).

    A replica restarted by its supervisor (a pod's ``restartPolicy``, the netns harness) runs a
    fresh ft_launcher whose restart count is 0 again: it is recognised by the run it continues,
    whose last session never ended (a ``run_start`` after the last ``run_end``).
    """
    if in_process_attempt:
        return "in_process"
    if in_job_restart:
        return "in_job"
    return "in_job" if history.session_open else None


def describe_restart(
    history: RunHistory,
    *,
    layer: str,
    resumed_from: int,
    first_step: Step,
    marks: dict[str, float] | None = None,
    source: str = "durable",
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
        phases={
            **{k: t - start for k, t in (marks or {}).items() if t >= start},
            "first_step": first_step.time - start,
        },
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
        * ``failures_<category>``: the ``failure`` events of each class (``infrastructure``,
          ``bug``): exceptions the ranks met, one per rank that met one, and OOM kills.
        * ``oom_kills`` and ``oom_peak_rss_mb`` (the largest peak RSS of a rank the OOM killer ended).
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
    ooms = [e for e in select(events, Failure) if e.kind == "oom"]
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
        **{
            f"failures_{category}": sum(e.category == category for e in select(events, Failure))
            for category in FAILURE_CATEGORIES
        },
        **{f"restarts_{layer}": sum(e.layer == layer for e in restarts) for layer in RESTART_LAYERS},
        "oom_kills": len(ooms),
        "oom_peak_rss_mb": max((e.peak_rss_mb or 0.0 for e in ooms), default=None),
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
