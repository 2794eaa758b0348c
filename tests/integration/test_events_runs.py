"""The event log against other processes: an append waits for another process's lock, a short
write leaves nothing, real writers killed mid-write leave every complete event readable. The
contract itself: tests/unit/test_events.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import ROOT as REPO
from trainer.events import (
    EVENTS_FILE,
    EventLog,
    FaultFired,
    RunEnd,
    RunStart,
    Step,
    corrupt_lines,
    read_events,
)


def test_an_event_is_appended_under_the_file_lock(tmp_path: Path) -> None:
    """Another process (another host over NFS) holding the lock keeps the append waiting."""
    log = EventLog(tmp_path, rank=0)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=1))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, os, sys; fd = os.open({str(log.path)!r}, os.O_WRONLY); fcntl.lockf(fd, fcntl.LOCK_EX); "
            "print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    writer = threading.Thread(target=log.emit, args=(Step(step=1, loss=1.0, step_time_s=0.1),))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and [type(e) for e in read_events(tmp_path)] == [RunStart]
    holder.stdin.close()  # the holder exits: its lock goes with it
    holder.wait(10)
    writer.join(10)
    assert [type(e) for e in read_events(tmp_path)] == [RunStart, Step]


def test_an_append_is_whole_or_absent(tmp_path: Path) -> None:
    """A write the file system cuts short (here the file size limit, RLIMIT_FSIZE: a short write,
    then EFBIG, as a full volume gives a short write, then ENOSPC) leaves the file as it was and
    raises an error that names it."""
    log = EventLog(tmp_path, rank=0)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=1))
    before = log.path.read_bytes()
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from trainer.events import EventLog, Step\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 20}, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    EventLog(Path({str(tmp_path)!r}), 0).emit(Step(step=1, loss=1.0, step_time_s=0.1))\n"
        "except OSError as e:\n"
        "    print(e)\n"
        "    sys.exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert str(log.path) in proc.stdout  # the error names the file
    assert log.path.read_bytes() == before  # nothing of the event: not even its first 20 bytes


def test_a_torn_line_right_before_run_end_leaves_the_outcome_readable(data_dir: Path, tmp_path: Path) -> None:
    """Real writers killed mid-write: the ``corrupt-event`` fault tears a line (no newline, not
    UTF-8) before step 3's event; once rank 1 hangs at step 5 (nobody writes), a process holding
    the lock writes half a line and is SIGKILLed; then rank 1 is killed and, with no restart left,
    the launcher's ``run_end`` follows the torn line. Every complete event is read, the torn lines
    stand alone, and the summary reads the file (before, both glued events were lost and a
    non-UTF-8 byte crashed the readers)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--quiet",
        "--data",
        str(data_dir),
        "--run-dir",
        str(run),
        "--steps",
        "40",
        "--fault",
        "corrupt-event@3,hang@5:1",
        "--no-inprocess-restart",
        "--max-restarts",
        "0",
        "--hang-timeout",
        "3600",
    ]
    # (the hang is ended by the kill below, never by its timeout)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not any(isinstance(e, FaultFired) and e.kind == "hang" for e in read_events(run)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        writer = subprocess.run(
            [
                sys.executable,
                "-c",
                "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); "
                "fcntl.lockf(fd, fcntl.LOCK_EX); os.write(fd, sys.argv[2].encode()); "
                "os.kill(os.getpid(), signal.SIGKILL)",
                str(run / EVENTS_FILE),
                '{"event": "system", "node": 0, "metrics": {"cpu',
            ],
            timeout=60,
        )
        assert writer.returncode == -signal.SIGKILL
        os.kill(_worker_of_rank(proc.pid, 1), signal.SIGKILL)  # the hung rank: the job fails, no restart left
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    events = read_events(run)
    assert isinstance(events[-1], RunEnd) and events[-1].status == "failed", events[-3:]
    assert 3 in {e.step for e in events if isinstance(e, Step)}  # the event written after the fault's torn line
    raw = (run / EVENTS_FILE).read_bytes()
    assert raw.endswith(b"\n")
    torn = corrupt_lines(run)
    assert len(torn) == 2 and len(raw.split(b"\n")) - 1 == len(events) + 2  # each torn line on its own
    show = (
        "from pathlib import Path; from trainer.results.summary import print_run_summary; "
        f"print_run_summary(Path({str(run)!r}))"
    )
    summary = subprocess.run([sys.executable, "-c", show], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0 and f"2 skipped (line {torn[0]}, {torn[1]})" in summary.stdout, summary.stderr


def _worker_of_rank(train_pid: int, rank: int) -> int:
    """The pid of the worker process ft_launcher started for ``rank`` (its direct child)."""
    for launcher in _children(train_pid):
        if b"trainer.launch.agent" not in Path(f"/proc/{launcher}/cmdline").read_bytes():
            continue
        for pid in _children(launcher):
            with contextlib.suppress(OSError):
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
    raise AssertionError(f"no worker of rank {rank} under {train_pid}")


def _children(pid: int) -> list[int]:
    return [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
