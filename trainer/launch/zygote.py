"""A node's pre-warmed worker: imports the trainer once, then forks a ready rank per request.

Forked by the agent (``trainer.launch.agent``) once it has imported torch (:func:`fork_zygote`),
or else started by its first worker (``trainer.launch.worker``, which documents the client's side)
as ``python -m trainer.launch.zygote ADDRESS AGENT_PID``. Every rank of that agent is then a
fork of this process, the first ones and the restarted ones: it skips the interpreter's start and
the imports (torch, DCP, NVRx, the trainer and ``torch._dynamo``; for an ``hf:`` model, the
transformers modules it needs too), seconds of CPU per rank, paid once per node instead. As the
ranks' parent, the zygote also learns how each ended, and its peak memory (``wait4``): what tells
an OOM kill apart from another SIGKILL.

What keeps a fork equal to a fresh interpreter:

- The zygote only imports. It never runs a torch op, calls no CUDA API (the device is first
  touched in the rank) and has no thread of its own when it forks
  (an OpenMP or gloo pool would be inherited broken; OpenBLAS stops its pool around a fork by
  itself).
- The rank gets the client's argv, environment, working directory and stdio (passed with
  SCM_RIGHTS), leads a new session as torch elastic's workers do (its own children, such as the
  checkpoint writer's worker, stay in its process group), and exits as the interpreter would
  (atexit handlers, non-daemon threads joined; ``trainer.process.leave`` skips only the teardown).
- The rank's pid is the one NVRx's rank monitor is told (``RankMonitorClient`` reports
  ``os.getpid()``), so a hung rank is killed where it runs; its client then exits the same way.

Lifetime: the rank's process group is SIGKILLed when its client's connection closes (the launcher
killed the worker's group); a rank outlives no zygote (PR_SET_PDEATHSIG) and the zygote outlives
no agent: once the agent process is gone it takes no more requests and exits when its last rank
has; it then removes its socket and lock file.

Who it serves: a process of its own user whose parent is its agent (SO_PEERCRED), through a
socket in that user's private folder (``trainer.launch.worker``, which documents the client's
checks). Anyone else's request is refused, forks nothing and is logged. A request carries the
client's environment without its secrets: the rank takes those from the zygote's own
environment, which it inherited from the same launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

from trainer import cgroup
from trainer.launch.worker import TRAIN_MODULE, lock_address, peer_uid, report_oom
from trainer.models import model_modules
from trainer.process import exit_code, leave, process_start_time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MAX_MESSAGE = 1 << 20
PRELOAD = (
    TRAIN_MODULE,
    "torch._dynamo",  # torch.use_deterministic_algorithms imports it on first use (FSDP2's DTensor would too)
    "torch.distributed.checkpoint._fsspec_filesystem",  # DCP's load and save (fsspec)
    "multiprocessing.queues",  # the checkpoint writer's forked worker
    "multiprocessing.popen_fork",
    "torch.utils.serialization.config",  # torch.save
)
"""What a new rank imports before its first step (found by diffing ``sys.modules`` between a
forked rank's fork and its exit; CUDA's own, such as torch's CUPTI monitor, are left out: the
zygote must not touch the device)."""


@dataclass(frozen=True, slots=True)
class Request:
    """What a client asked for: the rank it stands in for."""

    argv: list[str]
    env: dict[str, str]
    """The client's environment less its secrets, which are named in ``withheld``."""
    withheld: list[str]
    cwd: str
    client_pid: int
    client_started: float
    """When the client (the process the launcher started) started, unix seconds."""
    fds: list[int]
    """The client's stdin, stdout and stderr."""


@dataclass(slots=True)
class _Rank:
    pid: int
    pidfd: int
    conn: socket.socket | None
    request: Request
    kills_before: int | None
    """The memory cgroup's OOM kills when it was forked: one more at its SIGKILL was the kernel's."""
    killed: bool = False
    """The zygote killed it (its worker was gone): not the OOM killer."""


def _preload(agent_pid: int) -> None:
    """Import :data:`PRELOAD` and the modules of the model the agent's ranks train (the node's
    workers wait for it: one import for all its ranks, and for every rank of a restart).
    """
    for name in PRELOAD:
        __import__(name)
    for name in model_modules(_agent_model(agent_pid)):
        try:
            __import__(name)
        except Exception:  # the rank imports it again, and reports what fails
            continue


