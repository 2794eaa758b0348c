"""Issue 37, item 1: a bug is not an infrastructure fault. An exception that repeats at the same
step, and a loss that turns NaN, end the job after ``--max-bug-retries`` retries with a ``fatal``
event of reason ``bug``, instead of spending every in-process and in-job restart.

Here real jobs (`rfsdp train`); the rule in this process: tests/unit/test_bugs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT, losses, train
from trainer.checkpoint import CHECKPOINTS
from trainer.errors import FATAL_EXIT_CODE
from trainer.events import Failure, Fatal, FaultFired, Restart, RunStart, Step, read_events, select

RUN = ("--steps", "12", "--ckpt-every", "4")
BUG_LINE = next(
    n for n, line in enumerate((ROOT / "trainer/faults.py").read_text().splitlines(), 1) if "raise InjectedBug(" in line
)


# --------------------------------------------------------------------------- real 2-rank jobs


@pytest.fixture(scope="module")
def baseline_12(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("baseline_12") / "run"
    train(data_dir, run, *RUN)
    return run


def test_a_repeated_exception_ends_the_job_as_a_bug_after_one_retry(data_dir: Path, tmp_path: Path) -> None:
    """``bug@6:1`` raises at step 6 every time. One retry (in-process), then rank 1 ends the job:
    ``fatal`` of reason ``bug`` naming step 6, rank 1 and the line; ``rfsdp train`` exits 3 and no
    rank trains again (before: every in-process restart, then every in-job restart, then exit 1)."""
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--fault", "bug@6:1", "--max-restarts", "2", check=False)
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr[-3000:]
    assert "suspected bug at step 6" in proc.stderr
    events = read_events(run)
    (fatal,) = select(events, Fatal)
    assert (fatal.reason, fatal.step, fatal.rank, fatal.origin) == ("bug", 6, 1, f"trainer/faults.py:{BUG_LINE}")
    assert "InjectedBug: injected bug at step 6" in fatal.traceback
    bugs = [f for f in select(events, Failure) if f.category == "bug"]
    assert [(f.rank, f.step, f.occurrence, f.origin) for f in bugs] == [
        (1, 6, 1, fatal.origin),
        (1, 6, 2, fatal.origin),
    ]
    assert [f.step for f in select(events, FaultFired)] == [6, 6]  # fired twice: the first time and its one retry
    assert not select(events, Restart)  # nothing got past step 6
    after = events[events.index(fatal) :]
    assert not [
        e for e in after if isinstance(e, Step | FaultFired) or (isinstance(e, Failure) and e.category == "bug")
    ]
    # ft_launcher restarts any failure within its budget (2); each restart sees the fatal and exits at once.
    log = (run / "logs" / "replica_0.log").read_text(errors="replace")
    assert log.count("will restart worker group") <= 2 and log.count("fatal, no restart can fix this") == 1


def test_no_bug_retries_end_the_job_at_the_first_occurrence(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--fault", "bug@6:1", "--max-bug-retries", "0", check=False)
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr[-3000:]
    events = read_events(run)
    assert [(f.step, f.rank) for f in select(events, FaultFired)] == [(6, 1)]
    (fatal,) = select(events, Fatal)
    assert (fatal.reason, fatal.step, fatal.rank) == ("bug", 6, 1)


def test_an_exception_that_fires_once_still_recovers_in_process_exactly(
    data_dir: Path, baseline_12: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--fault", "exception@6:1")
    events = read_events(run)
    assert [r.layer for r in select(events, Restart)] == ["in_process"]
    assert [(f.rank, f.category, f.step, f.occurrence) for f in select(events, Failure) if f.category == "bug"] == [
        (1, "bug", 6, 1)
    ]
    assert not select(events, Fatal)
    assert losses(run) == losses(baseline_12)
    assert "failure, rank 1" in proc.stdout and "0 infrastructure, 1 bug" in proc.stdout  # the summary's tables


def test_a_nan_loss_ends_the_job_and_no_checkpoint_after_it_is_published(
    data_dir: Path, baseline_12: Path, tmp_path: Path
) -> None:
    """The loss turns NaN at step 8, a checkpoint step (sync saves: step 4's is published at once).
    The job ends as ``bug`` naming step 8, step 8 is neither logged nor saved, and the run resumes
    from before it to the baseline's trajectory (before: NaN losses to the end, step 8's
    checkpoint of NaN weights published, exit 0)."""
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--ckpt-mode", "sync", "--fault", "nan@8:1", check=False)
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr[-3000:]
    events = read_events(run)
    fatal = select(events, Fatal)
    assert fatal and {(f.reason, f.step) for f in fatal} == {("bug", 8)}
    assert fatal[0].origin.startswith("trainer/rank/train.py:") and "NonFiniteLoss" in fatal[0].traceback
    assert {f.kind for f in select(events, Failure) if f.category == "bug"} == {"nonfinite_loss"}
    assert max(losses(run)) == 7
    assert sorted(p.name for p in (run / CHECKPOINTS).glob("step_*")) == ["step_000004"]
    train(data_dir, run, *RUN, "--ckpt-mode", "sync")  # the cause fixed (no fault): resumed from before step 8
    assert select(read_events(run), RunStart)[-1].resumed_from_step < 8
    assert losses(run) == losses(baseline_12)
