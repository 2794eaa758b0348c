"""Process lifetime helpers shared by the launcher and the ranks."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "RFSDP_LAUNCHER_PID"
"""The pid of a rank's launcher, set by the worker that started the rank (``trainer.launch.worker``)."""


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux), so nothing
    outlives the process that started it: a launcher killed outright still stops its children.
    """
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def launcher_pid() -> int:
    """The pid of this rank's launcher (ft_launcher's agent, torchrun's): named by the worker that
    asked the zygote for this rank (:data:`LAUNCHER_PID_ENV`), else this process's parent (a
    forked rank's parent is the zygote).
    """
    return int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (niceness 19); the threads and processes it
    starts afterwards inherit it (Linux: niceness is per thread). For background work that has
    until its deadline, so that on cores the ranks keep busy it takes their idle moments, not
    their time. Where the priority cannot be changed, nothing happens.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def process_start_ticks(pid: int | None = None) -> int:
    """When process ``pid`` (default: this one) started, in clock ticks since boot: exact, so
    that a pid and its start name one process (Linux).
    """
    return int(Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime


def process_start_time(pid: int | None = None) -> float:
    """When process ``pid`` (default: this one) started, in unix seconds (Linux; about 10 ms resolution)."""
    ticks = process_start_ticks(pid)
    uptime = float(Path("/proc/uptime").read_text().split()[0])  # both count from boot
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def exit_code(e: SystemExit) -> int:
    """The code the interpreter would exit with for ``e``; like it, print a code that is neither
    an int nor None (a message) to stderr.
    """
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def leave(code: int) -> NoReturn:
    """End this process as the interpreter's exit would (non-daemon threads joined, then the
    atexit handlers, stdio flushed), less its teardown of every module. With torch loaded that
    teardown is seconds of CPU (clearing thousands of modules, then collecting them), paid by
    every rank of every job that ends, on cores other jobs' ranks share.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter's own order: threads first, then these
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
