"""Issue 2: real 2-rank FSDP training on CPU: learning, exact resume, torn checkpoints."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import ROOT, losses, rfsdp, train
from trainer.checkpoint import CHECKPOINTS, latest_checkpoint, read_full_state, verify_checkpoint
from trainer.events import Checkpoint, RunEnd, RunStart, RunWarning, read_events, select
from trainer.launch.local import RUN_DIR_LOCK


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_tensors(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_training_lowers_the_loss(baseline_60: Path) -> None:
    loss = losses(baseline_60)
    assert sorted(loss) == list(range(1, 61))
    assert sum(loss[s] for s in range(51, 61)) / 10 < loss[1] - 1.0
    events = read_events(baseline_60)
    assert [e.step for e in select(events, Checkpoint) if e.tier == "durable"] == [10, 20, 30, 40, 50, 60]
    assert isinstance(events[-1], RunEnd) and events[-1].status == "completed"
    # keep-last-3 retention and a verified latest
    assert latest_checkpoint(baseline_60).name == "step_000060"
    assert sorted(p.name for p in (baseline_60 / CHECKPOINTS).glob("step_*")) == [
        "step_000040",
        "step_000050",
        "step_000060",
    ]
    verify_checkpoint(latest_checkpoint(baseline_60))


def test_stop_and_resume_is_bitwise_exact(sync_resumed_60: Path, baseline_60: Path) -> None:
    run = sync_resumed_60  # stopped at step 30, resumed to 60
    assert [e.resumed_from_step for e in select(read_events(run), RunStart)] == [0, 30]
    assert losses(run) == losses(baseline_60)  # every step's final loss, bit for bit
    assert_same_tensors(
        read_full_state(run / CHECKPOINTS / "step_000060"), read_full_state(baseline_60 / CHECKPOINTS / "step_000060")
    )


def test_torn_checkpoint_is_skipped(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    """The reference run's two newest checkpoints are damaged; running it again resumes from the
    third, skipping both with warnings, and ends on the same trajectory."""
    run = tmp_path / "run"
    shutil.copytree(baseline_60, run)
    ckpts = run / CHECKPOINTS
    next(iter((ckpts / "step_000060").glob("__1_*.distcp"))).unlink()  # a shard removed
    shard = next(iter((ckpts / "step_000050").glob("__0_*.distcp")))
    shard.write_bytes(shard.read_bytes()[:-64])  # a shard truncated
    train(data_dir, run, "--steps", "60")
    events = read_events(run)
    skipped = [e for e in select(events, RunWarning) if e.kind == "checkpoint_skipped"]
    assert [e.step for e in skipped] == [60, 50]
    assert [e.resumed_from_step for e in select(events, RunStart)] == [0, 40]
    assert losses(run) == losses(baseline_60)
    verify_checkpoint(latest_checkpoint(run))


def test_bad_input_fails_before_training(data_dir: Path, tmp_path: Path) -> None:
    proc = rfsdp("train", "--data", str(data_dir), "--run-dir", str(tmp_path / "r"), "--model", "gigantic")
    assert proc.returncode == 2 and "--model" in proc.stderr and "Traceback" not in proc.stderr
    proc = rfsdp("train", "--data", str(tmp_path / "missing"), "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "--data" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_another_config_is_refused_and_nothing_is_touched(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    run = tmp_path / "copy"
    shutil.copytree(baseline_60, run)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    proc = rfsdp("train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), "--steps", "60", "--seed", "7")
    assert proc.returncode == 2 and "another training config" in proc.stderr and "seed" in proc.stderr
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_a_second_job_on_a_live_run_dir_is_refused_and_the_first_finishes_exact(
    data_dir: Path, baseline_60: Path, tmp_path: Path
) -> None:
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
        "60",
    ]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # The first job has claimed the run dir: seconds before its first step, so a test process
        # that the machine's load holds up for a while still finds it starting, not ended.
        lock = run / RUN_DIR_LOCK
        while not (lock.exists() and lock.read_text().startswith(f"pid {first.pid} ")):
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.05)
        # The first job is frozen while the second tries, so it is live whatever the machine's speed.
        pgrep = subprocess.run(["pgrep", "-f", f"--run-dir {run}"], capture_output=True, text=True)
        frozen = [int(pid) for pid in pgrep.stdout.split()]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = rfsdp(*cmd[3:], timeout=120)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert first.poll() is None, "the first job ended before the second was refused: nothing was tested"
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"--run-dir: {run} is in use by a live job (pid {first.pid} on " in second.stderr
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    events = read_events(run)
    assert len(select(events, RunStart)) == 1 and not select(events, RunWarning)  # the second job wrote nothing
    assert not list(run.rglob("*.invalid"))
    assert losses(run) == losses(baseline_60)
