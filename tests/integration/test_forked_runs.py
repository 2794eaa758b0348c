"""Ranks forked from the test's own process (trainer.launch.forked, validation's replay): they
train as launched ranks do, a failed rank ends the job at once, and the parent's exit handlers
stay the parent's."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.conftest import losses
from trainer.launch.forked import run_forked
from trainer.rank.config import TrainConfig


def config(data: Path, run: Path, **fields: object) -> TrainConfig:
    base = {"data": str(data), "run_dir": str(run), "steps": 6, "ckpt_every": 3, "ckpt_mode": "sync"}
    return TrainConfig.from_mapping(
        {**base, "inprocess_restart": False, "local_ckpt_every": 0, "local_replicas": 0, **fields}
    )


def test_forked_ranks_train_the_launched_trajectory_and_leave_the_parents_folders(
    data_dir: Path, baseline_60: Path, tmp_path: Path
) -> None:
    """The parent's temporary folder holds the run: a rank's exit, which runs its exit handlers,
    must not run the parent's (``TemporaryDirectory``'s would delete the folder under it)."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        run = Path(scratch) / "run"
        assert run_forked(config(data_dir, run, steps=60, stop_at_step=6), 2, run / "logs" / "forked.log") == 0
        assert losses(run) == {s: loss for s, loss in losses(baseline_60).items() if s <= 6}


def test_a_failed_rank_ends_the_job_with_its_code(data_dir: Path, tmp_path: Path) -> None:
    """Rank 1 raises at step 2; rank 0, waiting for it in the step's collective, is killed rather
    than waited for, and the job ends with the failed rank's code."""
    run, log = tmp_path / "run", tmp_path / "forked.log"
    assert run_forked(config(data_dir, run, fault="exception@2:1"), 2, log) != 0
    assert "exception" in log.read_text()
    assert max(losses(run), default=0) < 2
