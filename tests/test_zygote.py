"""Pre-warmed workers (trainer.launch.zygote): restarted ranks are forks of the node's zygote.

Real jobs (`rfsdp train`, ft_launcher, 2 gloo ranks); faults are real signals sent from here once
the zygote is listening, so that the restart it serves does not depend on how fast it imported.
Every assertion is about structure (who forked whom, what is alive), never about timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from tests.reaper import TAG_ENV, alive
from trainer.events import Restart, RunEnd, Step, read_events, select
from trainer.launch.worker import ZYGOTE_MODULE, lock_address

pytestmark = pytest.mark.slow


def start_train(data: Path, run: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", str(data), "--run-dir", str(run), *extra]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(what: str, check: Callable[[], object], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: list[str]
    env: dict[str, str]


def ours() -> list[Proc]:
    """This test's live processes (they carry its tag), as they are now."""
    tag = os.environ[TAG_ENV]
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get(TAG_ENV) == tag and alive(p.pid):
                found.append(Proc(p.pid, p.ppid(), p.cmdline(), env))
        except psutil.Error:  # gone meanwhile
            continue
    return found


def zygotes() -> dict[int, tuple[str, int]]:
    """This test's zygotes (pid -> address, agent pid): processes started as the zygote whose
    parent is not one (a zygote's ranks, and their children, are forks of it). A zygote started
    while one is importing exits at once: it may be seen too.
    """
    procs = {p.pid: p for p in ours() if ZYGOTE_MODULE in p.argv[1:4]}
    return {pid: (p.argv[-2], int(p.argv[-1])) for pid, p in procs.items() if p.ppid not in procs}


def one_listening_zygote() -> list | None:
    found = zygotes()
    return list(found.items()) if len(found) == 1 and listening(next(iter(found.values()))[0]) else None


def listening(address: str) -> bool:
    """True while a socket is bound at ``address`` in the abstract namespace."""
    return any(line.rstrip().endswith(f" @{address}") for line in Path("/proc/net/unix").read_text().splitlines())


def forked_ranks(zygote: int) -> list[int]:
    return [p.pid for p in ours() if p.ppid == zygote]


def session_leaders(pids: list[int], count: int) -> list[int] | None:
    """``pids`` if there are ``count`` of them and each leads its own session, else None."""
    try:
        return pids if len(pids) == count and all(os.getsid(p) == p for p in pids) else None
    except ProcessLookupError:  # one ended meanwhile
        return None


def worker(program: str, rank: int) -> int | None:
    """The live process started as ``python -m PROGRAM`` for ``rank`` (exec'd: its environment is
    its own), not a fork of it (the checkpoint writer's worker).
    """
    procs = [p for p in ours() if program in p.argv[1:4]]  # python [-u] -m PROGRAM (the launcher's argv names it too)
    pids = {p.pid for p in procs}
    return next((p.pid for p in procs if p.ppid not in pids and p.env.get("RANK") == str(rank)), None)


def test_restarts_are_served_by_the_zygote_which_ends_with_the_run(data_dir: Path, tmp_path: Path) -> None:
    """The first workers run the trainer themselves while the zygote imports; once it listens,
    a SIGKILLed rank's restart is two forks of it, each leading its own session. Killing a
    client's process group (what the launcher does to restart) kills its rank; SIGTERM reaches the
    forked ranks through their clients (a graceful preemption). After `rfsdp train` returns,
    neither the zygote nor its socket is left.
    """
    run = tmp_path / "run"
    proc = start_train(data_dir, run, "--steps", "100000", "--ckpt-every", "5")  # ended by the SIGTERM below
    try:
        ((zygote, (address, _)),) = wait_for("one zygote, listening", one_listening_zygote)
        assert listening(lock_address(address))
        first = wait_for("rank 1 of the first workers", lambda: worker("trainer.rank.train", 1))
        wait_for("a step", lambda: select(read_events(run), Step))  # the restart's timeline starts there
        os.kill(first, signal.SIGKILL)  # an OOM kill

        # Each leads its own session, as a worker does (a fork is seen before it calls setsid).
        ranks = wait_for("two forked ranks, each leading a session", lambda: session_leaders(forked_ranks(zygote), 2))
        wait_for("the restart event", lambda: select(read_events(run), Restart))
        (restart,) = select(read_events(run), Restart)
        assert "forked" in restart.phases and "imports_done" not in restart.phases  # rank 0 imported nothing

        client = wait_for("rank 0's client", lambda: worker("trainer.launch.worker", 0))
        os.killpg(client, signal.SIGKILL)  # as the launcher stops a worker
        wait_for("the killed client's ranks to end", lambda: not any(alive(r) for r in ranks), timeout=30)
        wait_for("the second restart", lambda: len(select(read_events(run), Restart)) == 2)
        wait_for("the next forked ranks", lambda: session_leaders(forked_ranks(zygote), 2))

        proc.send_signal(signal.SIGTERM)  # preemption: launcher -> clients -> forked ranks
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert select(read_events(run), RunEnd)[-1].status == "preempted"
    # It ends as soon as it sees its agent gone, which may be just after `rfsdp train` saw it.
    wait_for("the zygote to end", lambda: not alive(zygote), timeout=10)
    assert not listening(address) and not listening(lock_address(address))
    assert not zygotes()


def test_two_runs_at_once_have_a_zygote_each(data_dir: Path, tmp_path: Path) -> None:
    """Each agent (ft_launcher) has its own zygote, at its own address: two jobs on one machine
    never fork each other's ranks.
    """
    procs = [start_train(data_dir, tmp_path / f"run{i}", "--steps", "30", "--ckpt-every", "10") for i in range(2)]
    try:
        found = wait_for("two zygotes", lambda: len(z := set(zygotes().values())) == 2 and z)
        assert len({address for address, _ in found}) == 2
        launchers = {psutil.Process(agent).ppid() for _, agent in found}
        assert launchers == {p.pid for p in procs}  # each zygote's agent is the launcher of a different run
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
