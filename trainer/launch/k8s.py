"""The Kubernetes backend of the train step: the one module that knows Kubernetes.

It wraps the launch contract's worker command (``trainer.launch.local.worker_command``) in a
training-operator ``PyTorchJob``: Worker replicas only, an ``elasticPolicy`` with the c10d
rendezvous (the operator then injects the ``PET_*`` environment that ``ft_launcher`` reads, the
same one ``trainer.launch.local.operator_env`` gives local runs), ``nprocPerNode`` as a string, the
container named ``pytorch``, restartPolicy OnFailure, a run policy, the shared volume that holds
the data and the run dir, GPUs and resources, and a memory-backed ``/dev/shm``.

``run_pytorchjob`` creates the job with ``TrainingClient``, streams worker 0's log, waits for
Succeeded or Failed, deletes the job when it failed (after printing its workers' last log lines)
or the caller is cancelled (and waits until its pods have stopped), and raises ``JobFailed`` with
the job's own reason. Every call it makes is one the Role
in ``deploy/rbac.yaml`` grants; ``tests/e2e/test_cluster.py`` runs it against the emulated cluster
(``trainer.emulation.cluster``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubeflow.training import TrainingClient, models
from kubeflow.training.constants import constants as kf
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from trainer.errors import ParameterError
from trainer.faults import NodeFault
from trainer.launch import CREDENTIAL_SECRETS, IMAGE_GID, IMAGE_UID, WORKSPACE_MOUNT
from trainer.launch.local import DEFAULT_RDZV_PORT, local_tier_bytes, worker_command
from trainer.launch.spec import LaunchSpec, check_run_name
from trainer.rank.config import TrainConfig

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER = kf.PYTORCHJOB_CONTAINER  # the webhook requires this container name
RDZV_PORT_NAME = "pytorchjob-port"  # the operator exposes this named port on each replica's service
SPEC_ANNOTATION = "resilient-fsdp/spec-sha256"
"""The job's spec digest (:func:`spec_digest`), set on every job the train step creates."""
LOG_DRAIN_S = 60.0
"""Seconds a finished job's log stream may take to deliver its last lines to the step's log."""
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


