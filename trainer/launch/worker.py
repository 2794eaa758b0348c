"""The worker entry ft_launcher starts for every rank: a thin client of the node's zygote.

Example (what ``trainer.launch.local.worker_command`` puts after ``ft_launcher ...``)::

    python -m trainer.launch.worker --data DATA --run-dir RUN [train flags]

It asks the node's zygote (``trainer.launch.zygote``: a process that has imported torch, NVRx and
the trainer once) to fork a ready rank with this process's argv, environment, working directory
and stdio, then stands in for that rank: it forwards SIGTERM / SIGINT to it and exits as it did.
When no zygote answers (the job's first workers, or one still importing) it starts one in the
background and execs the trainer itself, as a plain ``python -m trainer.rank.train`` would run.

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
from pathlib import Path

from trainer.process import LAUNCHER_PID_ENV, die_with_parent, process_start_ticks, process_start_time

TRAIN_MODULE = "trainer.rank.train"
ZYGOTE_MODULE = "trainer.launch.zygote"
_MAX_MESSAGE = 1 << 20  # a request (argv + environment) is a few KB


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


def _start_zygote(address: str, agent_pid: int) -> None:
    """Start the node's zygote in the background: its own session, so the launcher's kill of a
    worker's process group never reaches it; it ends when the agent does. A second one started
    meanwhile finds the first's lock and exits at once.
    """
    subprocess.Popen(
        [sys.executable, "-m", ZYGOTE_MODULE, address, str(agent_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # stderr: the worker's log
    )


def _exit_like(status: int) -> None:
    """Exit as a process with wait status ``status`` did: the same code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
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
    _exit_like(json.loads(done)["status"])


def main() -> None:
    """Run this rank through the node's zygote, or as a fresh interpreter while none answers."""
    args = sys.argv[1:]
    agent = os.getppid()
    os.environ[LAUNCHER_PID_ENV] = str(agent)  # a forked rank's parent is the zygote
    address = zygote_address(agent, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    if address is not None:
        sock = _connect(address)
        if sock is None:
            _start_zygote(address, agent)
        else:
            _serve_through(sock, args)
    os.execv(sys.executable, [sys.executable, "-m", TRAIN_MODULE, *args])


if __name__ == "__main__":
    main()
