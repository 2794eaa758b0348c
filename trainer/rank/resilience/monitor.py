"""ft_launcher's rank monitor (in-job restart on hangs): a rank's heartbeats, and the watch on each
training step taken from the run's pace (:mod:`trainer.rank.pace`), through NVRx's
fault-tolerance client.

The step watch is a section of the rank monitor ("step") whose timeout is set at run time. NVRx's
public way to set one (``calculate_and_set_section_timeouts``) takes the longest time seen times a
safety factor, with no floor: after a few short steps it gives tiny timeouts (docs/recovery.md,
"Hangs"). So the timeout goes through the client's ``_set_calculated_timeouts``, the call the
public one ends in. Checked against NVRx 0.4.1 (:func:`check_nvrx_internals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from collections.abc import Callable, Iterator

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from nvidia_resiliency_ext.fault_tolerance.data import SectionTimeouts

from trainer.rank.pace import STEP_SECTION, StepPace
from trainer.rank.resilience.nvrx_version import refuse_moved_internals

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


def check_nvrx_internals() -> None:
    """Raise :class:`NonTransientError`, naming both versions, where the installed NVRx's client
    sets timeouts otherwise than the step watch was checked against.
    """
    changed = []
    setter = getattr(RankMonitorClient, "_set_calculated_timeouts", None)
    if not callable(setter) or list(inspect.signature(setter).parameters) != [
        "self",
        "new_hb_timeouts",
        "new_section_timeouts",
    ]:
        changed.append("RankMonitorClient._set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts)")
    if {"section", "out_of_section"} - {f.name for f in dataclasses.fields(SectionTimeouts)}:
        changed.append("SectionTimeouts(section, out_of_section)")
    refuse_moved_internals("the step watch", changed, "trainer/rank/resilience/monitor.py")


class RankMonitor:
    """Heartbeats and step watches to ft_launcher's rank monitor; inert when not running under
    ft_launcher. One per attempt: each attempt times its own steps (``ceiling``: the heartbeat
    timeout), while the connection is the process's.
    """

    _client: RankMonitorClient | None = None  # one connection per process, across in-process restarts

    def __init__(
        self,
        ceiling: float = float("inf"),
        atomic: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        *,
        wrapped: bool = False,
    ) -> None:
        # Every message goes inside the in-process wrapper's ``atomic``: an interruption raised in
        # the middle of one would leave half a reply on the socket, and the next read would wait for
        # bytes that never come.
        self._atomic, self._wrapped = atomic, wrapped
        with atomic():
            if RankMonitor._client is None and os.environ.get(FT_SOCKET_ENV):
                check_nvrx_internals()
                RankMonitor._client = RankMonitorClient()
                RankMonitor._client.init_workload_monitoring()
            elif RankMonitor._client is not None:
                RankMonitor._client.end_all_sections()  # a step the last attempt left open watches no more
        self.pace = StepPace(ceiling)
        self._watch: float | None = None  # the step section's timeout the rank monitor holds now
        self.watched = 0  # steps watched so far in this attempt

    def stop(self) -> None:
        """Stop being monitored: training is over, and closing down (final uploads, interpreter
        exit) must not count as a hang.
        """
        if RankMonitor._client is not None:
            RankMonitor._client.shutdown_workload_monitoring()
            RankMonitor._client = None

    @classmethod
    def relax(cls) -> None:
        """End this process's step watch: an in-process restart has begun, and its time is no
        step's. For the wrapper's abort, which holds ``atomic``: no message is half sent.
        """
        if cls._client is not None:
            cls._client.end_all_sections()

    def heartbeat(self) -> None:
        """Send the monitor a heartbeat: this rank still makes progress."""
        if self._client is not None:
            with self._atomic():
                self._client.send_heartbeat()

    @contextlib.contextmanager
    def step(self, *, timed: bool = True) -> Iterator[None]:
        """A training step, watched at the run's pace once it has one: a rank that stays inside
        longer is hung, and the rank monitor ends it. ``timed``: the step's time counts in the pace
        (not an attempt's first step, which warms up).

        Under the in-process wrapper (``wrapped``), a step that raises sends nothing more: the
        wrapper's abort ends the watch (:meth:`relax`). A message sent as the wrapper interrupts
        the rank was taken by NVRx's restart for a second interruption (``exit_ex``), and the
        attempt waited out the heartbeat timeout. Without it nothing interrupts, and the watch
        ends at once: the rank's way out (its failure recorded, its exit code) is its own.
        """
        watch = self.pace.watch() if self._client is not None else None
        if watch is not None:
            with self._atomic():
                self._set_watch(watch)
                self._client.start_section(STEP_SECTION)
            self.watched += 1
        began = time.perf_counter()
        try:
            yield
        except BaseException:
            if watch is not None and not self._wrapped:
                with self._atomic():
                    self._client.end_all_sections()
            raise
        if watch is not None:
            with self._atomic():  # (all of them: the abort may have ended it already)
                self._client.end_all_sections()
        if timed:
            self.pace.record(time.perf_counter() - began)

    @property
    def watch_s(self) -> float | None:
        """The step watch last set, in seconds (None: no step watched yet in this attempt)."""
        return self._watch

    def unwatch(self) -> None:
        """End the watch of the step in progress: what follows in it is not the step's own time."""
        if self._client is not None:
            with self._atomic():
                self._client.end_all_sections()

    def _set_watch(self, seconds: float) -> None:
        # A message only when the watch moves by a tenth: most steps send none.
        if self._watch is not None and abs(seconds - self._watch) <= 0.1 * self._watch:
            return
        self._client._set_calculated_timeouts(None, SectionTimeouts(section={STEP_SECTION: seconds}))
        self._watch = seconds

    def state_dict(self) -> dict:
        """The monitor client's state (kept in every checkpoint)."""
        return dict(self._client.state_dict()) if self._client is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        if self._client is not None and state:
            with self._atomic():
                self._client.load_state_dict(state)
