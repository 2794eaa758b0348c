"""A local cluster on one machine: every replica its own network host (``rfsdp train --netns``).

Each host is a Linux network namespace with one address in a private test range
(198.18.0.0/15, reserved for network testing, RFC 2544), joined to the others by a veth pair to
a bridge that lives in a dedicated "switch" namespace, so nothing is added to the machine's own
network. Host 0 holds the rendezvous endpoint, as the first Worker pod of a PyTorchJob does; the
run dir is a plain directory every host sees (the shared volume). A replica (one ft_launcher and
its workers) runs under ``ip netns exec HOST`` and advertises its own address (``PET_LOCAL_ADDR``),
so its workers' ``MASTER_ADDR`` and the wrapper's store are reachable from the other hosts.

Each host has node-local memory of its own for the local tier (``RFSDP_LOCAL_TIER_ROOT``, a folder
of this machine's /dev/shm that the namespaces would otherwise share). Node faults act on a host as
a real cluster would see them: ``kill_node`` SIGKILLs every process in the host's namespace at once
and wipes its memory (its local tier), as a replaced node has none; ``set_link(node, up=False)``
takes the host's switch port down, so its packets vanish silently (as with a failed cable, not a
clean refusal).

``LocalCluster`` always tears everything down (processes, namespaces, links), also on Ctrl-C,
SIGTERM and on failure; namespaces left behind by a harness that was itself SIGKILLed are removed
by the next one. It needs root, iproute2's ``ip`` and a kernel that lets it create namespaces:
:func:`netns_problem` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from trainer.checkpoint import LOCAL_TIER_ROOT, LOCAL_TIER_ROOT_ENV
from trainer.errors import ParameterError

SUBNET = "198.18.0"
"""Host ``i`` gets ``198.18.0.(i+1)/24``."""
RDZV_PORT = 29400
_PREFIX = "rfsdp"
_OWNED = re.compile(rf"^{_PREFIX}(\d+)-(?:sw|h\d+|probe)$")
_MEMORY = re.compile(rf"^{LOCAL_TIER_ROOT.name}-{_PREFIX}(\d+)-h\d+$")


class NetnsUnavailable(ValueError):
    """This machine (or user) cannot run the namespace cluster; the message says why (a
    ValueError: the command line reports it in one line, like bad input).
    """


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def netns_problem() -> str | None:
    """Why this process cannot build a namespace cluster (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge are created with `ip`)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command (Debian package iproute2)"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        bridge = _ip("-n", probe, "link", "add", "name", "probebr", "type", "bridge", check=False)
        if veth.returncode or bridge.returncode:
            return f"cannot create veth pairs and bridges: {(veth.stderr or bridge.stderr).strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Delete namespaces (and their processes) of harnesses that are no longer alive."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        m = _OWNED.match(name)
        if m and not _alive(int(m[1])):
            _kill_all(name)
            _ip("netns", "del", name, check=False)
    for memory in LOCAL_TIER_ROOT.parent.glob(f"{LOCAL_TIER_ROOT.name}-{_PREFIX}*"):
        m = _MEMORY.match(memory.name)
        if m and not _alive(int(m[1])):
            shutil.rmtree(memory, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids(namespace: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]


def _kill_all(namespace: str) -> None:
    # A dying process may have forked a moment before: repeat until the namespace is empty.
    for _ in range(50):
        pids = _pids(namespace)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace host."""

    index: int
    namespace: str
    address: str
    memory: Path
    """The host's node-local memory: its local tier's root (``RFSDP_LOCAL_TIER_ROOT``)."""


class LocalCluster:
    """``nnodes`` namespace hosts on a private bridge; a launch ``Placement`` for ``launch_local``
    and the ``NodeControl`` that fires node faults. Use as a context manager.
    """

    isolated = True
    restart_on_failure = True
    """A replica whose launcher exits non-zero is restarted (a pod with restartPolicy OnFailure)."""

    def __init__(self, nnodes: int) -> None:
        if nnodes < 1:
            raise ParameterError("nnodes", f"must be at least 1, got {nnodes}")
        tag = f"{_PREFIX}{os.getpid()}"
        self.switch = f"{tag}-sw"
        memory = LOCAL_TIER_ROOT.with_name  # each host's own folder beside the machine's root
        self.hosts = [
            Host(i, f"{tag}-h{i}", f"{SUBNET}.{i + 1}", memory(f"{LOCAL_TIER_ROOT.name}-{tag}-h{i}"))
            for i in range(nnodes)
        ]
        self._previous_sigterm: object = None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalCluster:
        problem = netns_problem()
        if problem:
            raise NetnsUnavailable(f"--netns: {problem}")
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        self._trap_sigterm()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            port = f"p{host.index}"
            _ip("netns", "add", host.namespace)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                "name",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.namespace,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def _trap_sigterm(self) -> None:
        # SIGTERM (a scheduler stopping us) must tear down like Ctrl-C does.
        def interrupt(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main thread: the caller owns signal handling
            self._previous_sigterm = None

    def teardown(self) -> None:
        """Kill every process on every host and delete the namespaces (and with them the links
        and the bridge). Idempotent; never raises.
        """
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        present = set(_ip("netns", "list", check=False).stdout.split())
        for namespace in [h.namespace for h in self.hosts] + [self.switch]:
            if namespace in present:
                _kill_all(namespace)
                _ip("netns", "del", namespace, check=False)
        for host in self.hosts:
            shutil.rmtree(host.memory, ignore_errors=True)

    def namespaces(self) -> list[str]:
        """This cluster's namespaces that exist now."""
        present = set(_ip("netns", "list", check=False).stdout.split())
        return [n for n in [h.namespace for h in self.hosts] + [self.switch] if n in present]

    # ------------------------------------------------------------ Placement (trainer.launch.local)
    def rdzv_endpoint(self) -> str:
        """The rendezvous endpoint: on host 0, as on a PyTorchJob's first Worker pod."""
        return f"{self.hosts[0].address}:{RDZV_PORT}"

    def replica_command(self, node: int, argv: list[str]) -> list[str]:
        """Run ``argv`` on host ``node`` (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.hosts[node].namespace, *argv]

    def replica_env(self, node: int) -> dict[str, str]:
        """Each replica advertises its host's address: the launcher's (workers' MASTER_ADDR,
        rendezvous) and gloo's (its interface: by default gloo resolves the hostname, which is
        the same loopback name in every namespace). Host 0's launcher hosts the rendezvous store
        (for the same reason it cannot tell by itself). The local tier goes to the host's own memory.
        """
        return {
            "PET_LOCAL_ADDR": self.hosts[node].address,
            "PET_RDZV_CONF": f"is_host={int(node == 0)}",
            "GLOO_SOCKET_IFNAME": "eth0",
            LOCAL_TIER_ROOT_ENV: str(self.hosts[node].memory),
        }

    # ------------------------------------------------------------ NodeControl (trainer.faults)
    def kill_node(self, node: int) -> None:
        """SIGKILL every process on host ``node`` at once; its memory (local tier) is gone with it."""
        _kill_all(self.hosts[node].namespace)
        shutil.rmtree(self.hosts[node].memory, ignore_errors=True)

    def set_link(self, node: int, up: bool) -> None:
        """Take host ``node``'s switch port down (packets are dropped silently) or back up."""
        _ip("-n", self.switch, "link", "set", f"p{node}", "up" if up else "down")

    def pids(self, node: int) -> list[int]:
        """Processes running on host ``node``."""
        return _pids(self.hosts[node].namespace)
