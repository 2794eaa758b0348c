"""A run dir on a volume that fills up while training: the job ends for good with a ``fatal``
event, its events whole, instead of restarting into the same full volume.

The volume is a real 16 MiB tmpfs, mounted in a mount namespace of its own (root and
``unshare`` needed: the test skips elsewhere); a file fills whatever is left of it once the run
reached a chosen step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, need_a_mount_namespace
from trainer.errors import FATAL_EXIT_CODE
from trainer.events import EVENTS_FILE, Fatal, Restart, RunEnd, Step, corrupt_lines, read_events

FILL_AT_STEP = 12

# Runs inside the mount namespace, with the tmpfs at argv[1]: trains on it, fills it once the run
# reached FILL_AT_STEP, waits for `rfsdp train` and copies out what the test checks. No checkpoint
# is due before step 100: the ranks go on appending step events into the room left in the events
# file's last page, until an append finds none (the case of a volume with no room at all).
DRIVER = """
import json, shutil, subprocess, sys, time
from pathlib import Path
from trainer.events import Step, read_events

vol, data, out, fill_at = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
run = vol / "run"
train = subprocess.Popen(
    [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", data, "--run-dir", str(run), "--steps", "200",
     "--ckpt-every", "100", "--local-ckpt-every", "0", "--max-restarts", "2"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
)
while train.poll() is None and not any(e.step >= fill_at for e in read_events(run, [Step])):
    time.sleep(0.2)
filled = 0
with open(vol / "filler", "wb", buffering=0) as f:
    for chunk in (1 << 20, 1 << 16, 1 << 12, 1):  # to the last byte the volume gives
        try:
            while True:
                filled += f.write(b"x" * chunk)
        except OSError:
            pass
stdout, stderr = train.communicate(timeout=900)
out.mkdir(exist_ok=True)
for name in ("events.jsonl", "logs"):
    if (run / name).is_dir():
        shutil.copytree(run / name, out / name)
    elif (run / name).exists():
        shutil.copy(run / name, out / name)
(out / "result.json").write_text(json.dumps({"rc": train.returncode, "stdout": stdout, "stderr": stderr, \
"filled": filled}))
"""


def run_on_a_filling_volume(data_dir: Path, tmp_path: Path) -> dict:
    need_a_mount_namespace()
    vol, out = tmp_path / "vol", tmp_path / "out"
    vol.mkdir()
    script = 'mount -t tmpfs -o size=16m tmpfs "$1" && exec "$2" -c "$3" "$1" "$4" "$5" "$6"'
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(vol),
            sys.executable,
            DRIVER,
            str(data_dir),
            str(out),
            str(FILL_AT_STEP),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads((out / "result.json").read_text()), "out": out}


def test_a_full_volume_ends_the_job_with_a_fatal_event_not_a_restart_loop(data_dir: Path, tmp_path: Path) -> None:
    """The volume fills at step 12; the events file's own last page fills a few steps later. The
    rank whose append meets ENOSPC appends nothing of it and records ``fatal`` (from the room the
    events reserve holds), ft_launcher's restarts of the job exit at once, the launcher records
    the failed end without dying of its own write, and ``rfsdp train`` exits 3 naming the full
    volume. Every line of the events is whole (before: a torn last line, "will restart worker
    group" with every rank training again, and exit 1 from a traceback in the launcher)."""
    result = run_on_a_filling_volume(data_dir, tmp_path)
    out, err = result["out"], result["stderr"]
    assert result["filled"] > 0  # the filler took what was left
    assert result["rc"] == FATAL_EXIT_CODE, err[-3000:]
    assert "no restart can fix" in err and "No space left on device" in err and "Traceback" not in err, err[-3000:]
    raw = (out / EVENTS_FILE).read_bytes()
    assert raw.endswith(b"\n") and corrupt_lines(out) == []  # whole lines only
    events = read_events(out)
    fatal = [e for e in events if isinstance(e, Fatal)]
    assert fatal and all("[Errno 28]" in e.error and e.job == fatal[0].job for e in fatal)
    # No rank trained again: a restarted rank would meet the full volume again and write another
    # fatal (the reserve holds room for several); each rank of the first attempt wrote one at most.
    assert len({e.rank for e in fatal}) == len(fatal) <= 2
    assert not [e for e in events if isinstance(e, Restart)]
    assert max(e.step for e in events if isinstance(e, Step)) >= FILL_AT_STEP
    assert isinstance(events[-1], RunEnd) and (events[-1].status, events[-1].exit_code) == ("failed", FATAL_EXIT_CODE)
    # ft_launcher restarts any failure, within its budget (2); each restart exits at once.
    log = (out / "logs" / "replica_0.log").read_text(errors="replace")
    assert log.count("will restart worker group") <= 2


def test_a_full_dev_shm_ends_the_job_naming_it(data_dir: Path, tmp_path: Path) -> None:
    """The async writer's staging buffers live in /dev/shm. With no room there the job ends with
    one ``fatal`` that names /dev/shm (before: torch's path-less RuntimeError, read as a soft
    fault, restarted in process until the retries ran out, then the job failed with exit 1)."""
    need_a_mount_namespace()
    run = tmp_path / "run"
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"'
    train = [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", str(data_dir), "--run-dir", str(run)]
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            *train,
            "--steps",
            "12",
            "--ckpt-every",
            "6",
            "--ckpt-mode",
            "async",
            "--local-ckpt-every",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr[-3000:]
    assert "no room in /dev/shm" in proc.stderr
    events = read_events(run)
    (fatal, *_) = [e for e in events if isinstance(e, Fatal)]
    assert "[Errno 28]" in fatal.error and "'/dev/shm'" in fatal.error
    assert len([e for e in events if isinstance(e, Restart)]) <= 1  # at most the one that met the fatal at once


def test_the_fatal_event_is_written_when_stderr_is_full_too(tmp_path: Path) -> None:
    """A rank's stderr is a log on the run's volume: when that volume is full, the print of the
    fatal error fails as well. The event comes first, and the print's failure is ignored (in CI
    the print raised first, no ``fatal`` was written and the job exited 1 instead of 3). /dev/full
    stands in for the full log: every write to it fails with ENOSPC."""
    code = (
        "import sys; from pathlib import Path; from trainer.rank.train import end_job_fatally; "
        "end_job_fatally(Path(sys.argv[1]), OSError(28, 'No space left on device'))"
    )
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stderr=full, timeout=300)
    assert proc.returncode == FATAL_EXIT_CODE
    (fatal,) = [e for e in read_events(tmp_path) if isinstance(e, Fatal)]
    assert "No space left on device" in fatal.error
