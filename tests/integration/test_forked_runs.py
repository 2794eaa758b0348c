"""Ranks forked from the test's own process (trainer.launch.forked, validation's replay): they
train as launched ranks do, a failed rank ends the job at once, and the parent's exit handlers
stay the parent's."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.conftest import losses
from trainer.launch.forked import TIMED_OUT, run_forked
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
        code = run_forked(
            config(data_dir, run, steps=60, stop_at_step=6), 2, run / "logs" / "forked.log", timeout_s=600
        )
        assert code == 0
        assert losses(run) == {s: loss for s, loss in losses(baseline_60).items() if s <= 6}


def test_a_failed_rank_ends_the_job_with_its_code(data_dir: Path, tmp_path: Path) -> None:
    """Rank 1 raises at step 2: the job ends, with a failed rank's code, and step 2 never completes."""
    run, log = tmp_path / "run", tmp_path / "forked.log"
    assert run_forked(config(data_dir, run, fault="exception@2:1"), 2, log, timeout_s=600) not in (0, TIMED_OUT)
    assert "exception" in log.read_text()
    assert max(losses(run), default=0) < 2


def test_a_hung_rank_is_killed_at_the_deadline(data_dir: Path, tmp_path: Path) -> None:
    """No launcher watches forked ranks: rank 1 blocks in C at step 2, rank 0 waits in the step's
    collective (its timeout, from a long hang timeout, is minutes away), and the deadline ends both."""
    run, log = tmp_path / "run", tmp_path / "forked.log"
    cfg = config(data_dir, run, fault="hang@2:1", hang_timeout=600.0)
    assert run_forked(cfg, 2, log, timeout_s=20) == TIMED_OUT
    assert "did not finish within 20 s" in log.read_text()
    assert max(losses(run), default=0) < 2
