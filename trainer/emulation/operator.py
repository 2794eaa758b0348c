"""The controller half of the emulated cluster: the training operator v1.9.4 and a kubelet.

**The operator** turns each stored PyTorchJob into pods as the training operator does:
``<job>-<type>-<i>`` for every replica, labelled ``training.kubeflow.org/job-name``,
``replica-type``, ``replica-index``, ``operator-name`` and ``job-role: master`` (the Master, or
Worker 0 when there is none), owned by the job, with the injected environment
(:func:`operator_env`). It sets the job's conditions as the operator does (Created, Running,
Restarting, Succeeded, Failed: reasons ``PyTorchJob<Condition>``, the Running condition set False
when the job ends), its replica statuses, start and completion times; it enforces the run policy:
``backoffLimit`` (the sum of the pods' container restarts), ``cleanPodPolicy`` when the job ends
and ``ttlSecondsAfterFinished``. A replica's ``restartPolicy`` goes to its pods, except
``ExitCode``: those pods get ``Never`` and the operator itself deletes and recreates a pod that
failed with a retryable code (128-255: killed by a signal) and fails the job on any other (1-127).

**The kubelet** runs each pod's container as a local process (``trainer.emulation.container``):
the container's ``command`` + ``args`` (``$(VAR)`` expanded), the image's environment (this
machine's venv stands for the image), ``envFrom`` and ``env`` (secrets from the cluster), the pod's
volumes mounted at their ``mountPath`` (a claim maps to a local directory, an ``emptyDir`` to a
per-pod directory or tmpfs, a secret to files), the pod's name as hostname, the job's service
names resolvable, every pod of one job in one network namespace of its own. It restarts a
container per the pod's ``restartPolicy`` (Always, OnFailure) after the kubelet's crash-loop
back-off, records exit codes (a signal ``N`` is ``128+N``) and restart counts, and deletes a pod
gracefully: SIGTERM to the container's process, SIGKILL to everything left after
``terminationGracePeriodSeconds``, then the pod is gone.
"""

from __future__ import annotations

import calendar
import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainer.emulation.apiserver import GROUP, KIND, PLURAL, VERSION, ApiError, Store, new_metadata, not_found, now_rfc3339
from trainer.process import die_with_parent

LABEL = "training.kubeflow.org/"
OPERATOR_NAME = "pytorchjob-controller"
DEFAULT_PORT = 23456  # the operator's default pytorchjob-port (Master)
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def operator_env(job: dict, rtype: str, index: int) -> list[dict[str, str]]:
    """The environment the training operator v1.9.4 appends to every container of a replica
    (``pkg/controller.v1/pytorch/envvar.go`` and ``elastic.go``).
    """
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    nproc = spec.get("nprocPerNode", "auto")
    total = sum(r.get("replicas", 1) for r in replicas.values())
    if "Master" in replicas:
        rank = index + 1 if rtype == "Worker" else index
        port = _port(replicas["Master"]) or DEFAULT_PORT
        env += [
            {"name": "MASTER_PORT", "value": str(port)},
            {"name": "PET_MASTER_PORT", "value": str(port)},
            {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
            {"name": "PET_MASTER_ADDR", "value": f"{name}-master-0"},
            {"name": "WORLD_SIZE", "value": str(total * (int(nproc) if nproc.isdigit() else 1))},
            {"name": "RANK", "value": str(rank)},
            {"name": "PET_NODE_RANK", "value": str(rank)},
        ]
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        port = elastic.get("rdzvPort") or _port(replicas["Worker"])
        env.append({"name": "PET_RDZV_ENDPOINT", "value": f"{elastic.get('rdzvHost') or name + '-worker-0'}:{port}"})
        env.append({"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend") or "c10d"})
        if elastic.get("minReplicas") is None and elastic.get("maxReplicas") is None:
            env.append({"name": "PET_NNODES", "value": str(replicas["Worker"].get("replicas", 1))})
        else:
            env.append({"name": "PET_NNODES", "value": f"{elastic.get('minReplicas')}:{elastic.get('maxReplicas')}"})
        if elastic.get("maxRestarts") is not None:
            env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
        if elastic.get("rdzvId") is not None:
            env.append({"name": "PET_RDZV_ID", "value": elastic["rdzvId"]})
        if elastic.get("rdzvConf"):
            env.append({"name": "PET_RDZV_CONF", "value": ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])})
        if elastic.get("standalone"):
            env.append({"name": "PET_STANDALONE", "value": ""})
    else:
        env.append({"name": "PET_NNODES", "value": str(total)})
    env.append({"name": "PET_NPROC_PER_NODE", "value": nproc})
    return env


