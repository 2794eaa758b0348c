"""The worker entry ft_launcher starts for every rank: a thin client of the node's zygote.

Example (what ``trainer.launch.local.worker_command`` puts after ``ft_launcher ...``)::

    python -m trainer.launch.worker --data DATA --run-dir RUN [train flags]

It asks the node's zygote (``trainer.launch.zygote``: a process that has imported torch, NVRx and
the trainer once) to fork a ready rank with this process's argv, environment, working directory
and stdio, then stands in for that rank: it forwards SIGTERM / SIGINT to it and exits as it did.
The agent (``trainer.launch.agent``) starts the zygote as it starts; a worker that finds it still
importing waits until it listens. When none is there at all (ft_launcher run directly) the first
worker starts one in the background: one import per node instead of one per rank. Only when no zygote can serve
(no private folder for its socket, or one that fails to start) does it exec the trainer itself,
as a plain ``python -m trainer.rank.train`` would run.

A rank the kernel's OOM killer ended (SIGKILL, and one more OOM kill counted in the memory
cgroup: ``trainer.cgroup``) is reported by the zygote, its parent, with :func:`report_oom`: the
rank itself can write nothing, and the launcher may kill this worker before it could.

The launcher's view is unchanged: this is the process it started, monitors and kills. Killing it
(the launcher SIGKILLs a worker's process group to restart it) closes its connection, and the
zygote SIGKILLs the rank's process group at once.

Who may ask: the zygote's socket is a path in this user's private folder (:func:`socket_dir`);
the zygote serves only a process of its own user whose parent is its agent, and a worker sends
its request only to a process of its own user (SO_PEERCRED, both ways). A request carries no
secret (:data:`SECRET_NAME`). A refused request forks nothing, and the worker runs the rank itself.

Only the standard library is imported here: this runs before every rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

from trainer.process import LAUNCHER_PID_ENV, die_with_parent, process_start_ticks, process_start_time

TRAIN_MODULE = "trainer.rank.train"
ZYGOTE_MODULE = "trainer.launch.zygote"
_MAX_MESSAGE = 1 << 20  # a request (argv + environment) is a few KB
ZYGOTE_START_S = 300.0
"""The longest a worker waits for a zygote that is still importing (seconds of CPU on an idle
machine; minutes where many jobs start at once) before it runs its rank itself."""


SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL", re.IGNORECASE)
"""Environment names a request never carries: the zygote was started from the same launcher's
environment, so the rank takes their values from its own (a fork inherits them)."""


def socket_dir() -> Path | None:
    """This user's private folder of zygote sockets (``$TMPDIR/rfsdp-UID``, made 0700), or None
    when it cannot be trusted: not a folder of this user's, or open to others. A socket in it is
    reachable by this user alone, and nobody else can bind its name first.
    """
    path = Path(os.environ.get("TMPDIR") or "/tmp") / f"rfsdp-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        print(
            f"rfsdp worker: not using {path} for the zygote's socket (not a private folder of this user's)",
            file=sys.stderr,
        )
        return None
    return path


def zygote_address(agent_pid: int, run_id: str) -> str | None:
    """The path of the zygote's socket for the agent ``agent_pid`` (this worker's launcher) of
    rendezvous ``run_id``, in :func:`socket_dir` (None: no private folder, or a path too long for
    a unix socket). Agent pid, its start time and the run id keep two jobs on one machine, and a
    replica's restarted launcher, apart.
    """
    directory = socket_dir()
    if directory is None:
        return None
    digest = hashlib.sha256(f"{agent_pid}:{process_start_ticks(agent_pid)}:{run_id}".encode()).hexdigest()[:24]
    address = str(directory / f"zygote-{digest}")
    return address if len(address) < 100 else None  # sun_path holds 108 bytes, with room for ".lock"


def lock_address(address: str) -> str:
    """The file a zygote holds locked for its whole life: of several started at once, the one that locks it serves."""
    return f"{address}.lock"


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a connected unix socket (SO_PEERCRED)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
    except OSError:  # nobody listens (yet)
        sock.close()
        return None
    if peer_uid(sock)[1] != os.geteuid():  # never send a request to another user's process
        sock.close()
        print(f"rfsdp worker: {address} is served by another user: not using it", file=sys.stderr)
        return None
    return sock


def start_zygote(address: str, agent_pid: int) -> subprocess.Popen:
    """Start the node's zygote in the background: its own session, so the launcher's kill of a
    worker's process group never reaches it; it ends when the agent does. A second one started
    meanwhile finds the first's lock and exits at once.
    """
    return subprocess.Popen(
        [sys.executable, "-m", ZYGOTE_MODULE, address, str(agent_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # stderr: the log of the agent's or worker's
    )


def _zygote_alive(address: str) -> bool:
    """Whether a zygote holds ``address``'s lock (it does from its start until it is gone)."""
    try:
        fd = os.open(lock_address(address), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _wait_for_zygote(address: str, started: subprocess.Popen | None) -> socket.socket | None:
    """Connect to the zygote at ``address`` once it listens; None when none will (the one this
    worker ``started`` failed, or none holds the lock) or it took :data:`ZYGOTE_START_S`.
    """
    deadline = time.monotonic() + ZYGOTE_START_S
    while time.monotonic() < deadline:
        if (sock := _connect(address)) is not None:
            return sock
        ended = started is None or started.poll() is not None
        if ended and ((started is not None and started.returncode != 0) or not _zygote_alive(address)):
            if (sock := _connect(address)) is not None:  # it may have listened, served and gone meanwhile
                return sock
            return None
        time.sleep(0.02)
    return None


def _exit_like(status: int) -> None:
    """Exit as a process with wait status ``status`` did: the same code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # theirs cannot be set (EINVAL), and are the default
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def request_of(args: list[str], env: dict[str, str]) -> dict:
    """What a worker asks its zygote for: its argv, environment less its secrets (named in
    ``withheld``: the rank takes them from the zygote's own environment), directory and pid.
    """
    return {
        "argv": args,
        "env": {k: v for k, v in env.items() if not SECRET_NAME.search(k)},
        "withheld": sorted(k for k in env if SECRET_NAME.search(k)),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "started": process_start_time(),
    }


def _serve_through(sock: socket.socket, args: list[str]) -> None:
    """Have the zygote fork the rank, stand in for it until it ends, and exit as it did.

    Returns only when the zygote refused the request (nothing was forked): the caller runs the
    rank itself.
    """
    rank: int | None = None
    pending: list[int] = []  # signals that came before the rank's pid

    def forward(signum: int, frame: object) -> None:
        if rank is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # the rank leads its own process group, as a worker does
            os.killpg(rank, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    die_with_parent()  # a launcher that is gone preempts the rank (SIGTERM, forwarded), as it did before
    socket.send_fds(sock, [json.dumps(request_of(args, dict(os.environ))).encode()], [0, 1, 2])
    reply = json.loads(sock.recv(_MAX_MESSAGE) or b"{}")
    if "pid" not in reply:
        print(
            f"rfsdp worker: the zygote did not start the rank ({reply.get('error', 'no reply')}): running it here",
            file=sys.stderr,
        )
        sock.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        for signum in pending:
            os.kill(os.getpid(), signum)
        return
    rank = reply["pid"]
    for signum in pending:
        forward(signum, None)
    done = sock.recv(_MAX_MESSAGE)
    if not done:  # the zygote is gone: so is the rank, or it is made to be
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank, signal.SIGKILL)
        sys.exit("rfsdp worker: the zygote ended before the rank")
    _exit_like(json.loads(done)["status"])  # an OOM kill: the zygote reports it


def report_oom(args: list[str], peak_rss: int, limit: int | None, rank: int) -> None:
    """Write the ``failure`` event (infrastructure, ``oom``) of a rank the OOM killer ended, to the
    run directory in the rank's ``args``: its peak RSS and the step it was in (one past the last
    step logged: the ranks step together). Best effort: the restart goes on regardless.
    """
    from trainer.events import EVENTS_FILE, EventLog, Failure, Step, parse_event_lines

    run_dir = _flag(args, "--run-dir")
    if run_dir is None:
        return
    step = None
    with contextlib.suppress(OSError):
        with open(Path(run_dir) / EVENTS_FILE, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))  # the tail: a long run's log is large
            tail = f.read()
        logged = [e.step for e in parse_event_lines(tail[tail.find(b"\n") + 1 :]) if isinstance(e, Step)]
        step = max(logged) + 1 if logged else None
    mib = peak_rss / (1 << 20)
    within = f" of the {limit / (1 << 20):,.0f} MiB limit" if limit else ""
    failure = Failure(
        category="infrastructure",
        kind="oom",
        error_type="OOMKilled",
        error=f"OOMKilled: the kernel's OOM killer ended rank {rank} (peak RSS {mib:,.0f} MiB{within})",
        origin="",
        step=step,
        peak_rss_mb=round(mib, 1),
    )
    with contextlib.suppress(OSError):
        EventLog(Path(run_dir), rank).emit(failure)


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``--name VALUE`` or ``--name=VALUE``), or None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main() -> None:
    """Run this rank through the node's zygote, or as a fresh interpreter while none answers."""
    args = sys.argv[1:]
    agent = os.getppid()
    os.environ[LAUNCHER_PID_ENV] = str(agent)  # a forked rank's parent is the zygote
    address = zygote_address(agent, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    if address is not None:
        # One the agent started may still be importing: wait for it rather than start another.
        sock = _connect(address) or _wait_for_zygote(
            address, None if _zygote_alive(address) else start_zygote(address, agent)
        )
        if sock is not None:
            _serve_through(sock, args)
    os.execv(sys.executable, [sys.executable, "-m", TRAIN_MODULE, *args])


if __name__ == "__main__":
    main()
