"""An attempt of the training function and its connections: the TCP store of its process group,
and the gloo connections that an in-process restart's abort cuts. None of it touches NVRx (the
wrapper that runs the attempts is ``trainer.rank.resilience.inprocess``).
"""

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch.distributed as dist


def _open_sockets() -> dict[int, int]:
    """This process's open socket file descriptors, each with its socket's inode (its identity)."""
    sockets = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")  # socket:[inode]
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            sockets[int(name)] = int(target[len("socket:[") : -1])
    return sockets


class CollectiveConnections:
    """The TCP connections of one attempt's gloo process groups, so that an abort can cut them.

    gloo's ``abort()`` and ``shutdown()`` do nothing in torch 2.13, and destroying a group closes
    nothing while the model's mesh still holds it: a rank blocked in a collective with a peer that
    failed waited out the group's whole timeout before the in-process restart could begin.
    Shutting the connections down fails that collective at once, here and on every peer (gloo's
    "Connection closed by peer"), as NCCL's abort does. Listening sockets are left open (gloo ends
    the process when its listener fails). What is recorded is every internet socket the process
    opened while :meth:`recording` ran: a connection another thread opened in those milliseconds
    (rank 0's checkpoint mirror, uploading) is cut too, and that upload is retried.

    Connections to or from ``spared_ports`` are never cut: the in-process wrapper's store. Its
    server runs in rank 0's process, so a peer's monitor process that connected while rank 0
    recorded left its accepted socket among rank 0's. Cutting it ended that monitor process, and
    that rank's next fault reached no peer: a soft fault became an in-job restart.
    """

    def __init__(self, spared_ports: frozenset[int] = frozenset()) -> None:
        self._spared = spared_ports
        self._made: dict[int, int] = {}
        self._lock = threading.Lock()  # the abort runs on the wrapper's monitor thread
        self.aborted = False
        """The wrapper's abort has cut the current attempt's connections (reset as the next one
        starts): what fails on this rank from then on is the abort's doing (for some rank's
        fault), no failure of its own."""

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Remember the sockets opened while the block runs (the groups it creates connect at once)."""
        before = _open_sockets()
        try:
            yield
        finally:
            made = {fd: inode for fd, inode in _open_sockets().items() if before.get(fd) != inode}
            with self._lock:
                self._made.update(made)

    def cut(self) -> int:
        """Shut down every remembered internet connection that is still the socket it was, and
        forget them all.

        Returns:
            How many connections were shut down.
        """
        with self._lock:
            made, self._made = self._made, {}
            self.aborted = True
        cut = 0
        for fd, inode in made.items():
            try:
                # A duplicate: the descriptor stays gloo's to close; shutdown acts on the socket itself.
                duplicate = os.dup(fd)
            except OSError:  # closed since
                continue
            if os.fstat(duplicate).st_ino != inode:  # closed, and its number reused
                os.close(duplicate)
                continue
            with socket.socket(fileno=duplicate) as sock:
                try:
                    if (
                        sock.family in (socket.AF_INET, socket.AF_INET6)
                        and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and not {sock.getsockname()[1], sock.getpeername()[1]} & self._spared
                    ):
                        sock.shutdown(socket.SHUT_RDWR)
                        cut += 1
                except OSError:  # never connected (no peer), or already shut
                    continue
        return cut


@dataclass(frozen=True, slots=True)
class Attempt:
    """Which attempt of the training function this is, and its hooks into the wrapper."""

    in_process_attempt: int = 0
    """How many in-process restarts came before this attempt in its process (NVRx's ``call_wrapper.iteration``)."""
    in_job_restart: int = field(default_factory=lambda: int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    atomic: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    heartbeat: Callable[[], None] = lambda: None
    """Tells the in-process wrapper this rank still makes progress (NVRx's ``call_wrapper.ping``)."""
    store_port: int | None = None
    """Port for this attempt's process-group store (None: use the launcher's environment)."""
    connections: CollectiveConnections = field(default_factory=CollectiveConnections)
    """Where the attempt's process groups record their connections, for the wrapper's abort."""


def make_store(attempt: Attempt, timeout_s: float) -> dist.Store | None:
    """A fresh TCP store for this attempt's process group (None when not in-process restartable)."""
    if attempt.store_port is None:
        return None
    host, master = os.environ["MASTER_ADDR"], int(os.environ["RANK"]) == 0
    if not master:
        wait_until_listening(host, attempt.store_port, timeout_s)
    return dist.TCPStore(
        host,
        attempt.store_port,
        int(os.environ["WORLD_SIZE"]),
        is_master=master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=True,
    )


def wait_until_listening(host: str, port: int, timeout_s: float, *, every_s: float = 0.01) -> None:
    """Return once ``host:port`` accepts connections, or after ``timeout_s`` (the caller's own
    connection then fails as it would have). c10d's store client that comes before the server
    listens retries only about half a second later, and a restart's ranks all reach this at
    once: a recovery often paid that (0.45-0.54 s measured, against 0.01 s once listening).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=every_s * 10).close()
            return
        except OSError:
            time.sleep(every_s)