class JobFailed(RuntimeError):
    """The PyTorchJob failed, was deleted, or could not be followed; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterOptions:
    """Where and how the PyTorchJob runs (everything beyond the training config and launch spec)."""

    name: str
    """Job name: the training run's (``trainer.launch.spec.check_run_name``); pods and services are
    named ``<name>-worker-<i>``."""
    image: str
    """Container image of every worker (the project's Dockerfile)."""
    namespace: str = ""
    """Namespace of the job ("" = the TrainingClient's: the pod's own namespace in a cluster)."""
    pvc_name: str = "rfsdp-workspace"
    """PersistentVolumeClaim (ReadWriteMany) mounted at ``WORKSPACE_MOUNT`` in every worker."""
    gpus: bool = False
    """Request one ``nvidia.com/gpu`` per process (nproc_per_node per worker)."""
    cpu: str = "4"
    """CPU request and limit per worker."""
    memory: str = "16Gi"
    """Memory request and limit per worker."""
    shm_size: str = "8Gi"
    """Size of the memory-backed /dev/shm (the async checkpoint staging buffers live there); with
    the local tier on, the job's /dev/shm gets the tier's size on top (:func:`shm_size_limit`)."""
    secrets: tuple[str, ...] = tuple(CREDENTIAL_SECRETS)
    """Secrets whose keys become environment variables of every worker (optional ones)."""
    backoff_limit: int = 3
    """Pod restarts (restartPolicy OnFailure) before the operator marks the job Failed."""
    active_deadline_s: int = 0
    """Hard wall-clock limit of the job (0: none)."""
    ttl_after_finished_s: int = 86400
    """Seconds the finished job object is kept for inspection."""

    def __post_init__(self) -> None:
        def refuse(param: str, problem: str) -> ParameterError:
            return ParameterError(param, problem, style="parameter")

        check_run_name(self.name)
        if self.namespace and (len(self.namespace) > 63 or not _DNS_1123.match(self.namespace)):
            raise refuse("job_namespace", f"{self.namespace!r} is not a valid namespace name")
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise refuse("image", f"{self.image!r} is not a container image reference")
        if not _DNS_1123.match(self.pvc_name):
            raise refuse("pvc_name", f"{self.pvc_name!r} is not a valid PersistentVolumeClaim name")
        for field_name in ("cpu", "memory", "shm_size"):
            if not _QUANTITY.match(getattr(self, field_name)):
                raise refuse(
                    field_name, f"{getattr(self, field_name)!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)"
                )
        for secret in self.secrets:
            if not _DNS_1123.match(secret):
                raise refuse("secrets", f"{secret!r} is not a valid Secret name")
        for field_name in ("backoff_limit", "active_deadline_s", "ttl_after_finished_s"):
            if getattr(self, field_name) < 0:
                raise refuse(field_name, f"must be >= 0, got {getattr(self, field_name)}")


_QUANTITY_UNITS = {
    "m": 1e-3,
    "": 1,
    **{u: 1000**i for i, u in enumerate("kMGTPE", 1)},
    **{u + "i": 1024**i for i, u in enumerate("KMGTPE", 1)},
}


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity (``8Gi``, ``500M``) in bytes."""
    m = _QUANTITY.match(quantity)
    if m is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity")
    return float(quantity[: len(quantity) - len(m[2] or "")]) * _QUANTITY_UNITS[m[2] or ""]


def shm_size_limit(cfg: TrainConfig, spec: LaunchSpec, opts: ClusterOptions) -> str:
    """The pod's /dev/shm size: ``opts.shm_size``, plus what the local tier holds when it is on
    (``trainer.launch.local.local_tier_bytes``: that memory counts against the container's limit).
    """
    if not cfg.local_ckpt_every:
        return opts.shm_size
    return f"{math.ceil((quantity_bytes(opts.shm_size) + local_tier_bytes(cfg, spec)) / 2**20)}Mi"


def build_pytorchjob(cfg: TrainConfig, spec: LaunchSpec, opts: ClusterOptions) -> models.KubeflowOrgV1PyTorchJob:
    """The PyTorchJob that runs ``worker_command(cfg)`` on ``spec.nnodes`` Worker pods.

    ``cfg.data`` and ``cfg.run_dir`` must be paths on the shared volume (under ``WORKSPACE_MOUNT``).
    """
    node_faults = [f.key for f in cfg.faults if isinstance(f, NodeFault)]
    if node_faults:  # fired by the local netns harness; nothing in a PyTorchJob would fire them
        raise ParameterError(
            "fault",
            f"{', '.join(node_faults)} are node-level faults, which only the local --netns cluster can inject",
            style="parameter",
        )
    for flag, path in (("data", cfg.data), ("run_dir", cfg.run_dir)):
        if not path.startswith(WORKSPACE_MOUNT + "/"):
            raise ParameterError(
                flag,
                f"{path!r} is not on the shared volume ({WORKSPACE_MOUNT}), so the workers cannot see it",
                style="parameter",
            )
    limits = {"cpu": opts.cpu, "memory": opts.memory}
    shm = k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=shm_size_limit(cfg, spec, opts))
    if opts.gpus:
        limits["nvidia.com/gpu"] = str(spec.nproc_per_node)
    container = k8s.V1Container(
        name=CONTAINER,
        image=opts.image,
        command=worker_command(cfg),
        # protocol and (below) suspend spelled out: the API server's schema defaults, so the stored job equals this one
        ports=[k8s.V1ContainerPort(name=RDZV_PORT_NAME, container_port=DEFAULT_RDZV_PORT, protocol="TCP")],
        resources=k8s.V1ResourceRequirements(requests=dict(limits), limits=limits),
        env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s, optional=True)) for s in opts.secrets]
        or None,
        volume_mounts=[
            k8s.V1VolumeMount(name="workspace", mount_path=WORKSPACE_MOUNT),
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        ],
        # Pod Security "restricted": no privilege escalation, no capabilities (the workers need none).
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"])
        ),
    )
    pod = k8s.V1PodTemplateSpec(
        # An Istio sidecar would intercept the rendezvous and store traffic between workers.
        metadata=k8s.V1ObjectMeta(annotations={"sidecar.istio.io/inject": "false"}),
        spec=k8s.V1PodSpec(
            containers=[container],
            # The image's unprivileged user; fsGroup keeps the shared volume writable for it.
            security_context=k8s.V1PodSecurityContext(
                run_as_user=IMAGE_UID,
                run_as_group=IMAGE_GID,
                fs_group=IMAGE_GID,
                run_as_non_root=True,
                seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
            ),
            # Eviction and preemption: SIGTERM to ft_launcher (PID 1), which forwards it; the ranks
            # checkpoint and exit within this, with a margin for the launcher's own exit.
            termination_grace_period_seconds=int(cfg.grace_period) + 15,
            volumes=[
                k8s.V1Volume(
                    name="workspace",
                    persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=opts.pvc_name),
                ),
                k8s.V1Volume(name="dshm", empty_dir=shm),
            ],
        ),
    )
    job = models.KubeflowOrgV1PyTorchJob(
        api_version=API_VERSION,
        kind=KIND,
        metadata=k8s.V1ObjectMeta(
            name=opts.name, namespace=opts.namespace or None, labels={"app.kubernetes.io/part-of": "resilient-fsdp"}
        ),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            # Not the deprecated elasticPolicy.nProcPerNode: the webhook rejects both together.
            nproc_per_node=str(spec.nproc_per_node),
            elastic_policy=models.KubeflowOrgV1ElasticPolicy(
                rdzv_backend="c10d",
                rdzv_port=DEFAULT_RDZV_PORT,
                min_replicas=spec.nnodes,
                max_replicas=spec.nnodes,
                max_restarts=spec.max_restarts,
            ),
            pytorch_replica_specs={
                kf.REPLICA_TYPE_WORKER: models.KubeflowOrgV1ReplicaSpec(
                    replicas=spec.nnodes, restart_policy="OnFailure", template=pod
                )
            },
            run_policy=models.KubeflowOrgV1RunPolicy(
                # keep finished pods for their logs (the step deletes a failed job, printing them first)
                clean_pod_policy="None",
                backoff_limit=opts.backoff_limit,
                active_deadline_seconds=opts.active_deadline_s or None,
                ttl_seconds_after_finished=opts.ttl_after_finished_s,
                suspend=False,
            ),
        ),
    )
    job.metadata.annotations = {SPEC_ANNOTATION: spec_digest(job)}
    return job


def spec_digest(job: models.KubeflowOrgV1PyTorchJob) -> str:
    """The sha256 of the job's spec: a retried train step recognises the job it made by it."""
    spec = json.dumps(to_manifest(job)["spec"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(spec.encode()).hexdigest()


def to_manifest(job: models.KubeflowOrgV1PyTorchJob) -> dict[str, Any]:
    """The job as the plain JSON-able dict sent to the API server (camelCase, no nulls)."""
    return k8s.ApiClient().sanitize_for_serialization(job)


def run_pytorchjob(
    job: models.KubeflowOrgV1PyTorchJob,
    *,
    training_client: TrainingClient | None = None,
    poll_s: float = 2.0,
    timeout_s: float = 7 * 86400,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Create the job, stream worker 0's log, wait for Succeeded or Failed; delete a failed job.

    A failed job is deleted once its workers' last log lines are printed: past its backoff limit
    (restartPolicy OnFailure, cleanPodPolicy None) its pods would keep restarting, holding their
    GPUs, until the job's TTL.

    Args:
        job: from ``build_pytorchjob``.
        training_client: a configured client (default: in-cluster or kube-config credentials).
        poll_s: seconds between status polls (one GET each: cheap for the API server, and a
            finished job is seen soon).
        timeout_s: give up (and delete the job) after this long.
        log: where progress lines go.

    Returns:
        The final job object as a dict (its ``status`` holds conditions and replica statuses).

    Raises:
        JobFailed: the job failed (with its reason and message; the job has been deleted), was
            deleted, or timed out.
        KeyboardInterrupt: the caller was cancelled; the job has been deleted.
    """
    name, namespace = job.metadata.name, job.metadata.namespace
    # Without a namespace the client takes the pod's own (its service account's namespace).
    tc = training_client or (TrainingClient(namespace=namespace) if namespace else TrainingClient())
    namespace = namespace or tc.namespace
    done = {kf.JOB_CONDITION_SUCCEEDED, kf.JOB_CONDITION_FAILED}
    job.metadata.annotations = {SPEC_ANNOTATION: spec_digest(job), **(job.metadata.annotations or {})}
    if _follows_or_replaces(tc, job, namespace, done, log):
        log(f"following {KIND} {namespace}/{name}, which this step created before it was retried")
    else:
        tc.create_job(job=job, namespace=namespace)
        log(f"created {KIND} {namespace}/{name}")
    follower = threading.Thread(target=_follow_logs, args=(tc, name, namespace, poll_s, done), daemon=True)
    follower.start()
    try:
        final = tc.wait_for_job_conditions(
            name,
            namespace,
            expected_conditions=done,
            wait_timeout=max(int(timeout_s), 1),
            polling_interval=max(int(poll_s), 1),
        )
    except BaseException as e:  # cancelled, timed out, or the job vanished: leave nothing behind
        if isinstance(e, RuntimeError) and isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
            # Its pods stop after it (SIGTERM: they checkpoint), and the run dir is theirs until then.
            _wait_for_pods_gone(tc, job, namespace, log)
            _print_events(tc, name, namespace, log)  # events outlive the job: who stopped it and when
            raise JobFailed(f"{KIND} {namespace}/{name} was deleted while it ran (its events are above)") from e
        _delete_quietly(tc, job, log)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise JobFailed(f"{KIND} {namespace}/{name} could not be followed to completion: {e}") from e
    # Worker 0's container has ended (or is between restarts): its stream closes once the rest is read.
    follower.join(timeout=max(poll_s, LOG_DRAIN_S))
    status = tc.api_client.sanitize_for_serialization(final).get("status", {})
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if not any(c.get("type") == kf.JOB_CONDITION_SUCCEEDED for c in conditions):
        failed = next((c for c in reversed(conditions) if c.get("type") == kf.JOB_CONDITION_FAILED), {})
        _print_last_lines(tc, name, namespace, log)  # deleting the job deletes its pods' logs
        _print_events(tc, name, namespace, log)
        _delete_quietly(tc, job, log)
        raise JobFailed(
            (
                f"{KIND} {namespace}/{name} failed: "
                f"{failed.get('reason', 'unknown reason')}: {failed.get('message', '')}"
            ).rstrip(": ")
        )
    log(f"{KIND} {namespace}/{name} succeeded")
    return tc.api_client.sanitize_for_serialization(final)


def _follows_or_replaces(
    tc: TrainingClient, job: models.KubeflowOrgV1PyTorchJob, namespace: str, done: set[str], log: Callable[[str], None]
) -> bool:
    """Whether a live job of this name is this one (the same spec: the train step was retried
    after its pod died, as KFP's retry or a rerun does), to be followed rather than created again.
    A finished job of this name is deleted, so that a rerun of the training run resumes it: a
    preempted job ends Succeeded and is kept until its TTL.

    Raises:
        JobFailed: a live job of this name has another spec.
    """
    name = job.metadata.name
    try:
        existing = tc.api_client.sanitize_for_serialization(tc.get_job(name, namespace))
    except RuntimeError as e:
        if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
            return False
        raise
    ended = [
        c["type"]
        for c in (existing.get("status") or {}).get("conditions") or []
        if c.get("status") == "True" and c.get("type") in done
    ]
    if not ended:
        theirs = (existing["metadata"].get("annotations") or {}).get(SPEC_ANNOTATION)
        if theirs == job.metadata.annotations[SPEC_ANNOTATION]:
            return True
        raise JobFailed(
            f"{KIND} {namespace}/{name} is still running with another spec: wait for it to end, or delete it, "
            f"before running {name} again"
        )
    log(f"deleting the ended {KIND} {namespace}/{name} ({ended[-1]}) before running it again")
    _delete_quietly(tc, job, log)
    return False


def _follow_logs(tc: TrainingClient, name: str, namespace: str, poll_s: float, done: set[str]) -> None:
    """Print worker 0's log as it runs (best effort: a log stream must never fail the step)."""
    try:
        tc.wait_for_job_conditions(
            name,
            namespace,
            expected_conditions={kf.JOB_CONDITION_RUNNING, *done},
            wait_timeout=86400,
            polling_interval=max(int(poll_s), 1),
        )
        tc.get_job_logs(name, namespace, is_master=False, replica_type="worker", replica_index=0, follow=True)
    except Exception as e:  # noqa: BLE001 (logs are a convenience; the status poll decides)
        print(f"(log stream of {name} ended: {str(e).splitlines()[0] if str(e) else type(e).__name__})")


def _print_last_lines(
    tc: TrainingClient, name: str, namespace: str, log: Callable[[str], None], lines: int = 30
) -> None:
    """The last lines of every worker's log (best effort: the job's status has the verdict)."""
    try:
        logs, _ = tc.get_job_logs(name, namespace, is_master=False)
    except Exception as e:  # noqa: BLE001 (a missing log must not hide the job's failure)
        log(f"(could not read the workers' logs of {name}: {e})")
        return
    for pod, text in sorted(logs.items()):
        log(f"--- {pod} (last lines)\n" + "\n".join(text.splitlines()[-lines:]))


def _print_events(tc: TrainingClient, name: str, namespace: str, log: Callable[[str], None], lines: int = 20) -> None:
    """The job's and its pods' latest events, oldest first, as ``kubectl describe`` shows them
    (best effort: a missing event must not hide the job's failure). Events outlive the job.
    """
    try:
        items = tc.core_api.list_namespaced_event(namespace).items
    except Exception as e:  # noqa: BLE001
        log(f"(could not read the events of {name}: {e})")
        return
    ours = [e for e in items if e.involved_object.name == name or e.involved_object.name.startswith(f"{name}-worker-")]

    def when(e: k8s.CoreV1Event) -> tuple[str, int]:  # all UTC: text order is time order; then the order written
        return str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp or ""), int(
            e.metadata.resource_version or 0
        )

    ours.sort(key=when)
    rows = [
        f"{e.type:<8} {e.reason:<22} {e.involved_object.kind.lower()}/{e.involved_object.name}: {e.message}"
        for e in ours[-lines:]
    ]
    log(f"--- events of {KIND} {namespace}/{name} (latest {len(rows)})\n" + "\n".join(rows))


def _grace_s(job: models.KubeflowOrgV1PyTorchJob) -> float:
    """The longest its pods may take to stop once asked: their grace period, and 15 s to spare."""
    return 15 + max(
        r.template.spec.termination_grace_period_seconds or 30 for r in job.spec.pytorch_replica_specs.values()
    )


def _wait_for_pods_gone(
    tc: TrainingClient, job: models.KubeflowOrgV1PyTorchJob, namespace: str, log: Callable[[str], None]
) -> None:
    """Wait until no pod of ``job`` is left (at most :func:`_grace_s`); best effort."""
    selector, wait_s = f"training.kubeflow.org/job-name={job.metadata.name}", _grace_s(job)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if not tc.core_api.list_namespaced_pod(namespace, label_selector=selector).items:
                return
        except Exception as e:  # noqa: BLE001 (a failed look must not hide the job's failure)
            log(f"(could not list the pods of {job.metadata.name}: {e})")
            return
        time.sleep(1)
    log(f"pods of {KIND} {namespace}/{job.metadata.name} are still stopping after {wait_s:g} s")


def _delete_quietly(tc: TrainingClient, job: models.KubeflowOrgV1PyTorchJob, log: Callable[[str], None]) -> None:
    """Delete the job and wait until it is gone (at most its pods' grace period + 15 s).
    Foreground propagation keeps the job object until every pod has stopped (SIGTERM: the ranks
    checkpoint and exit), so once it is gone nothing writes to the run dir any more and the caller
    may release it.
    """
    name, namespace = job.metadata.name, job.metadata.namespace or tc.namespace
    wait_s = _grace_s(job)
    try:
        tc.delete_job(name, namespace, delete_options=k8s.V1DeleteOptions(propagation_policy="Foreground"))
    except Exception as e:  # noqa: BLE001 (already gone is fine; report anything else)
        log(f"could not delete {KIND} {namespace}/{name}: {e}")
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            tc.get_job(name, namespace)
        except RuntimeError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 404:
                log(f"deleted {KIND} {namespace}/{name}")
                return
        time.sleep(1)
    log(f"{KIND} {namespace}/{name} is still being deleted after {wait_s:g} s (its pods are stopping)")


def shared_paths(run_name: str) -> tuple[str, str]:
    """Data and run dir of a run on the shared volume: a rerun with the same name resumes there."""
    return f"{WORKSPACE_MOUNT}/{run_name}/data", f"{WORKSPACE_MOUNT}/{run_name}/run"


def cluster_options(params: Mapping[str, Any]) -> ClusterOptions:
    """``ClusterOptions`` from the pipeline's parameters (``training_run``, the resolved name of the
    run, ``image``, ``job_namespace``, ``pvc_name``, ``gpus``, ``cpu``, ``memory``).

    Raises:
        ParameterError: naming the bad pipeline parameter.
    """
    return ClusterOptions(
        name=params["training_run"],
        image=params["image"],
        namespace=params["job_namespace"],
        pvc_name=params["pvc_name"],
        gpus=params["gpus"],
        cpu=params["cpu"],
        memory=params["memory"],
    )
