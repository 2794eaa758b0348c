"""The step watch: hangs found from the run's own pace (trainer.rank.pace), set on ft_launcher's
rank monitor through NVRx's client (trainer.rank.resilience.monitor)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from trainer.rank.config import TrainConfig
from trainer.rank.pace import PACE_FLOOR_S, PACE_MULTIPLE, PACE_WARMUP, PACE_WINDOW, STEP_SECTION, StepPace


def test_a_step_is_watched_once_timed_at_a_multiple_of_the_slowest_recent_one_never_below_the_floor() -> None:
    pace = StepPace(ceiling=10.0)
    for _ in range(PACE_WARMUP - 1):
        pace.record(0.05)
        assert pace.watch() is None  # warming up
    pace.record(0.05)
    assert pace.watch() == PACE_FLOOR_S  # 4 x 0.05 s is below the floor
    pace.record(1.0)
    assert pace.watch() == PACE_MULTIPLE * 1.0  # the slowest recent step sets it
    for _ in range(PACE_WINDOW - 1):
        pace.record(0.05)
    assert pace.watch() == PACE_MULTIPLE * 1.0  # still among the recent ones
    pace.record(0.05)
    assert pace.watch() == PACE_FLOOR_S  # out of the window


def test_a_step_whose_watch_would_reach_the_heartbeat_timeout_is_not_watched() -> None:
    """Slow steps (a large model on CPU) are left to the heartbeats from within each step."""
    pace = StepPace(ceiling=10.0)
    for seconds in (2.0, 2.4, 2.5):
        pace.record(seconds)
    assert pace.watch() is None
    assert StepPace(ceiling=PACE_FLOOR_S).watch() is None


class _RecordingClient:
    """What the rank monitor is sent, in order (NVRx's RankMonitorClient, as RankMonitor calls it)."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []
        self.atomic = False  # inside the wrapper's atomic: no interruption can split a message

    @contextlib.contextmanager
    def in_atomic(self) -> Iterator[None]:
        self.atomic = True
        try:
            yield
        finally:
            self.atomic = False

    def _send(self, *message: object) -> None:
        assert self.atomic, message
        self.sent.append(message)

    def _set_calculated_timeouts(self, new_hb_timeouts, new_section_timeouts) -> None:
        self._send("timeouts", new_hb_timeouts, dict(new_section_timeouts.section))

    def start_section(self, section: str) -> None:
        self._send("open", section)

    def end_all_sections(self) -> None:
        self._send("close all")

    def send_heartbeat(self) -> None:
        self._send("heartbeat")


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> _RecordingClient:
    from trainer.rank.resilience import RankMonitor

    recording = _RecordingClient()
    monkeypatch.setattr(RankMonitor, "_client", recording)
    return recording


def test_the_rank_monitor_watches_steps_once_timed_and_the_abort_ends_the_watch(
    client: _RecordingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.rank.resilience import RankMonitor
    from trainer.rank.resilience import monitor as monitor_module

    clock = iter(float(t) / 100 for t in range(10_000))  # each step lasts 0.01 s
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: next(clock))
    monitor = RankMonitor(ceiling=10.0, atomic=client.in_atomic, wrapped=True)
    assert client.sent == [("close all",)]  # what an earlier attempt of this process left open
    client.sent.clear()
    with monitor.step(timed=False):  # an attempt's first step: neither watched nor timed
        pass
    for _ in range(PACE_WARMUP):
        with monitor.step():
            pass
    assert client.sent == [] and monitor.watched == 0
    for _ in range(2):
        with monitor.step():
            pass
    # The watch is sent once, as it does not move; each watched step opens and closes the section.
    watch = ("timeouts", None, {STEP_SECTION: PACE_FLOOR_S})
    step = [("open", STEP_SECTION), ("close all",)]
    assert client.sent == [watch, *step, *step]
    client.sent.clear()
    with pytest.raises(RuntimeError), monitor.step():
        raise RuntimeError("a fault: the wrapper's abort ends the watch (RankMonitor.relax)")
    assert client.sent == [("open", STEP_SECTION)] and monitor.watched == 3  # nothing sent as it raised
    client.atomic = True  # the abort holds atomic
    RankMonitor.relax()
    assert client.sent[-1] == ("close all",)
    client.atomic = False
    # Without the wrapper nothing interrupts: the watch ends as the exception leaves the step.
    unwrapped = RankMonitor(ceiling=10.0, atomic=client.in_atomic, wrapped=False)
    for _ in range(PACE_WARMUP):
        with unwrapped.step():
            pass
    client.sent.clear()
    with pytest.raises(RuntimeError), unwrapped.step():
        raise RuntimeError("no in-process restart: the rank exits, with its own exit code")
    assert client.sent[-2:] == [("open", STEP_SECTION), ("close all",)]
    monitor.heartbeat()
    assert client.sent[-1] == ("heartbeat",)


def test_ft_launcher_declares_the_step_section_with_no_timeout_until_a_rank_sets_one() -> None:
    from trainer.launch.local import worker_command

    argv = worker_command(TrainConfig(data="d", run_dir="r"))
    assert argv[argv.index("--ft-rank-section-timeouts") + 1] == f"{STEP_SECTION}:none"
    assert float(argv[argv.index("--ft-workload-check-interval") + 1]) < PACE_FLOOR_S / 10


def test_the_step_watch_refuses_an_nvrx_whose_client_internals_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    from trainer.errors import NonTransientError
    from trainer.rank.resilience.monitor import check_nvrx_internals

    check_nvrx_internals()  # the pinned NVRx
    monkeypatch.setattr(RankMonitorClient, "_set_calculated_timeouts", lambda self, hb, sections, extra: None)
    with pytest.raises(NonTransientError, match=r"checked against \(0\.4\.1\): .*_set_calculated_timeouts"):
        check_nvrx_internals()