def _agent_model(agent_pid: int) -> str:
    """The ``--model`` on the agent's command line, or ""."""
    try:
        with open(f"/proc/{agent_pid}/cmdline", "rb") as f:
            return model_flag(f.read().decode(errors="replace").split("\0"))
    except OSError:
        return ""


def model_flag(argv: list[str]) -> str:
    """The last ``--model`` of ``argv`` (the training's flags end an agent's), or ""."""
    model = ""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif arg.startswith("--model="):
            model = arg.removeprefix("--model=")
    return model


def _lock(path: str) -> int | None:
    """Hold ``path`` locked for this process's life (the kernel drops the lock with it); None
    when another process holds it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _bind(address: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):  # a dead zygote's: this one holds the lock
        os.unlink(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(address)
    sock.listen(16)
    return sock


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _refuse(conn: socket.socket, reason: str) -> None:
    print(f"rfsdp zygote: refused a request: {reason}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"error": reason}).encode())
    conn.close()


def _accept(listener: socket.socket, agent_pid: int) -> tuple[socket.socket, Request] | None:
    """The next request, if its client may have a rank: a process of this user whose parent is
    the agent (the client waits for the reply, so its pid cannot be reused meanwhile), asking
    only for secrets this process holds.
    """
    conn, _ = listener.accept()
    try:
        data, fds, _, _ = socket.recv_fds(
            conn, _MAX_MESSAGE, 3
        )  # read before any reply: a refused client reads its reason
    except OSError as e:
        _refuse(conn, f"bad request: {e}")
        return None
    pid, uid = peer_uid(conn)
    if uid != os.geteuid() or _parent(pid) != agent_pid:
        for fd in fds:
            os.close(fd)
        _refuse(conn, f"pid {pid} (uid {uid}) is not a worker of this zygote's launcher (pid {agent_pid})")
        return None
    try:
        msg = json.loads(data)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} stdio descriptors")
        absent = [name for name in msg["withheld"] if name not in os.environ]
        if absent:
            raise ValueError(f"the zygote's environment lacks {', '.join(absent)}")
        request = Request(msg["argv"], msg["env"], msg["withheld"], msg["cwd"], msg["pid"], msg["started"], fds)
    except (ValueError, KeyError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        _refuse(conn, f"bad request: {e}")
        return None
    return conn, request


def serve(address: str, agent_pid: int) -> Request | None:
    """Serve ``address`` until the agent is gone and every rank has ended (returns None), or,
    in a forked rank, return that rank's request.
    """
    lock = _lock(lock_address(address))
    if lock is None:
        return None  # another zygote serves this agent, or is importing
    try:
        agent = os.pidfd_open(agent_pid)
    except ProcessLookupError:  # the agent is gone already: no worker of it comes any more
        os.unlink(lock_address(address))
        return None
    _preload(agent_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    listener: socket.socket | None = _bind(address)
    ranks: dict[int, _Rank] = {}  # by pidfd
    memory = cgroup.memory_dir()  # the job's, which the ranks inherit
    while listener is not None or ranks:
        waiting = [r.pidfd for r in ranks.values()] + [r.conn for r in ranks.values() if r.conn is not None]
        if listener is not None:
            waiting += [listener, agent]
        ready, _, _ = select.select(waiting, [], [])
        for item in ready:
            if item is agent:  # the run is over on this node: no more ranks
                listener.close()
                listener = None
                for path in (address, lock_address(address)):  # the lock too: no worker of this agent comes any more
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            elif item is listener:
                if (accepted := _accept(listener, agent_pid)) is None:
                    continue
                conn, request = accepted
                detached_r, detached_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(detached_r)
                    _detach(detached_w)
                    os.close(lock)  # the rank holds nothing of the zygote's
                    listener.close()
                    conn.close()
                    for fd in [agent, *(r.pidfd for r in ranks.values())]:
                        os.close(fd)
                    for r in ranks.values():
                        if r.conn is not None:
                            r.conn.close()
                    return request
                os.close(detached_w)
                os.read(detached_r, 1)  # until the rank leads its group: killpg below must reach it
                os.close(detached_r)
                for fd in request.fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                ranks[pidfd] = _Rank(pid, pidfd, conn, request, cgroup.oom_kills(memory))
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"pid": pid}).encode())
            elif isinstance(item, int):  # a rank ended
                rank = ranks.pop(item)
                _, status, usage = os.wait4(rank.pid, 0)
                os.close(rank.pidfd)
                # Here, not in its worker: the launcher may kill the worker first (a peer's
                # broken collective ends the job at once), and the kill would go unreported.
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and not rank.killed:
                    kills = cgroup.oom_kills(memory)
                    if kills is not None and rank.kills_before is not None and kills > rank.kills_before:
                        rank_id = int(rank.request.env.get("RANK", "0"))
                        report_oom(rank.request.argv, usage.ru_maxrss * 1024, cgroup.memory_limit(memory), rank_id)
                if rank.conn is not None:
                    ended = {"status": status}
                    with contextlib.suppress(OSError):
                        rank.conn.send(json.dumps(ended).encode())
                    rank.conn.close()
            else:  # a client's connection closed: the launcher killed that worker, so the rank goes too
                rank = next((r for r in ranks.values() if r.conn is item), None)
                if rank is None:  # its rank ended in this same round: seen above, the connection closed there
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.pid, signal.SIGKILL)
                rank.conn.close()
                rank.conn, rank.killed = None, True
    return None


def _detach(done_fd: int) -> None:
    """In a new fork, before anything else: lead a new session and die with the zygote, then
    tell the zygote (which waits on ``done_fd``: until then its pid names no process group, and a
    zygote gone before the prctl would leave the rank orphaned).
    """
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    os.write(done_fd, b"1")
    os.close(done_fd)


def rank_environment(request: Request, own: Mapping[str, str]) -> dict[str, str]:
    """The rank's environment: the client's, with the secrets it withheld from the zygote's own."""
    return {**request.env, **{name: own[name] for name in request.withheld}}


