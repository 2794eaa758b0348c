"""Issue 3: real faults under ft_launcher (2 CPU ranks): the right layer recovers each, and the
trajectory equals an uninterrupted run's bit for bit; async checkpoints are consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import losses, train
from tests.test_training import assert_same_tensors
from trainer.checkpoint import CHECKPOINTS, latest_checkpoint, read_full_state, verify_checkpoint
from trainer.events import read_events


def restarts(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == "restart"]


@pytest.mark.parametrize(
    ("fault", "layer"),
    [("exception@15:1", "in_process"), ("sigkill@15:0", "in_job"), ("hang@15:1", "in_job"), ("exit@15:1", "in_job")],
)
def test_each_fault_is_recovered_exactly(data_dir: Path, baseline_60: Path, tmp_path: Path, fault: str, layer: str) -> None:
    run = tmp_path / "run"
    train(data_dir, run, "--steps", "60", "--fault", fault)
    events = read_events(run)
    assert [(e["kind"], e["step"]) for e in events if e["event"] == "fault"] == [(fault.split("@")[0], 15)]
    (restart,) = restarts(run)
    assert restart["layer"] == layer
    assert restart["resumed_from_step"] == 10 and restart["lost_steps"] == 4 and restart["recovery_s"] > 0
    assert losses(run) == losses(baseline_60)


def test_exception_without_inprocess_falls_to_in_job(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data_dir, run, "--steps", "60", "--fault", "exception@15:1", "--no-inprocess-restart")
    assert [r["layer"] for r in restarts(run)] == ["in_job"]
    assert losses(run) == losses(baseline_60)


def test_all_four_faults_in_one_run(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(data_dir, run, "--steps", "60", "--fault", "exception@12:1,sigkill@23:0,hang@34:1,exit@45:0", "--max-restarts", "5", timeout=900)
    assert [r["layer"] for r in restarts(run)] == ["in_process", "in_job", "in_job", "in_job"]
    assert [r["attempt"] for r in restarts(run)] == [1, 2, 3, 4]
    assert losses(run) == losses(baseline_60)


def test_restarts_exhausted_keeps_last_good_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(data_dir, run, "--steps", "40", "--fault", "sigkill@15:0,sigkill@25:1", "--max-restarts", "1", check=False)
    assert proc.returncode == 1 and "failed" in proc.stderr
    events = read_events(run)
    assert events[-1]["event"] == "run_end" and events[-1]["status"] == "failed"
    assert latest_checkpoint(run).name == "step_000020"
    verify_checkpoint(latest_checkpoint(run))


def test_async_checkpoint_equals_state_at_its_step(data_dir: Path, baseline_60: Path, tmp_path: Path) -> None:
    """The async run keeps training while its step-30 checkpoint is written; the sync baseline's
    step-30 checkpoint is the state at that step (same deterministic trajectory)."""
    sync_run = tmp_path / "sync"
    train(data_dir, sync_run, "--steps", "60", "--stop-at-step", "30", "--ckpt-mode", "sync")
    async_ckpt = read_full_state(baseline_60 / CHECKPOINTS / "step_000040")
    train(data_dir, sync_run, "--steps", "60", "--stop-at-step", "40", "--ckpt-mode", "sync")
    assert_same_tensors(async_ckpt, read_full_state(sync_run / CHECKPOINTS / "step_000040"))
    modes = {e["mode"] for e in read_events(baseline_60) if e["event"] == "checkpoint"}
    assert modes == {"async"}


def test_sigkill_during_background_write_never_publishes_it(data_dir: Path, tmp_path: Path) -> None:
    """A larger model makes each async write take long enough that a kill right after the save
    was scheduled lands while the background worker is still writing."""
    run = tmp_path / "run"
    args = ("--model", "small", "--steps", "14", "--ckpt-every", "5", "--batch-size", "2")
    train(data_dir, run, *args, "--fault", "sigkill@11:1")
    events = read_events(run)
    fault_time = next(e["time"] for e in events if e["event"] == "fault")
    published_before = [e["step"] for e in events if e["event"] == "checkpoint" and e["time"] < fault_time]
    assert 10 not in published_before  # the kill hit the step-10 write before it was durable
    (restart,) = restarts(run)
    assert restart["resumed_from_step"] == 5
    for path in (run / CHECKPOINTS).glob("step_*"):
        assert ".tmp" not in path.name
        verify_checkpoint(path)
    assert torch.isfinite(torch.tensor(list(losses(run).values()))).all()
