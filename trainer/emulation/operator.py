"""The controller half of the emulated cluster: the training operator v1.9.4 and the control loop.

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

It records the operator's Events (SuccessfulCreatePod, SuccessfulDeletePod, PyTorchJobRestarting,
PyTorchJobSucceeded, PyTorchJobFailed). The pods' side is the kubelet (``trainer.emulation.kubelet``).
"""

from __future__ import annotations

import calendar
import copy
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from trainer.emulation.api import GROUP, KIND, PLURAL, VERSION, Store, new_metadata, now_rfc3339
from trainer.emulation.events import Recorder
from trainer.emulation.kubelet import Kubelet, exit_code, pod_address

LABEL = "training.kubeflow.org/"
OPERATOR_NAME = "pytorchjob-controller"
DEFAULT_PORT = 23456  # the operator's default pytorchjob-port (Master)
_EVENTS = {"Restarting": "Warning", "Succeeded": "Normal", "Failed": "Normal"}
"""The conditions the operator records an Event for (reason ``PyTorchJob<Condition>``), by type."""


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
            env.append(
                {"name": "PET_RDZV_CONF", "value": ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])}
            )
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
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastUpdateTime": stamp,
            "lastTransitionTime": stamp,
        }
    )
    status["conditions"] = kept


def _finished(status: dict) -> bool:
    return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True" for c in status.get("conditions") or [])