def run_rank(request: Request, agent_pid: int) -> None:
    """In the forked rank (detached already): become the client's process and run the trainer's main."""
    forked = time.time()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    env = rank_environment(request, os.environ)
    os.environ.clear()
    os.environ.update(env)
    train = sys.modules[TRAIN_MODULE]
    sys.argv = [train.__file__, *request.argv]
    startup = {"process_started": request.client_started, "forked": forked}
    train.main(request.argv, startup=startup, launcher_started=process_start_time(agent_pid))


def fork_zygote(address: str) -> int | None:
    """From the agent, once it has imported torch and before it starts anything else: fork the
    node's zygote, which then imports only the rest of :data:`PRELOAD`. A fresh interpreter would
    import torch a second time, a second of CPU per node start. Its own session, as
    :func:`trainer.launch.worker.start_zygote`'s; returns its pid, or None (nothing forked) when
    this process runs a Python thread already: a lock it held would stay held in the fork. The
    one native thread torch's import starts is OpenBLAS's pool, which stops itself around a fork,
    as for the zygote's own forks.
    """
    if threading.active_count() > 1:
        return None
    agent_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # never back into the agent's code: this process ends as the interpreter's exit would
        os.setsid()
        # What a fresh interpreter started with close_fds gets: nothing of the agent's but stdio.
        # The run dir's lock above all, which the agent holds for its job: the zygote outlives
        # the agent by a moment, and a next job on the run dir was refused meanwhile.
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # stderr stays: the agent's log
        os.close(devnull)
        _serve_and_run(address, agent_pid)
        code = 0
    except SystemExit as e:  # a rank's sys.exit
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)


def _serve_and_run(address: str, agent_pid: int) -> None:
    request = serve(address, agent_pid)
    if (
        request is None
    ):  # the zygote itself, done: nothing of it needs a teardown (its sockets go with it), so it ends at once
        os._exit(0)
    run_rank(request, agent_pid)


def main() -> None:
    """``python -m trainer.launch.zygote ADDRESS AGENT_PID`` (started by ``trainer.launch.worker``)."""
    _serve_and_run(sys.argv[1], int(sys.argv[2]))


if __name__ == "__main__":
    main()
