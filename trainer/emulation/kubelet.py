"""The kubelet of the emulated cluster: it runs each pod's container as a local process.

The cluster has ``nodes`` Nodes (``emulated-node-0`` ...: objects of the API; all of them are this
machine). The scheduler binds each pod to the Ready node that runs the fewest pods. A Node deleted
(``kubectl delete node``) stands for a machine lost: the node's processes die at once (SIGKILL,
no SIGTERM: no kubelet is left to send one) with its memory, and, as the pod garbage collector
does with the pods of a node that no longer exists, its pods are marked Failed (condition
``DisruptionTarget``, reason ``DeletionByPodGC``) and deleted at once; their owner replaces them.

It runs a pod's container with ``trainer.emulation.container``: the container's ``command`` +
``args`` (``$(VAR)`` expanded), the image's environment (this machine's venv stands for the
image), ``envFrom`` and ``env`` (secrets from the cluster), the pod's volumes mounted at their
``mountPath`` (a claim maps to a local directory, an ``emptyDir`` to a per-pod directory or tmpfs,
a secret to files), the pod's name as hostname, the job's service names resolvable, every pod of
one job in one network namespace of its own. Each pod has a sandbox (a mount namespace held by a
process of its own, as the pause container holds a pod's namespaces): its ``medium: Memory``
emptyDirs live there, so they outlive container restarts and go with the pod. It restarts a
container per the pod's ``restartPolicy`` (Always, OnFailure) after the kubelet's crash-loop
back-off, records exit codes (a signal ``N`` is ``128+N``) and restart counts, and deletes a pod
gracefully: SIGTERM to the container's process, SIGKILL to everything left after
``terminationGracePeriodSeconds``; the pod then shows its terminal phase (Succeeded for exit code
0, else Failed, as Kubernetes 1.27+ does) for one sync of the controllers, and is gone. Whenever a
container ends, every process it started is killed with it, as a runtime kills the container's
cgroup: here, every process in its mount namespace. It records the kubelet's Events (Pulled,
Created, Started, BackOff, Killing, FailedMount), the scheduler's (Scheduled, FailedScheduling)
and the node controller's (RemovingNode).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from trainer.emulation.api import ApiError, Store, not_found, now_rfc3339
from trainer.emulation.events import Recorder
from trainer.emulation.specs import container_spec, node_object
from trainer.process import die_with_parent

NODE_PREFIX = "emulated-node"
"""The nodes are ``emulated-node-0``, ``emulated-node-1``, ..."""
_TERMINAL = ("Succeeded", "Failed")


@dataclass
class _Container:
    """The current (or last) run of a pod's one container."""

    proc: subprocess.Popen | None = None
    log: Path | None = None
    log_file: IO[bytes] | None = None
    restart_at: float = 0.0
    kill_at: float | None = None
    terminal: bool = False
    """A deleted pod's container has ended and the pod shows its terminal phase."""
    namespaces: set[str] = field(default_factory=set)
    """The mount namespace of the container's current run (``mnt:[INODE]``), once known: every
    process in it is the container's."""
    channel: socket.socket | None = None
    """Where the current run sends its mount namespace (an fd), once it has made it."""
    held: list[int] = field(default_factory=list)
    """Open fds of ``namespaces``: while one is held, its inode (its name) cannot go to another
    namespace."""
    sandbox: str = ""
    """The pod's sandbox's mount namespace (``mnt:[INODE]``)."""


