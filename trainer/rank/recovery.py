"""What a starting rank reads of its run's events: the history a recovery is counted from
(:class:`RunHistory`), which layer brought this attempt back, and the ``restart`` event it writes.
Only rank 0 of a starting attempt asks (``trainer.rank.train``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from trainer.events import Event, FaultFired, NodesPreempted, Restart, RunEnd, RunStart, Step, iter_events


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
