"""Each failure a rank meets, classified: an infrastructure fault, or a suspected bug.

A suspected bug's retries are bounded. The rule is decided here and nowhere else
(docs/recovery.md, "Bugs and infrastructure faults"):

* A fault that never reaches Python (a signal, an OOM kill, a hang, a lost node) is
  infrastructure: the rank writes nothing, and NVRx's and ft_launcher's budgets
  (``--max-inprocess-restarts``, ``--max-restarts``) are its retries.
* An exception is **infrastructure** when it is known to be one: a collective or store that
  failed (a peer or link lost: ``torch.distributed``'s errors, gloo's and NCCL's transport
  errors raised inside ``torch.distributed``), or an OS error known to be transient
  (``trainer.errors.TRANSIENT_ERRNOS``). NVRx interrupting this rank for another's fault is no
  failure of this rank: nothing is written.
* Any other exception, and a loss that turns NaN or Inf (:class:`NonFiniteLoss`), is a
  suspected **bug**. Its signature is the exception's type, its origin (``file:line`` of the
  innermost frame of project or user code: not torch, NVRx or the standard library) and the
  step. Met again by the same rank at the same step, on a state resumed from before that step,
  it is the same bug: each signature gets ``max_bug_retries`` retries, and the occurrence after
  them ends the job, through the same door as an error no restart can fix (a ``fatal`` event,
  reason ``bug``; exit code ``FATAL_EXIT_CODE``, which neither ft_launcher nor the operator
  retries).
* Every failure is a ``failure`` event, and occurrences are counted from the events of the
  session: the count survives in-process restarts (the same process) and in-job restarts (new
  ones) alike.
"""

from __future__ import annotations

import contextlib
import math
import re
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.errors import TRANSIENT_ERRNOS
from trainer.events import EventLog, Failure, Fatal, RunStart, iter_events, session_failures

INFRASTRUCTURE, BUG = "infrastructure", "bug"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""Origins inside it are written relative to it (``trainer/faults.py:123``)."""
_THIS_FILE = str(Path(__file__).resolve())
_LIBRARY_PATHS = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)
_TRANSPORT = re.compile(r"connection|closed|reset|timed? ?out|abort|peer|socket|broken pipe|nccl|gloo", re.IGNORECASE)
"""What a collective's error says when its peer or link is gone (gloo: "Connection closed by peer")."""
_BACKEND = re.compile(r"gloo/transport/|ProcessGroupGloo|ProcessGroupNCCL")
"""Where the collective's backend itself raised: its source path or class in the message."""


class NonFiniteLoss(RuntimeError):
    """The loss turned NaN or Inf: a bug of the model, the data or the hyperparameters."""


def check_loss(step: int, loss: float) -> None:
    """Raise :class:`NonFiniteLoss` naming ``step`` when ``loss`` is NaN or Inf: before the
    step is logged or checkpointed, so no checkpoint made after it is ever published.
    """
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"the loss is {loss} at step {step}")


def poison_parameters(module: torch.nn.Module) -> None:
    """Turn this rank's shard of every parameter NaN (the ``nan`` fault)."""
    with torch.no_grad():
        for p in module.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))


def classify(error: BaseException) -> tuple[str, str] | None:
    """(category, kind) of an exception that ended this rank's attempt, or None when it is no
    failure of this rank (NVRx interrupting it for another's fault, an exit, an interrupt).
    """
    if not isinstance(error, Exception) or type(error).__module__.startswith("nvidia_resiliency_ext"):
        return None
    if isinstance(error, NonFiniteLoss):
        return BUG, "nonfinite_loss"
    if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and _raised_in_collective(error)):
        return INFRASTRUCTURE, "collective"
    if isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS:
        return INFRASTRUCTURE, "io"
    return BUG, "exception"


def _raised_in_collective(error: BaseException) -> bool:
    """A lost peer or link, raised in torch.distributed's Python code or, through a pending
    collective's ``Work.wait()`` (C++: the innermost Python frame is the caller's), by the backend.
    """
    frames = traceback.extract_tb(error.__traceback__)
    message = str(error)
    in_torch = bool(frames) and "/torch/distributed/" in frames[-1].filename
    return (in_torch or bool(_BACKEND.search(message))) and bool(_TRANSPORT.search(message))


def origin(error: BaseException) -> str:
    """``file:line`` of the innermost frame of project or user code in ``error``'s traceback (the
    innermost frame of all when none is; this module's own are skipped, so a NaN loss names the
    line of the loop that met it); paths in this project are relative to its root.
    """
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if _user_code(f.filename)]
    frame = (ours or frames)[-1]
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(PROJECT_ROOT)
    return f"{path}:{frame.lineno}"


def _user_code(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    resolved = str(Path(filename).resolve())
    return "-packages/" not in resolved and not resolved.startswith(_LIBRARY_PATHS) and resolved != _THIS_FILE


class Failures:
    """This rank's record of failures: :attr:`step` is kept by the training loop; :meth:`record`
    classifies a failure, writes its ``failure`` event and says whether it ends the job.
    """

    def __init__(self, run_dir: Path, rank: int, *, max_bug_retries: int, job: str) -> None:
        self.run_dir, self.rank, self.max_bug_retries, self.job = Path(run_dir), rank, max_bug_retries, job
        self.step: int | None = None
        """The step the rank is in (None: before its first step)."""

    def record(self, error: BaseException) -> Fatal | None:
        """Classify ``error`` and write its ``failure`` event; returns the ``fatal`` event that
        ends the job when it is a bug past its retries, else None (the restarts go on).
        """
        kind = classify(error)
        if kind is None:
            return None
        category, what = kind
        error_type = f"{type(error).__module__}.{type(error).__qualname__}"
        where = origin(error)
        before = [
            f
            for f in self._session()
            if (f.rank, f.error_type, f.origin, f.step) == (self.rank, error_type, where, self.step)
        ]
        failure = Failure(
            category=category,
            kind=what,
            error_type=error_type,
            error=f"{type(error).__name__}: {error}",
            origin=where,
            step=self.step,
            occurrence=len(before) + 1,
        )
        with contextlib.suppress(OSError):  # a full volume: the error itself says what to do
            EventLog(self.run_dir, self.rank).emit(failure)
        if category != BUG or failure.occurrence <= self.max_bug_retries:
            return None
        at, met = f"step {self.step}" if self.step is not None else "start-up", failure.occurrence
        times = f"met {met} time{'s' * (met > 1)}, --max-bug-retries {self.max_bug_retries}"
        return Fatal(
            error=f"suspected bug at {at}, {where}: {failure.error} ({times})",
            job=self.job,
            reason=BUG,
            step=self.step,
            origin=where,
            traceback="".join(traceback.format_exception(error)),
        )

    def _session(self) -> Iterator[Failure]:
        try:
            yield from session_failures(iter_events(self.run_dir, [RunStart, Failure]))
        except OSError:  # unreadable: this failure counts as the first
            return