def _port(replica: dict) -> int | None:
    for container in replica["template"]["spec"]["containers"]:
        if container["name"] == "pytorch":
            for port in container.get("ports") or []:
                if port.get("name") == "pytorchjob-port":
                    return port["containerPort"]
    return None


def _condition(status: dict, kind: str, message: str) -> None:
    """Set a job condition as the operator's ``UpdateJobConditions`` does: Running and Restarting
    replace each other, a finished job's Running condition turns False, a repeat is not added.
    """
    conditions = status.setdefault("conditions", [])
    reason = f"{KIND}{kind}"
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is not None and current["status"] == "True" and current["reason"] == reason:
        return
    kept = []
    for c in conditions:
        if c["type"] == kind or {c["type"], kind} == {"Running", "Restarting"}:
            continue
        if kind in ("Succeeded", "Failed") and c["type"] == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    stamp = now_rfc3339()
    kept.append(
        {"type": kind, "status": "True", "reason": reason, "message": message, "lastUpdateTime": stamp, "lastTransitionTime": stamp}
    )
    status["conditions"] = kept


def _finished(status: dict) -> bool:
    return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True" for c in status.get("conditions") or [])


@dataclass
class _Container:
    """The current (or last) run of a pod's one container."""

    proc: subprocess.Popen | None = None
    log: Path | None = None
    log_file: IO[bytes] | None = None
    restart_at: float = 0.0
    kill_at: float | None = None


