"""The questions other parts ask of a run's events: final losses, sessions, restarts, goodput."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

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
