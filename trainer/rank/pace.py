"""How long a training step may last before its rank counts as hung: a multiple of the run's own
recent step times, never below a floor, instead of one fixed timeout (docs/recovery.md, "Hangs").

A fixed timeout must allow for the slowest step any model may take, so a hang at the tiny model
cost 10 s of waiting. The run's pace knows better: a step that lasts four times the slowest of
the last twenty is stuck. The floor keeps scheduling noise, a garbage collection, or a rank
waiting for a peer that raised from counting as a hang: it is inside its step until the in-process
wrapper interrupts it (at most 1.0 s from the fault to the next step beside busy loops on every
core). A step so slow that its watch would reach ``hang_timeout`` is not watched at all: the
heartbeats, which also come from within each step, are then the tighter watch.
"""

from __future__ import annotations

from collections import deque

STEP_SECTION = "step"
"""The rank monitor's section that a watched step is inside (ft_launcher declares it)."""
PACE_MULTIPLE = 4.0
"""A step lasting this many times the slowest recent one counts as hung."""
PACE_FLOOR_S = 1.5
"""The shortest step watch, in seconds."""
PACE_WINDOW = 20
"""Recent steps the pace is taken from: a write in flight every ten steps is among them."""
PACE_WARMUP = 3
"""Steps timed before any is watched."""


class StepPace:
    """The recent step times of one attempt, and the watch they give the next step."""

    def __init__(self, ceiling: float) -> None:
        self.ceiling = ceiling
        self._times: deque[float] = deque(maxlen=PACE_WINDOW)

    def record(self, seconds: float) -> None:
        """A step completed in ``seconds``."""
        self._times.append(seconds)

    def watch(self) -> float | None:
        """Seconds the next step may last, or None: not watched (too few steps timed yet, or a
        watch that would not be shorter than the ceiling, the heartbeat timeout).
        """
        if len(self._times) < PACE_WARMUP:
            return None
        seconds = max(PACE_FLOOR_S, PACE_MULTIPLE * max(self._times))
        return seconds if seconds < self.ceiling else None
