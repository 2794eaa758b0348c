"""A background checkpoint writer that hangs (a stopped process, an NFS write that never returns)
does not stall training: the loop's wait for it is bounded, the writer counts as hung past the
bound, and the job recovers with an event that names it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT
from tests.reaper import TAG_ENV, alive
from trainer.events import CheckpointFailed, Restart, RunEnd, Step, read_events


def writer_processes() -> list[psutil.Process]:
    """This test's background checkpoint writers: the processes of its run at the lowest CPU
    priority (each rank's worker lowers its own, and what it forks inherits it; ranks never do)."""
    tag = os.environ[TAG_ENV]
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_ENV) == tag and alive(p.pid) and p.nice() == 19:
                found.append(p)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def steps_logged(run: Path) -> int:
    return max((e.step for e in read_events(run) if isinstance(e, Step)), default=0)


def test_a_stopped_writer_counts_as_hung_and_the_job_recovers(data_dir: Path, tmp_path: Path) -> None:
    """The ranks' writers are stopped (SIGSTOP) at step 12 of a run that saves every 5 steps.
    Before, the loop waited for them forever while heartbeats went on. Now the next wait for a
    write ends within its bound (the tiny model's state is small: the 10 s hang timeout), a
    ``checkpoint_failed`` event names the hung writer, the writers are killed, the job restarts
    with fresh ones and completes from the last published checkpoint."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", str(data_dir), "--run-dir", str(run)]
    proc = subprocess.Popen(
        [*command, "--steps", "40", "--ckpt-every", "5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stopped: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while steps_logged(run) < 12:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 12"
            time.sleep(0.05)
        stopped = writer_processes()
        assert len(stopped) >= 2, "each of the 2 ranks has a background writer"
        for p in stopped:
            p.send_signal(signal.SIGSTOP)
        out, _ = proc.communicate(timeout=300)  # before: no end, ever
    finally:
        for p in stopped:  # none is left stopped, whatever happened
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                continue
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    events = read_events(run)
    hung = [e for e in events if isinstance(e, CheckpointFailed) and "writer hung" in e.error]
    assert hung, [e for e in events if isinstance(e, CheckpointFailed)]
    assert hung[0].step in (10, 15, 20), hung[
        0
    ]  # a save in flight at step 12, or the one the stopped writers were given next
    assert [e for e in events if isinstance(e, Restart)]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in stopped), (
        "the hung writers were not ended"
    )
    (end,) = [e for e in events if isinstance(e, RunEnd)]
    assert (end.status, end.step, end.saved_step) == ("completed", 40, 40)