class Kubelet:
    """The nodes' side of the control loop (``trainer.emulation.operator.Controllers`` calls
    ``sync_nodes``, then ``sync_pod`` for each pod); ``enabled=False``: no node, and no container
    is ever started (pods stay Pending, deletions complete at once).
    """

    def __init__(
        self,
        store: Store,
        root: Path,
        claims: dict[str, Path],
        secrets: dict[tuple[str, str], dict[str, str]],
        backoff_s: float,
        events: Recorder,
        *,
        enabled: bool = True,
        nodes: int = 4,
    ) -> None:
        self.store, self.root, self.claims, self.secrets, self.backoff_s = store, root, claims, secrets, backoff_s
        self.events, self.enabled = events, enabled
        self.containers: dict[str, _Container] = {}  # by pod uid
        self.networks: dict[str, subprocess.Popen] = {}  # by job uid: the holder of its network namespace
        self.sandboxes: dict[str, subprocess.Popen] = {}  # by pod uid: the holder of its mount namespace
        self.own_namespace = os.readlink("/proc/self/ns/mnt")
        self.nodes: dict[str, dict] = {}  # by name: the nodes registered and not yet seen gone
        with store.lock:
            for i in range(nodes if enabled else 0):
                node = store.put("nodes", node_object(f"{NODE_PREFIX}-{i}"))
                self.nodes[node["metadata"]["name"]] = node

    def delete_pod(self, pod: dict, grace: int | None) -> None:
        """Mark a pod for graceful deletion (the kubelet does the rest)."""
        meta = pod["metadata"]
        if "deletionTimestamp" not in meta:
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = (
                grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30)
            )
            self.store.touch(pod)

    def log_source(
        self, namespace: str, name: str, container: str, *, previous: bool
    ) -> tuple[Path, Callable[[], bool]]:
        """The log file of a pod's container (the current run, or the previous one) and a test of
        whether that run is still going.

        Raises:
            ApiError: 404 for an unknown pod, 400 for a wrong container or one not started yet.
        """
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            if pod is None:
                raise not_found("pods", name)
            names = [c["name"] for c in pod["spec"]["containers"]]
            if container and container not in names:
                raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
            state = self.containers.get(pod["metadata"]["uid"])
            if state is None or state.log is None:
                raise ApiError(
                    400, "BadRequest", f'container "{names[0]}" in pod "{name}" is waiting to start: ContainerCreating'
                )
            log, proc = state.log, state.proc
            if previous:
                count = int(log.stem.rsplit("-", 1)[1])
                if count == 0:
                    raise ApiError(
                        400, "BadRequest", f'previous terminated container "{names[0]}" in pod "{name}" not found'
                    )
                return log.with_name(f"{names[0]}-{count - 1}.log"), lambda: False
        return log, lambda: state.proc is proc and proc is not None and proc.poll() is None

    def shutdown(self) -> None:
        """Stop every container (SIGTERM, SIGKILL after 10 s) and every job network."""
        with self.store.lock:
            for state in self.containers.values():
                if state.proc is not None and state.proc.poll() is None:
                    _kill_group(state.proc, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for state in self.containers.values():
                if state.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        state.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                    self._kill_container(state)
                if state.log_file is not None:
                    state.log_file.close()
            for holder in [*self.sandboxes.values(), *self.networks.values()]:
                holder.kill()
                holder.wait()

    @staticmethod
    def in_network(pod: dict, job_uid: str) -> bool:
        """Whether the pod is one of the job's (and so in its network)."""
        return any(r["uid"] == job_uid for r in pod["metadata"].get("ownerReferences") or [])

    def sync_nodes(self) -> None:
        """The node controller: a registered node no longer stored was deleted (its pods go in
        ``sync_pod``).
        """
        for name in [n for n in self.nodes if self.store.get("nodes", "", n) is None]:
            node = self.nodes.pop(name)
            message = f"Node {name} event: Removing Node {name} from Controller"
            self.events.record(node, "Normal", "RemovingNode", message, component="node-controller")

    def sync_pod(self, pod: dict) -> None:
        """One step of the pod's life: start, watch, restart, or stop and remove its container;
        or, when its node is gone, its end with the node.
        """
        meta, status = pod["metadata"], pod["status"]
        state = self.containers.setdefault(meta["uid"], _Container())
        node = pod["spec"].get("nodeName")
        if node and self.store.get("nodes", "", node) is None:
            self._lost_with_node(pod, state)
            return
        alive = state.proc is not None and state.proc.poll() is None
        if state.channel is not None:
            self._note_namespace(state)
        if not self.enabled and "deletionTimestamp" not in meta:
            self._unschedulable(pod, "Unschedulable", "0/0 nodes are available: no nodes available to schedule pods.")
            return
        if "deletionTimestamp" in meta:
            if alive and state.kill_at is None:
                state.proc.send_signal(signal.SIGTERM)  # to the container's process, as a runtime signals PID 1
                state.kill_at = time.monotonic() + meta["deletionGracePeriodSeconds"]
                name = pod["spec"]["containers"][0]["name"]
                self._event(pod, "Normal", "Killing", f"Stopping container {name}", container=name)
            if alive and time.monotonic() < (state.kill_at or 0):
                return
            if state.proc is not None and not state.terminal:
                self._kill_container(state)  # whatever is left of the container
                # Kubernetes 1.27+: a deleted pod reaches a terminal phase, from its container's
                # exit code, before it is removed. Controllers see it for one sync: the operator
                # counts an evicted pod that exited 0 as succeeded, as the training operator does.
                state.terminal = self._terminate(pod, state.proc.returncode)
                if state.terminal:
                    return
            self._forget(pod)
            self.store.remove("pods", meta["namespace"], meta["name"])
            return
        if status["phase"] in _TERMINAL:
            self._release_sandbox(meta["uid"])  # its container never runs again
            return
        if state.proc is None:
            self._start(pod, state)
            return
        if alive:
            return
        code = _exit_code(state.proc.returncode)
        cstatus = status["containerStatuses"][0]
        if cstatus["state"].get("running"):
            self._kill_container(state)  # the container ends with its main process
            _record_exit(cstatus, code)
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                # The kubelet's crash-loop back-off: 10 s, doubling, at most 5 minutes.
                state.restart_at = time.monotonic() + min(self.backoff_s * 2 ** cstatus["restartCount"], 300)
                cstatus["lastState"], cstatus["state"] = cstatus["state"], {"waiting": {"reason": "CrashLoopBackOff"}}
                name = cstatus["name"]
                where = f"{meta['name']}_{meta['namespace']}({meta['uid']})"
                self._event(
                    pod,
                    "Warning",
                    "BackOff",
                    f"Back-off restarting failed container {name} in pod {where}",
                    container=name,
                )
            else:
                status["phase"] = "Succeeded" if code == 0 else "Failed"
            self.store.touch(pod)
        elif time.monotonic() >= state.restart_at:
            cstatus["restartCount"] += 1
            self._start(pod, state)

    def _lost_with_node(self, pod: dict, state: _Container) -> None:
        """The pod's node is gone, and its kubelet with it: every process of the pod dies at once
        (SIGKILL; nothing sends SIGTERM), its memory with its sandbox. As the pod garbage
        collector does with a pod whose node no longer exists, the pod is marked Failed with the
        condition ``DisruptionTarget`` and deleted at once (grace 0: no kubelet is left to
        confirm); its owner replaces it. The real collector waits a 40 s quarantine first.
        """
        self._kill_pod(pod, state)
        meta, status = pod["metadata"], pod["status"]
        if status.get("phase") not in _TERMINAL:
            status["phase"] = "Failed"
        condition = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}
        condition.update(message="PodGC: node no longer exists", lastTransitionTime=now_rfc3339())
        status["conditions"] = [
            *(c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"),
            condition,
        ]
        meta.setdefault("deletionTimestamp", now_rfc3339())
        meta["deletionGracePeriodSeconds"] = 0
        self.store.touch(pod)
        self._forget(pod)
        self.store.remove("pods", meta["namespace"], meta["name"])

    def _forget(self, pod: dict) -> None:
        """The pod is gone: its log closed, its state and sandbox released."""
        state = self.containers.pop(pod["metadata"]["uid"], None)
        if state is not None and state.log_file is not None:
            state.log_file.close()
        self._release_sandbox(pod["metadata"]["uid"])

    def _note_namespace(self, state: _Container) -> None:
        """Take the mount namespace the container's current run sent (before it runs the
        command: what the command starts is in it, however soon it ends). The fd in flight, then
        held, keeps the namespace, and so its name, until the run is killed.
        """
        try:
            _, fds, _, _ = socket.recv_fds(state.channel, 16, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            fds = []
        for fd in fds:
            state.held.append(fd)
            state.namespaces.add(f"mnt:[{os.fstat(fd).st_ino}]")
        state.channel.close()
        state.channel = None

    def _release_namespaces(self, state: _Container) -> None:
        """The run's processes are dead: its namespace's name may go to another."""
        for fd in state.held:
            os.close(fd)
        state.held.clear()
        state.namespaces.clear()
        if state.channel is not None:
            state.channel.close()
            state.channel = None

    def _kill_container(self, state: _Container) -> None:
        """SIGKILL the container's process group and every process in its mount namespaces (a
        runtime kills the container's cgroup: ranks in sessions of their own die with it), then
        reap its main process.
        """
        if state.channel is not None:
            self._note_namespace(state)
        _kill_group(state.proc, signal.SIGKILL)
        _kill_namespaces(state.namespaces - {self.own_namespace, state.sandbox})
        state.proc.wait()
        self._release_namespaces(state)

    def _kill_pod(self, pod: dict, state: _Container) -> None:
        """SIGKILL every process of the pod at once: its containers' and its sandbox's."""
        holder = self.sandboxes.pop(pod["metadata"]["uid"], None)
        if state.channel is not None:
            self._note_namespace(state)
        if state.proc is not None:
            _kill_group(state.proc, signal.SIGKILL)
        _kill_namespaces((state.namespaces | {state.sandbox}) - {self.own_namespace, ""})
        if state.proc is not None:
            state.proc.wait()
        self._release_namespaces(state)
        if holder is not None:
            holder.kill()
            holder.wait()

    def _release_sandbox(self, uid: str) -> None:
        holder = self.sandboxes.pop(uid, None)
        if holder is not None:
            holder.kill()
            holder.wait()

    def _schedule(self, pod: dict) -> bool:
        """Bind the pod to the Ready node that runs the fewest pods (the first by name among
        equals); False (and the pod's condition and event) when there is none.
        """
        if pod["spec"].get("nodeName"):
            return True
        nodes = [n["metadata"]["name"] for n in self.store.items("nodes")]
        if not nodes:
            self._unschedulable(pod, "Unschedulable", "0/0 nodes are available: no nodes available to schedule pods.")
            return False
        load = {n: 0 for n in nodes}
        for other in self.store.items("pods"):
            bound = other["spec"].get("nodeName")
            if bound in load and other["status"].get("phase") not in _TERMINAL:
                load[bound] += 1
        node = min(nodes, key=load.__getitem__)
        pod["spec"]["nodeName"] = node
        meta = pod["metadata"]
        self._event(pod, "Normal", "Scheduled", f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}")
        return True

    def _sandbox(self, pod: dict, memory: dict[str, int | None]) -> str:
        """The pod's mount namespace (``/proc/PID/ns/mnt`` of a process that only holds it),
        made with its first container: a tmpfs mounted on each ``memory`` folder (path -> size
        in bytes, None: the default), its Memory emptyDirs, which each container's own mount
        namespace, a copy of this one, binds where it wants them. It goes with the pod; one
        that was killed is made again (empty), as a kubelet re-creates a pod sandbox that died.
        """
        uid = pod["metadata"]["uid"]
        if uid in self.sandboxes and self.sandboxes[uid].poll() is not None:  # killed: its memory is gone
            del self.sandboxes[uid]
            self._event(pod, "Normal", "SandboxChanged", "Pod sandbox changed, it will be killed and re-created.")
        if uid not in self.sandboxes:
            holder = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sleep", "infinity"],
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            # Until unshare has made it private and exec'd sleep: a tmpfs mounted before that
            # could propagate to this machine's namespace.
            while _comm(holder.pid) not in ("sleep", None) and holder.poll() is None:
                time.sleep(0.01)
            if holder.poll() is not None:
                raise RuntimeError(f"the pod's sandbox could not be made: unshare exited {holder.returncode}")
            try:
                for path, size in memory.items():
                    options = ["-o", f"size={size}"] if size else []
                    mount = ["mount", "-t", "tmpfs", *options, "tmpfs", path]
                    subprocess.run(["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", *mount], check=True)
            except BaseException:
                holder.kill()
                holder.wait()
                raise
            self.sandboxes[uid] = holder
        return f"/proc/{self.sandboxes[uid].pid}/ns/mnt"

    def _terminate(self, pod: dict, returncode: int) -> bool:
        """Give a deleted pod whose container ran its terminal phase; False if it never ran."""
        statuses = pod["status"].get("containerStatuses") or []
        if not statuses or not statuses[0]["state"].get("running"):
            return False
        code = _exit_code(returncode)
        _record_exit(statuses[0], code)
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        self.store.touch(pod)
        return True

    def _start(self, pod: dict, state: _Container) -> None:
        spec, status = pod["spec"], pod["status"]
        container = spec["containers"][0]
        restarts = (status.get("containerStatuses") or [{}])[0].get("restartCount", 0)
        try:
            launch = container_spec(
                pod,
                container,
                pod_dir=self.pod_dir(pod),
                claims=self.claims,
                secrets=self.secrets,
                network=lambda: self._network(pod),
                peers=lambda: self._pods_of_owner(pod),
            )
        except ApiError as e:  # a missing claim or secret: the pod waits, as it would on a node
            self._unschedulable(pod, e.reason, e.message)
            return
        if not self._schedule(pod):
            return
        launch["sandbox"] = self._sandbox(pod, launch.pop("memory"))
        state.sandbox = os.readlink(launch["sandbox"])
        pod_dir = self.pod_dir(pod)
        state.log = pod_dir / f"{container['name']}-{restarts}.log"
        self._release_namespaces(state)  # the last run's, whose processes are gone with it
        state.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        state.channel.setblocking(False)
        launch["namespace_fd"] = theirs.fileno()
        if state.log_file is not None:
            state.log_file.close()
        state.log_file = open(state.log, "ab")  # noqa: SIM115 (closed when the pod goes)
        state.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.emulation.container", json.dumps(launch)],
            stdout=state.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,  # the loop thread started it: the pod dies with the cluster
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        started = now_rfc3339()
        status.update(phase="Running", startTime=status.get("startTime", started), hostIP="127.0.0.1", conditions=[])
        cstatus = {
            "name": container["name"],
            "image": container.get("image", ""),
            "restartCount": restarts,
            "ready": True,
        }
        cstatus["imageID"] = cstatus["containerID"] = f"emulated://{container.get('image', '')}"
        previous = (status.get("containerStatuses") or [{}])[0].get("lastState")
        status["containerStatuses"] = [
            {**cstatus, "state": {"running": {"startedAt": started}}, **({"lastState": previous} if previous else {})}
        ]
        self.store.touch(pod)
        name, image = container["name"], container.get("image", "")
        self._event(pod, "Normal", "Pulled", f'Container image "{image}" already present on machine', container=name)
        self._event(pod, "Normal", "Created", f"Created container: {name}", container=name)
        self._event(pod, "Normal", "Started", f"Started container {name}", container=name)

    def _unschedulable(self, pod: dict, reason: str, message: str) -> None:
        """A pod that cannot start (no node; a claim, a secret missing): its condition and the
        event, once.
        """
        condition = {"type": "PodScheduled", "status": "False", "reason": reason, "message": message}
        status = pod["status"]
        if status.get("conditions") == [condition]:
            return
        status["conditions"] = [condition]
        self.store.touch(pod)
        if reason == "Unschedulable":
            nodes = len(self.store.items("nodes"))
            text = message if message.startswith("0/") else f"0/{nodes} nodes are available: {message}."
            self._event(pod, "Warning", "FailedScheduling", text, component="default-scheduler")
        else:
            self._event(pod, "Warning", "FailedMount" if reason == "FailedMount" else "Failed", message)

    def _event(
        self, pod: dict, kind: str, reason: str, message: str, *, container: str = "", component: str = "kubelet"
    ) -> None:
        field_path = f"spec.containers{{{container}}}" if container else ""
        component = component if reason != "Scheduled" else "default-scheduler"
        self.events.record(
            pod,
            kind,
            reason,
            message,
            component=component,
            field_path=field_path,
            host=pod["spec"].get("nodeName", "") if component == "kubelet" else "",
        )

    def pod_dir(self, pod: dict) -> Path:
        """The pod's own folder (its logs, hosts file and emptyDir volumes)."""
        path = (
            self.root
            / "pods"
            / f"{pod['metadata']['namespace']}_{pod['metadata']['name']}_{pod['metadata']['uid'][:8]}"
        )
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _network(self, pod: dict) -> str:
        """The job's network namespace (created with its first pod): ``/proc/PID/ns/net`` of a
        process that only holds it, loopback up; it goes when the holder is killed.
        """
        job_uid = pod["metadata"]["ownerReferences"][0]["uid"]
        if job_uid not in self.networks:
            holder = subprocess.Popen(
                ["unshare", "--net", "sleep", "infinity"], start_new_session=True, preexec_fn=die_with_parent
            )
            own = os.readlink("/proc/self/ns/net")
            while os.readlink(f"/proc/{holder.pid}/ns/net") == own:  # until unshare has made it
                time.sleep(0.01)
            subprocess.run(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "ip", "link", "set", "lo", "up"], check=True)
            self.networks[job_uid] = holder
        return f"/proc/{self.networks[job_uid].pid}/ns/net"

    def _pods_of_owner(self, pod: dict) -> list[dict]:
        uid = pod["metadata"]["ownerReferences"][0]["uid"]
        return [p for p in self.store.items("pods", pod["metadata"]["namespace"]) if self.in_network(p, uid)]


def pod_address(spec: dict, rtype: str, index: int) -> str:
    """A pod's address in its job's network: stable per replica, as its service name is."""
    base = 10 + 10 * sorted(spec["pytorchReplicaSpecs"]).index(rtype)
    return f"127.{base}.{index // 250}.{index % 250 + 1}"


def _exit_code(returncode: int) -> int:
    """A process's exit code as the runtime reports it: a signal N reads 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _record_exit(cstatus: dict, code: int) -> None:
    """Move a running container's status to terminated with ``code``."""
    finished = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": cstatus["state"]["running"]["startedAt"],
    }
    cstatus["state"] = {"terminated": {**finished, "finishedAt": now_rfc3339()}}
    cstatus["ready"] = False


def exit_code(pod: dict) -> int:
    """The exit code of the pod's terminated container (0 while none)."""
    terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated") or {}
    return terminated.get("exitCode", 0)


def _kill_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the process group ``proc`` leads, while ``proc`` is not reaped: once it is, its pid
    may be another process's, a pod's sandbox or container leading a group of its own (what is
    left of the group then dies by its mount namespace).
    """
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _kill_namespaces(namespaces: set[str]) -> None:
    """SIGKILL every process in these mount namespaces, again until none is left (one may fork
    while the others die); a killed process leaves them as it exits.
    """
    for _ in range(100 if namespaces else 0):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/mnt") not in namespaces:
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
            except OSError:  # gone meanwhile
                continue
            found = True
        if not found:
            return
        time.sleep(0.01)


def _comm(pid: int) -> str | None:
    """The process's command name (None: it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
