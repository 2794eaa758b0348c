"""Errors every layer shares: a bad parameter (named the way the caller's user wrote it), and
an error no restart can fix.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Literal

FATAL_EXIT_CODE = 3
"""A rank's (and ``rfsdp train``'s) exit code for an error no restart can fix. Below 128, so the
training operator's ``restartPolicy: ExitCode`` treats it as permanent."""
PREEMPTED_EXIT_CODE = 4
"""A rank's exit code when its node, and not every node, was asked to stop: non-zero, so its pod
ends Failed and is replaced (an evicted pod that exits 0 would complete an elastic job)."""
REJOIN_EXIT_CODE = 5
"""A rank's exit code when other nodes were asked to stop and its own was not: its launcher
restarts it into the rendezvous, which waits for their replacements."""
NON_TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""OS errors whose cause is outside the job (a full disk, a read-only or forbidden path)."""
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.EBUSY,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ESTALE,
        errno.EPIPE,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EHOSTUNREACH,
        errno.EHOSTDOWN,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
        errno.ENOLINK,
        errno.ECOMM,
    }
)
"""OS errors of a storage or network path that a retry may not meet again (a volume or link that
hiccupped): an infrastructure fault, never taken for a bug (``trainer.rank.failures``)."""


class ParameterError(ValueError):
    """A bad parameter value, refused before anything starts.

    ``field`` is the config field (``ckpt_every``). The message names it as a command-line flag
    (``--ckpt-every: ...``) or, raised again by :func:`as_pipeline_parameters`, as the pipeline
    parameter of the same name (``ckpt_every: ...``).
    """

    def __init__(self, field: str, problem: str, *, style: Literal["flag", "parameter"] = "flag") -> None:
        self.field = field
        self.problem = problem
        self.style = style
        name = "--" + field.replace("_", "-") if style == "flag" else field
        super().__init__(f"{name}: {problem}")


@contextlib.contextmanager
def as_pipeline_parameters() -> Iterator[None]:
    """Inside, a :class:`ParameterError` names its field as a pipeline parameter."""
    try:
        yield
    except ParameterError as e:
        if e.style == "parameter":
            raise
        raise ParameterError(e.field, e.problem, style="parameter") from None


class NonTransientError(Exception):
    """An error whose cause is outside the job (corrupt input data, for example): restarting
    the job cannot fix it, so the job ends instead of restarting in a loop.
    """


def non_transient_cause(error: BaseException) -> BaseException | None:
    """The error in ``error``'s chain that no restart can fix, or None when a restart may help.

    Follows ``__cause__`` and ``__context__``, and the per-rank failures of PyTorch DCP's
    ``CheckpointException`` (``failures``: rank -> (exception, traceback)).
    """
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, NonTransientError) or (isinstance(e, OSError) and e.errno in NON_TRANSIENT_ERRNOS):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            found = (f[0] if isinstance(f, tuple) and f else f for f in failures.values())
            todo += [f for f in found if isinstance(f, BaseException)]
    return None
