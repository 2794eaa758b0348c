"""Issue 37, item 1: a bug is not an infrastructure fault. An exception that repeats at the same
step, and a loss that turns NaN, end the job after ``--max-bug-retries`` retries with a ``fatal``
event of reason ``bug``, instead of spending every in-process and in-job restart.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import ROOT, losses, train
from trainer.checkpoint import CHECKPOINTS
from trainer.errors import FATAL_EXIT_CODE, ParameterError
from trainer.events import EventLog, Failure, Fatal, FaultFired, Restart, RunStart, Step, read_events, select
from trainer.faults import parse_fault_spec
from trainer.rank.config import TrainConfig
from trainer.rank.failures import Failures, NonFiniteLoss, check_loss, classify, origin

RUN = ("--steps", "12", "--ckpt-every", "4")
BUG_LINE = next(n for n, line in enumerate((ROOT / "trainer/faults.py").read_text().splitlines(), 1) if "raise InjectedBug(" in line)


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:
        return e


# --------------------------------------------------------------------------- the rule, in one process


def test_the_rule_classifies_each_failure() -> None:
    assert classify(raised(ValueError("a bug"))) == ("bug", "exception")
    assert classify(raised(NonFiniteLoss("the loss is nan at step 7"))) == ("bug", "nonfinite_loss")
    assert classify(raised(dist.DistBackendError("NCCL communicator was aborted"))) == ("infrastructure", "collective")
    assert classify(raised(OSError(errno.EIO, "Input/output error"))) == ("infrastructure", "io")
    assert classify(raised(OSError(errno.ENOENT, "No such file"))) == ("bug", "exception")  # a path the code got wrong
    assert classify(raised(KeyboardInterrupt())) is None  # not an Exception: no failure of this rank's
    with pytest.raises(NonFiniteLoss, match="step 7"):
        check_loss(7, float("inf"))
    check_loss(7, 2.5)


def test_the_origin_is_the_innermost_frame_of_project_code() -> None:
    def ours() -> None:
        sorted([1, "a"])  # raises inside the standard library's C code: the frame is this line

    error = raised_from(ours)
    assert origin(error) == f"tests/test_bugs.py:{ours.__code__.co_firstlineno + 1}"
    stdlib = raised_from(lambda: __import__("json").loads("{"))  # raised deep inside json's own frames
    assert origin(stdlib).startswith("tests/test_bugs.py:")


def raised_from(fn) -> BaseException:  # noqa: ANN001
    try:
        fn()
    except BaseException as e:
        return e
    raise AssertionError("did not raise")


def test_occurrences_are_counted_per_rank_and_session_from_the_events(tmp_path: Path) -> None:
    EventLog(tmp_path, 0).emit(RunStart(config={}, resumed_from_step=0, world_size=2))
    failures = Failures(tmp_path, 1, max_bug_retries=1, job="j")
    failures.step = 6
    bug = raised(ValueError("the same bug"))
    assert failures.record(bug) is None  # the first: retried
    assert Failures(tmp_path, 0, max_bug_retries=1, job="j").record(raised(OSError(errno.EIO, "hiccup"))) is None
    fatal = Failures(tmp_path, 1, max_bug_retries=1, job="j")  # a new process (in-job restart) reads the same count
    fatal.step = 6
    end = fatal.record(bug)
    assert end is not None and (end.reason, end.step, end.job) == ("bug", 6, "j") and end.origin == origin(bug)
    assert "ValueError: the same bug" in end.traceback and "met 2 times" in end.error
    assert [(f.rank, f.category, f.occurrence) for f in select(read_events(tmp_path), Failure)] == [
        (1, "bug", 1), (0, "infrastructure", 1), (1, "bug", 2),
    ]  # fmt: skip
    EventLog(tmp_path, 0).emit(RunStart(config={}, resumed_from_step=4, world_size=2))  # a deliberate resume counts afresh
    assert failures.record(bug) is None


def test_bug_and_nan_faults_are_parsed_and_bad_values_named() -> None:
    assert [(f.kind, f.step, f.rank) for f in parse_fault_spec("bug@6:1,nan@7", steps=12, world_size=2)] == [("bug", 6, 1), ("nan", 7, 0)]
    with pytest.raises(ParameterError, match="^--fault: .*takes no /PHASE"):
        parse_fault_spec("bug@4/write:1", steps=12, world_size=2)
    with pytest.raises(ParameterError, match="^--max-bug-retries: must be at least 0"):
        TrainConfig(data="d", run_dir="r", max_bug_retries=-1)


# --------------------------------------------------------------------------- real 2-rank jobs


@pytest.fixture(scope="module")
def baseline_12(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("baseline_12") / "run"
    train(data_dir, run, *RUN)
    return run


@pytest.mark.slow
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
    assert [(f.rank, f.step, f.occurrence, f.origin) for f in bugs] == [(1, 6, 1, fatal.origin), (1, 6, 2, fatal.origin)]
    assert [f.step for f in select(events, FaultFired)] == [6, 6]  # fired twice: the first time and its one retry
    assert not select(events, Restart)  # nothing got past step 6
    after = events[events.index(fatal) :]
    assert not [e for e in after if isinstance(e, Step | FaultFired) or (isinstance(e, Failure) and e.category == "bug")]
    # ft_launcher restarts any failure within its budget (2); each restart sees the fatal and exits at once.
    log = (run / "logs" / "replica_0.log").read_text(errors="replace")
    assert log.count("will restart worker group") <= 2 and log.count("fatal, no restart can fix this") == 1


@pytest.mark.slow
def test_no_bug_retries_end_the_job_at_the_first_occurrence(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--fault", "bug@6:1", "--max-bug-retries", "0", check=False)
    assert proc.returncode == FATAL_EXIT_CODE, proc.stderr[-3000:]
    events = read_events(run)
    assert [(f.step, f.rank) for f in select(events, FaultFired)] == [(6, 1)]
    (fatal,) = select(events, Fatal)
    assert (fatal.reason, fatal.step, fatal.rank) == ("bug", 6, 1)


@pytest.mark.slow
def test_an_exception_that_fires_once_still_recovers_in_process_exactly(data_dir: Path, baseline_12: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(data_dir, run, *RUN, "--fault", "exception@6:1")
    events = read_events(run)
    assert [r.layer for r in select(events, Restart)] == ["in_process"]
    assert [(f.rank, f.category, f.step, f.occurrence) for f in select(events, Failure) if f.category == "bug"] == [(1, "bug", 6, 1)]
    assert not select(events, Fatal)
    assert losses(run) == losses(baseline_12)
    assert "failure, rank 1" in proc.stdout and "0 infrastructure, 1 bug" in proc.stdout  # the summary's tables


@pytest.mark.slow
def test_a_nan_loss_ends_the_job_and_no_checkpoint_after_it_is_published(data_dir: Path, baseline_12: Path, tmp_path: Path) -> None:
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
