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

Only the standard library is imported here: this runs before every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

from trainer.process import die_with_parent, process_start_time

TRAIN_MODULE = "trainer.rank.train"
ZYGOTE_MODULE = "trainer.launch.zygote"
_MAX_MESSAGE = 1 << 20  # a request (argv + environment) is a few KB


def zygote_address(agent_pid: int, run_id: str) -> str:
    """The name of the zygote's socket for the agent ``agent_pid`` (this worker's launcher) of
    rendezvous ``run_id``, in Linux's abstract namespace (:func:`abstract`), which is per network
    namespace (one per pod, one per ``--netns`` host) and leaves no file behind. Agent pid and run
    id keep two jobs on one machine, and a replica's restarted launcher, apart.
    """
    digest = hashlib.sha256(f"{os.getuid()}:{agent_pid}:{run_id}".encode()).hexdigest()[:24]
    return f"rfsdp-zygote-{digest}"


def lock_address(address: str) -> str:
    """The name a zygote holds for its whole life: of several started at once, the one that binds it serves."""
    return f"{address}.lock"


def abstract(name: str) -> str:
    """The socket address of ``name`` in the abstract namespace."""
    return f"\0{name}"


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(abstract(address))
    except OSError:  # nobody listens (yet)
        sock.close()
        return None
    return sock


def _start_zygote(address: str, agent_pid: int) -> None:
    """Start the node's zygote in the background: its own session, so the launcher's kill of a
    worker's process group never reaches it; it ends when the agent does. A second one started
    meanwhile finds the first's lock and exits at once.
    """
    subprocess.Popen(
        [sys.executable, "-m", ZYGOTE_MODULE, address, str(agent_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,  # stderr: the worker's log
    )  # fmt: skip


def _exit_like(status: int) -> None:
    """Exit as a process with wait status ``status`` did: the same code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _serve_through(sock: socket.socket, args: list[str]) -> None:
    """Have the zygote fork the rank, stand in for it until it ends, and exit as it did."""
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
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(), "started": process_start_time()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(sock.recv(_MAX_MESSAGE) or b"{}")
    if "pid" not in reply:
        sys.exit(f"rfsdp worker: the zygote did not start the rank ({reply.get('error', 'no reply')})")
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
    address = zygote_address(agent, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    sock = _connect(address)
    if sock is not None:
        _serve_through(sock, args)
    _start_zygote(address, agent)
    os.execv(sys.executable, [sys.executable, "-m", TRAIN_MODULE, *args])


if __name__ == "__main__":
    main()