class Controllers:
    """The operator and the kubelet, run by one control loop thread (``run``); every process is
    started from that thread, so PR_SET_PDEATHSIG ties the pods to the loop's life.
    """

    def __init__(
        self, store: Store, root: Path, claims: dict[str, Path], secrets: dict[tuple[str, str], dict[str, str]], backoff_s: float
    ) -> None:
        self.store, self.root, self.claims, self.secrets, self.backoff_s = store, root, claims, secrets, backoff_s
        self.containers: dict[str, _Container] = {}  # by pod uid
        self.networks: dict[str, subprocess.Popen] = {}  # by job uid: the holder of its network namespace
        self.recreated: dict[str, int] = {}  # by job uid: pods the operator recreated (ExitCode)
        self.stop = threading.Event()

    # ------------------------------------------------------------ the API server's hooks
    def delete_pod(self, pod: dict, grace: int | None) -> None:
        """Mark a pod for graceful deletion (the kubelet does the rest)."""
        meta = pod["metadata"]
        if "deletionTimestamp" not in meta:
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30)
            self.store.touch(pod)

    def log_source(self, namespace: str, name: str, container: str, *, previous: bool) -> tuple[Path, Callable[[], bool]]:
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
                raise ApiError(400, "BadRequest", f'container "{names[0]}" in pod "{name}" is waiting to start: ContainerCreating')
            log, proc = state.log, state.proc
            if previous:
                count = int(log.stem.rsplit("-", 1)[1])
                if count == 0:
                    raise ApiError(400, "BadRequest", f'previous terminated container "{names[0]}" in pod "{name}" not found')
                return log.with_name(f"{names[0]}-{count - 1}.log"), lambda: False
        return log, lambda: state.proc is proc and proc is not None and proc.poll() is None

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        """Reconcile every 0.1 s until ``stop`` is set, then stop every pod."""
        while not self.stop.is_set():
            with self.store.lock:
                for job in self.store.items(PLURAL):
                    self._reconcile_job(job)
                self._collect_garbage()
                for pod in self.store.items("pods"):
                    self._sync_pod(pod)
            time.sleep(0.1)
        self._shutdown()

    def _shutdown(self) -> None:
        with self.store.lock:
            for state in self.containers.values():
                if state.proc is not None and state.proc.poll() is None:
                    _kill_group(state.proc, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for state in self.containers.values():
                if state.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        state.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                    _kill_group(state.proc, signal.SIGKILL)
                    state.proc.wait()
                if state.log_file is not None:
                    state.log_file.close()
            for holder in self.networks.values():
                holder.kill()
                holder.wait()

    # ------------------------------------------------------------ the operator
    def _reconcile_job(self, job: dict) -> None:
        meta, spec = job["metadata"], job["spec"]
        status = job.setdefault("status", {})
        before = copy.deepcopy(status)
        pods = self._pods_of(job)
        if "deletionTimestamp" in meta:  # foreground deletion: the pods go first, then the job
            for pod in pods:
                self.delete_pod(pod, None)
            if not pods:
                self.store.remove(PLURAL, meta["namespace"], meta["name"])
            return
        run_policy = spec.get("runPolicy") or {}
        if _finished(status):
            ttl = run_policy.get("ttlSecondsAfterFinished")
            done = calendar.timegm(time.strptime(status["completionTime"], "%Y-%m-%dT%H:%M:%SZ"))
            if ttl is not None and time.time() >= done + ttl:
                self.store.remove(PLURAL, meta["namespace"], meta["name"])  # background: the garbage collector takes the pods
            return
        if not status.get("conditions"):
            _condition(status, "Created", f"{KIND} {meta['name']} is created.")
            status["startTime"] = now_rfc3339()
        by_name = {p["metadata"]["name"]: p for p in pods}
        replica_statuses = {}
        failure = ""
        for rtype, replica in spec["pytorchReplicaSpecs"].items():
            counts = {"active": 0, "succeeded": 0, "failed": 0}
            policy = replica.get("restartPolicy", "Never")
            for index in range(replica.get("replicas", 1)):
                pod = by_name.get(f"{meta['name']}-{rtype.lower()}-{index}")
                if pod is None:
                    self._create_pod(job, rtype, index, replica)
                    counts["active"] += 1
                    continue
                phase = pod["status"].get("phase", "Pending")
                if "deletionTimestamp" in pod["metadata"]:
                    continue  # on its way out (recreated once gone)
                if phase == "Failed":
                    code = _exit_code(pod)
                    if policy in ("OnFailure", "Always") or (policy == "ExitCode" and code >= 128):
                        self.delete_pod(pod, 0)  # recreated once it is gone
                        self.recreated[meta["uid"]] = self.recreated.get(meta["uid"], 0) + 1
                        _condition(status, "Restarting", f"{KIND} {meta['name']} is restarting because 1 {rtype} replica(s) failed.")
                        continue
                    counts["failed"] += 1
                    failure = f"{KIND} {meta['name']} is failed because {counts['failed']} {rtype} replica(s) failed."
                elif phase == "Succeeded":
                    counts["succeeded"] += 1
                else:
                    counts["active"] += 1
            replica_statuses[rtype] = {
                **{k: v for k, v in counts.items() if v},
                "selector": f"{LABEL}job-name={meta['name']},{LABEL}operator-name={OPERATOR_NAME},{LABEL}replica-type={rtype.lower()}",
            }
        status["replicaStatuses"] = replica_statuses
        worker = replica_statuses.get("Worker", {})
        master = replica_statuses.get("Master")
        if self._past_backoff_limit(job, pods):
            _condition(status, "Failed", f"{KIND} {meta['name']} has failed because it has reached the specified backoff limit")
        elif failure:
            _condition(status, "Failed", failure)
        elif (master and master.get("succeeded")) or (
            master is None
            and (
                worker.get("succeeded", 0) == spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1)
                or (spec.get("elasticPolicy") and worker.get("succeeded"))
            )
        ):
            _condition(status, "Succeeded", f"{KIND} {meta['namespace']}/{meta['name']} successfully completed.")
        elif any(self._running(p) for p in pods):
            _condition(status, "Running", f"{KIND} {meta['namespace']}/{meta['name']} is running.")
        if _finished(status):
            status["completionTime"] = now_rfc3339()
            self._clean_pods(pods, run_policy.get("cleanPodPolicy", "None"))
        if status != before:
            self.store.touch(job)

    def _past_backoff_limit(self, job: dict, pods: list[dict]) -> bool:
        """The operator's test: container restarts of running pods whose replica restarts them
        (OnFailure, Always), plus pods the operator recreated, reach ``backoffLimit``.
        """
        limit = (job["spec"].get("runPolicy") or {}).get("backoffLimit")
        if limit is None:
            return False
        restarts = self.recreated.get(job["metadata"]["uid"], 0)
        for pod in pods:
            rtype = pod["metadata"]["labels"][f"{LABEL}replica-type"]
            replica = next(r for t, r in job["spec"]["pytorchReplicaSpecs"].items() if t.lower() == rtype)
            if replica.get("restartPolicy") in ("OnFailure", "Always") and pod["status"].get("phase") == "Running":
                restarts += sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])
        return restarts > 0 if limit == 0 else restarts >= limit

    def _clean_pods(self, pods: list[dict], policy: str) -> None:
        for pod in pods:
            if policy == "All" or (policy == "Running" and pod["status"].get("phase") in ("Running", "Pending")):
                self.delete_pod(pod, None)

    def _pods_of(self, job: dict) -> list[dict]:
        uid = job["metadata"]["uid"]
        return [
            p
            for p in self.store.items("pods", job["metadata"]["namespace"])
            if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
        ]

    def _create_pod(self, job: dict, rtype: str, index: int, replica: dict) -> None:
        meta = job["metadata"]
        template = copy.deepcopy(replica["template"])
        pod_spec = template["spec"]
        for container in pod_spec["containers"]:
            container["env"] = (container.get("env") or []) + operator_env(job, rtype, index)
        policy = replica.get("restartPolicy", "Never")
        pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        labels = {
            **(template.get("metadata", {}).get("labels") or {}),
            f"{LABEL}job-name": meta["name"],
            f"{LABEL}operator-name": OPERATOR_NAME,
            f"{LABEL}replica-type": rtype.lower(),
            f"{LABEL}replica-index": str(index),
        }
        if rtype == "Master" or ("Master" not in job["spec"]["pytorchReplicaSpecs"] and rtype == "Worker" and index == 0):
            labels[f"{LABEL}job-role"] = "master"
        owner = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        pod_meta = {
            **(template.get("metadata") or {}),
            "name": f"{meta['name']}-{rtype.lower()}-{index}",
            "labels": labels,
            "ownerReferences": [owner],
        }
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": new_metadata(pod_meta, meta["namespace"]), "spec": pod_spec}
        pod["status"] = {"phase": "Pending", "podIP": _address(job["spec"], rtype, index)}
        self.store.put("pods", pod)

    def _collect_garbage(self) -> None:
        """Delete (gracefully) pods whose owning job is gone, as the garbage collector does."""
        jobs = {j["metadata"]["uid"] for j in self.store.items(PLURAL)}
        for pod in self.store.items("pods"):
            refs = pod["metadata"].get("ownerReferences") or []
            if refs and not any(r["uid"] in jobs for r in refs):
                self.delete_pod(pod, None)
        for uid in [u for u in self.networks if u not in jobs and not any(self._in_network(p, u) for p in self.store.items("pods"))]:
            holder = self.networks.pop(uid)
            holder.kill()
            holder.wait()

    @staticmethod
    def _in_network(pod: dict, job_uid: str) -> bool:
        return any(r["uid"] == job_uid for r in pod["metadata"].get("ownerReferences") or [])

    @staticmethod
    def _running(pod: dict) -> bool:
        return pod["status"].get("phase") == "Running"

    # ------------------------------------------------------------ the kubelet
    def _sync_pod(self, pod: dict) -> None:
        meta, status = pod["metadata"], pod["status"]
        state = self.containers.setdefault(meta["uid"], _Container())
        alive = state.proc is not None and state.proc.poll() is None
        if "deletionTimestamp" in meta:
            if alive and state.kill_at is None:
                state.proc.send_signal(signal.SIGTERM)  # to the container's process, as a runtime signals PID 1
                state.kill_at = time.monotonic() + meta["deletionGracePeriodSeconds"]
            if alive and time.monotonic() < (state.kill_at or 0):
                return
            if state.proc is not None:
                _kill_group(state.proc, signal.SIGKILL)  # whatever is left of the container
                state.proc.wait()
            if state.log_file is not None:
                state.log_file.close()
            self.containers.pop(meta["uid"], None)
            self.store.remove("pods", meta["namespace"], meta["name"])
            return
        if status["phase"] in ("Succeeded", "Failed"):
            return
        if state.proc is None:
            self._start(pod, state)
            return
        if alive:
            return
        code = state.proc.returncode
        code = 128 - code if code < 0 else code  # a signal N reads 128+N, as the runtime reports it
        _kill_group(state.proc, signal.SIGKILL)  # the container ends with its main process
        cstatus = status["containerStatuses"][0]
        if cstatus["state"].get("running"):
            finished = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": cstatus["state"]["running"]["startedAt"],
            }
            cstatus["state"] = {"terminated": {**finished, "finishedAt": now_rfc3339()}}
            cstatus["ready"] = False
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                # The kubelet's crash-loop back-off: 10 s, doubling, at most 5 minutes.
                state.restart_at = time.monotonic() + min(self.backoff_s * 2 ** cstatus["restartCount"], 300)
                cstatus["lastState"], cstatus["state"] = cstatus["state"], {"waiting": {"reason": "CrashLoopBackOff"}}
            else:
                status["phase"] = "Succeeded" if code == 0 else "Failed"
            self.store.touch(pod)
        elif time.monotonic() >= state.restart_at:
            cstatus["restartCount"] += 1
            self._start(pod, state)

    def _start(self, pod: dict, state: _Container) -> None:
        spec, status = pod["spec"], pod["status"]
        container = spec["containers"][0]
        restarts = (status.get("containerStatuses") or [{}])[0].get("restartCount", 0)
        try:
            launch = self._container_spec(pod, container)
        except ApiError as e:  # a missing claim or secret: the pod waits, as it would on a node
            status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": e.reason, "message": e.message}]
            self.store.touch(pod)
            return
        pod_dir = self._pod_dir(pod)
        state.log = pod_dir / f"{container['name']}-{restarts}.log"
        if state.log_file is not None:
            state.log_file.close()
        state.log_file = open(state.log, "ab")  # noqa: SIM115 (closed when the pod goes)
        state.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.emulation.container", json.dumps(launch)],
            stdout=state.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent,  # the loop thread started it: the pod dies with the cluster
        )  # fmt: skip
        started = now_rfc3339()
        status.update(phase="Running", startTime=status.get("startTime", started), hostIP="127.0.0.1", conditions=[])
        cstatus = {"name": container["name"], "image": container.get("image", ""), "restartCount": restarts, "ready": True}
        cstatus["imageID"] = cstatus["containerID"] = f"emulated://{container.get('image', '')}"
        previous = (status.get("containerStatuses") or [{}])[0].get("lastState")
        status["containerStatuses"] = [
            {**cstatus, "state": {"running": {"startedAt": started}}, **({"lastState": previous} if previous else {})}
        ]
        self.store.touch(pod)

    def _pod_dir(self, pod: dict) -> Path:
        path = self.root / "pods" / f"{pod['metadata']['namespace']}_{pod['metadata']['name']}_{pod['metadata']['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _network(self, pod: dict) -> str:
        """The job's network namespace (created with its first pod): ``/proc/PID/ns/net`` of a
        process that only holds it, loopback up; it goes when the holder is killed.
        """
        job_uid = pod["metadata"]["ownerReferences"][0]["uid"]
        if job_uid not in self.networks:
            holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], start_new_session=True, preexec_fn=die_with_parent)
            own = os.readlink("/proc/self/ns/net")
            while os.readlink(f"/proc/{holder.pid}/ns/net") == own:  # until unshare has made it
                time.sleep(0.01)
            subprocess.run(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "ip", "link", "set", "lo", "up"], check=True)
            self.networks[job_uid] = holder
        return f"/proc/{self.networks[job_uid].pid}/ns/net"

    def _container_spec(self, pod: dict, container: dict) -> dict:
        """What ``trainer.emulation.container`` needs: network, mounts, hosts, env, argv."""
        meta, spec = pod["metadata"], pod["spec"]
        ns = meta["namespace"]
        pod_dir = self._pod_dir(pod)
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts = []
        for vm in container.get("volumeMounts") or []:
            volume = volumes[vm["name"]]
            mount = {"target": vm["mountPath"], "readOnly": vm.get("readOnly", False)}
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    raise ApiError(400, "Unschedulable", f'persistentvolumeclaim "{claim}" not found')
                mount.update(kind="bind", source=str(self.claims[claim] / vm.get("subPath", "")))
            elif "emptyDir" in volume:
                if volume["emptyDir"].get("medium") == "Memory":
                    mount.update(kind="tmpfs", size=_bytes(volume["emptyDir"].get("sizeLimit")))
                else:
                    source = pod_dir / "volumes" / vm["name"]
                    source.mkdir(parents=True, exist_ok=True)
                    mount.update(kind="bind", source=str(source))
            elif "secret" in volume:
                name = volume["secret"]["secretName"]
                data = self.secrets.get((ns, name))
                if data is None and not volume["secret"].get("optional"):
                    raise ApiError(400, "FailedMount", f'secret "{name}" not found')
                source = pod_dir / "volumes" / vm["name"]
                source.mkdir(parents=True, exist_ok=True)
                for key, value in (data or {}).items():
                    (source / key).write_text(value)
                mount.update(kind="bind", source=str(source), readOnly=True)
            else:
                raise ApiError(
                    400, "FailedMount", f"volume {vm['name']}: only persistentVolumeClaim, emptyDir and secret volumes are emulated"
                )
            mounts.append(mount)
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(pod_dir)}
        env["HOSTNAME"] = meta["name"]
        for source in container.get("envFrom") or []:
            ref = source.get("secretRef")
            if ref is None:
                raise ApiError(400, "CreateContainerConfigError", "only secretRef is emulated in envFrom")
            data = self.secrets.get((ns, ref["name"]))
            if data is None and not ref.get("optional"):
                raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" not found')
            env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
        for var in container.get("env") or []:
            env[var["name"]] = self._env_value(pod, var, env)
        argv = [_expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not argv:
            raise ApiError(400, "CreateContainerError", "the emulated image has no entrypoint: set the container's command")
        hosts = pod_dir / "hosts"
        peers = self._pods_of_owner(pod)
        hosts.write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(f"{p['status']['podIP']}\t{p['metadata']['name']}\n" for p in peers)
        )
        return {
            "netns": self._network(pod),
            "hostname": meta["name"],
            "hosts": str(hosts),
            "mounts": mounts,
            "env": env,
            "argv": argv,
            "cwd": container.get("workingDir") or str(pod_dir),
        }

    def _pods_of_owner(self, pod: dict) -> list[dict]:
        uid = pod["metadata"]["ownerReferences"][0]["uid"]
        return [p for p in self.store.items("pods", pod["metadata"]["namespace"]) if self._in_network(p, uid)]

    def _env_value(self, pod: dict, var: dict, env: dict[str, str]) -> str:
        if "valueFrom" not in var:
            return _expand(var.get("value", ""), env)
        source = var["valueFrom"]
        if "fieldRef" in source:
            fields = {
                "metadata.name": pod["metadata"]["name"],
                "metadata.namespace": pod["metadata"]["namespace"],
                "status.podIP": pod["status"]["podIP"],
            }
            return fields[source["fieldRef"]["fieldPath"]]
        ref = source.get("secretKeyRef")
        if ref is None:
            raise ApiError(400, "CreateContainerConfigError", f"env {var['name']}: only value, fieldRef and secretKeyRef are emulated")
        data = self.secrets.get((pod["metadata"]["namespace"], ref["name"])) or {}
        if ref["key"] not in data and not ref.get("optional"):
            raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" has no key {ref["key"]}')
        return data.get(ref["key"], "")


def _address(spec: dict, rtype: str, index: int) -> str:
    """A pod's address in its job's network: stable per replica, as its service name is."""
    base = 10 + 10 * sorted(spec["pytorchReplicaSpecs"]).index(rtype)
    return f"127.{base}.{index // 250}.{index % 250 + 1}"


def _exit_code(pod: dict) -> int:
    terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated") or {}
    return terminated.get("exitCode", 0)


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` escapes; an unknown reference stays as written)."""
    return _VAR_REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def _bytes(quantity: str | None) -> int | None:
    if not quantity:
        return None
    m = _QUANTITY.match(quantity)
    return int(float(m[1]) * _UNITS[m[2] or ""]) if m else None


def _kill_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