class Controllers:
    """The operator and the kubelet, run by one control loop thread (``run``); every process is
    started from that thread, so PR_SET_PDEATHSIG ties the pods to the loop's life.
    """

    def __init__(
        self,
        store: Store,
        root: Path,
        claims: dict[str, Path],
        secrets: dict[tuple[str, str], dict[str, str]],
        backoff_s: float,
        *,
        kubelet: bool = True,
        nodes: int = 4,
    ) -> None:
        self.store = store
        self.events = Recorder(store)
        self.kubelet = Kubelet(store, root, claims, secrets, backoff_s, self.events, enabled=kubelet, nodes=nodes)
        self.recreated: dict[str, int] = {}  # by job uid: pods the operator recreated (ExitCode)
        self.failed: set[tuple[str, str]] = set()  # the steps that raised, by object: printed once
        self.stop = threading.Event()

    # ------------------------------------------------------------ the API server's hooks
    def delete_pod(self, pod: dict, grace: int | None) -> None:
        """Mark a pod for graceful deletion (the kubelet does the rest)."""
        self.kubelet.delete_pod(pod, grace)

    def log_source(
        self, namespace: str, name: str, container: str, *, previous: bool
    ) -> tuple[Path, Callable[[], bool]]:
        """The log file of a pod's container and a test of whether it is still running
        (:meth:`Kubelet.log_source`).
        """
        return self.kubelet.log_source(namespace, name, container, previous=previous)

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        """Reconcile every 0.1 s until ``stop`` is set, then stop every pod."""
        while not self.stop.is_set():
            with self.store.lock:
                for job in self.store.items(PLURAL):
                    self._guarded(self._reconcile_job, job)
                self._guarded(self._collect_garbage)
                self._guarded(self.kubelet.sync_nodes)
                for pod in self.store.items("pods"):
                    self._guarded(self.kubelet.sync_pod, pod)
            time.sleep(0.1)
        self.kubelet.shutdown()

    def _guarded(self, step: Callable[..., None], *args: dict) -> None:
        """One reconcile step; a bug of the emulator on one object (printed, once per object and
        step) leaves the loop, and every other object, running.
        """
        try:
            step(*args)
        except Exception:
            key = (step.__name__, args[0]["metadata"].get("uid") if args else "")
            if key not in self.failed:
                self.failed.add(key)
                traceback.print_exc()

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
                self.store.remove(
                    PLURAL, meta["namespace"], meta["name"]
                )  # background: the garbage collector takes the pods
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
                if "deletionTimestamp" in pod["metadata"] and phase not in ("Succeeded", "Failed"):
                    # On its way out (recreated once gone); its terminal phase counts, as the real operator counts it.
                    continue
                if phase == "Failed":
                    code = exit_code(pod)
                    if policy in ("OnFailure", "Always") or (policy == "ExitCode" and code >= 128):
                        self._delete_owned(job, pod, 0)  # recreated once it is gone
                        self.recreated[meta["uid"]] = self.recreated.get(meta["uid"], 0) + 1
                        _condition(
                            status,
                            "Restarting",
                            f"{KIND} {meta['name']} is restarting because 1 {rtype} replica(s) failed.",
                        )
                        continue
                    counts["failed"] += 1
                    failure = f"{KIND} {meta['name']} is failed because {counts['failed']} {rtype} replica(s) failed."
                elif phase == "Succeeded":
                    counts["succeeded"] += 1
                else:
                    counts["active"] += 1
            replica_statuses[rtype] = {
                **{k: v for k, v in counts.items() if v},
                "selector": (
                    f"{LABEL}job-name={meta['name']},{LABEL}operator-name={OPERATOR_NAME},"
                    f"{LABEL}replica-type={rtype.lower()}"
                ),
            }
        status["replicaStatuses"] = replica_statuses
        worker = replica_statuses.get("Worker", {})
        master = replica_statuses.get("Master")
        if self._past_backoff_limit(job, pods):
            _condition(
                status, "Failed", f"{KIND} {meta['name']} has failed because it has reached the specified backoff limit"
            )
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
            self._clean_pods(job, pods, run_policy.get("cleanPodPolicy", "None"))
        if status != before:
            self.store.touch(job)
            self._condition_events(job, before.get("conditions") or [])

    def _condition_events(self, job: dict, before: list[dict]) -> None:
        """The operator's events for the conditions the job has just reached."""
        for c in job["status"].get("conditions") or []:
            if c["status"] == "True" and c["type"] in _EVENTS and c not in before:
                self.events.record(job, _EVENTS[c["type"]], c["reason"], c["message"], component=OPERATOR_NAME)

    def _delete_owned(self, job: dict, pod: dict, grace: int | None) -> None:
        if "deletionTimestamp" not in pod["metadata"]:
            self.events.record(
                job, "Normal", "SuccessfulDeletePod", f"Deleted pod: {pod['metadata']['name']}", component=OPERATOR_NAME
            )
        self.delete_pod(pod, grace)

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

    def _clean_pods(self, job: dict, pods: list[dict], policy: str) -> None:
        for pod in pods:
            if policy == "All" or (policy == "Running" and pod["status"].get("phase") in ("Running", "Pending")):
                self._delete_owned(job, pod, None)

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
        if rtype == "Master" or (
            "Master" not in job["spec"]["pytorchReplicaSpecs"] and rtype == "Worker" and index == 0
        ):
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
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": new_metadata(pod_meta, meta["namespace"]),
            "spec": pod_spec,
        }
        pod["status"] = {"phase": "Pending", "podIP": pod_address(job["spec"], rtype, index)}
        self.store.put("pods", pod)
        self.events.record(
            job, "Normal", "SuccessfulCreatePod", f"Created pod: {pod_meta['name']}", component=OPERATOR_NAME
        )

    def _collect_garbage(self) -> None:
        """Delete (gracefully) pods whose owning job is gone, as the garbage collector does."""
        jobs = {j["metadata"]["uid"] for j in self.store.items(PLURAL)}
        for pod in self.store.items("pods"):
            refs = pod["metadata"].get("ownerReferences") or []
            if refs and not any(r["uid"] in jobs for r in refs):
                self.delete_pod(pod, None)
        for uid in [
            u
            for u in self.kubelet.networks
            if u not in jobs and not any(self.kubelet.in_network(p, u) for p in self.store.items("pods"))
        ]:
            holder = self.kubelet.networks.pop(uid)
            holder.kill()
            holder.wait()

    @staticmethod
    def _running(pod: dict) -> bool:
        return pod["status"].get("phase") == "Running"
