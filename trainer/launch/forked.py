"""A short job of ranks forked from this process, with no launcher: for work that needs no restart.

Validation's ``replays`` check re-runs the trainer for a few steps. Under ``launch_local`` that
job paid ft_launcher's import of torch and the zygote's import of the trainer (about 4 s of CPU)
before its first step. Here this process imports the trainer once and forks each rank from it,
as the zygote would. No layer restarts anything, and no launcher watches for a hang: a rank
that fails ends the job, and so does the caller's deadline.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path

from trainer.launch.local import check_launch, free_port
from trainer.launch.spec import LaunchSpec
from trainer.process import exit_code
from trainer.rank.config import TrainConfig

TIMED_OUT = 124
"""The job's code when it outlived its deadline (as ``timeout`` reports it)."""


def run_forked(cfg: TrainConfig, world_size: int, log: Path, *, timeout_s: float) -> int:
    """Train ``cfg`` on ``world_size`` ranks on this host, each a fork of this process, and wait.

    Returns 0 when every rank succeeded, else the exit code of the first that failed (after the
    others were killed: they would wait for it in their next collective), or :data:`TIMED_OUT`
    when ranks were still running ``timeout_s`` after the start (they are killed). Every rank
    writes to ``log``.

    Raises:
        ValueError: what ``launch_local`` refuses before a process starts (world size, data, model, run dir).
    """
    check_launch(cfg, LaunchSpec(nnodes=1, nproc_per_node=world_size, max_restarts=0))
    from trainer.rank import train  # torch, DCP and the trainer: imported once, before the forks

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    with open(log, "ab") as out:
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                _run_rank(train.main, cfg.to_argv(), {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, out.fileno())
            pids.append(pid)
    code = _wait(pids, time.monotonic() + timeout_s)
    if code == TIMED_OUT:
        with open(log, "a") as out:
            print(f"rfsdp: the forked ranks did not finish within {timeout_s:.0f} s: killed", file=out)
    return code


def _run_rank(main: Callable[[list[str]], None], argv: list[str], env: dict[str, str], out: int) -> None:
    """In the fork: become the rank and never return (the trainer leaves with ``os._exit`` too)."""
    code = 1
    try:
        _forget_exit_handlers()
        os.dup2(out, 1)
        os.dup2(out, 2)
        # This process's sys.stdout and sys.stderr may write elsewhere than descriptors 1 and 2
        # (pytest's capture does): the rank's write to the log, as a new process's would.
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update(env)
        main(argv)
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forget_exit_handlers() -> None:
    """Drop the exit handlers inherited from this process: the rank's own exit runs them
    (``trainer.process.leave``), and this process's would delete its temporary folders, such as
    the scratch run dir the rank writes to. ``weakref.finalize`` (how ``TemporaryDirectory``
    cleans up) registers with ``atexit`` once per process, so its flag is reset for the rank's own.
    """
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    weakref.finalize._registered_with_atexit = False


def _wait(pids: list[int], deadline: float) -> int:
    """Wait for every rank; at the first failure, or at the deadline, kill the rest and return
    the failed rank's exit code (:data:`TIMED_OUT` at the deadline).
    """
    code, running = 0, list(pids)
    while running:
        if not code and time.monotonic() > deadline:
            code = TIMED_OUT
            for pid in running:
                os.kill(pid, signal.SIGKILL)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            running.remove(pid)
            ended = os.waitstatus_to_exitcode(status)
            if ended and not code:
                code = ended if ended > 0 else 128 - ended  # a signal, as a shell reports it
                for other in running:
                    os.kill(other, signal.SIGKILL)
        time.sleep(0.02)
    return code
