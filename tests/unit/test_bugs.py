"""Issue 37, item 1: a bug is not an infrastructure fault. An exception that repeats at the same
step, and a loss that turns NaN, end the job after ``--max-bug-retries`` retries with a ``fatal``
event of reason ``bug``, instead of spending every in-process and in-job restart.

Here the rule, in this process; real jobs that meet a bug: tests/integration/test_bugs_runs.py.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer.errors import ParameterError
from trainer.events import EventLog, Failure, RunStart, read_events, select
from trainer.faults import parse_fault_spec
from trainer.rank.config import TrainConfig
from trainer.rank.failures import Failures, NonFiniteLoss, check_loss, classify, origin


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
    # A pending collective's Work.wait() raises gloo's error from C++: the frame is the caller's.
    reset = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:54947: Connection reset"
    assert classify(raised(RuntimeError(reset))) == ("infrastructure", "collective")
    mismatch = "[enforce fail at gloo/allreduce.cc:32] size mismatch"  # gloo, but no lost peer
    assert classify(raised(RuntimeError(mismatch))) == ("bug", "exception")
    assert classify(raised(RuntimeError("the connection to my database was reset"))) == ("bug", "exception")
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
    assert origin(error) == f"tests/unit/test_bugs.py:{ours.__code__.co_firstlineno + 1}"
    stdlib = raised_from(lambda: __import__("json").loads("{"))  # raised deep inside json's own frames
    assert origin(stdlib).startswith("tests/unit/test_bugs.py:")


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
        (1, "bug", 1),
        (0, "infrastructure", 1),
        (1, "bug", 2),
    ]
    EventLog(tmp_path, 0).emit(
        RunStart(config={}, resumed_from_step=4, world_size=2)
    )  # a deliberate resume counts afresh
    assert failures.record(bug) is None


def test_bug_and_nan_faults_are_parsed_and_bad_values_named() -> None:
    assert [(f.kind, f.step, f.rank) for f in parse_fault_spec("bug@6:1,nan@7", steps=12, world_size=2)] == [
        ("bug", 6, 1),
        ("nan", 7, 0),
    ]
    with pytest.raises(ParameterError, match="^--fault: .*takes no /PHASE"):
        parse_fault_spec("bug@4/write:1", steps=12, world_size=2)
    with pytest.raises(ParameterError, match="^--max-bug-retries: must be at least 0"):
        TrainConfig(data="d", run_dir="r", max_bug_retries=-1)
