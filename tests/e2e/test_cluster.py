"""The emulated cluster (trainer.emulation.cluster) and the train step's kubernetes path run on it.

The API semantics are checked with the real `kubernetes` and `kubeflow-training` clients, the
step's create/follow/fail/cancel paths with its own code; the end-to-end test runs the whole
pipeline with `rfsdp pipeline run-local --set backend=kubernetes`: the real PyTorchJob through a
kubeconfig, real ft_launcher workers in Worker pods, real faults, the checkpoint validated, the
run in MLflow. The cluster needs root (namespaces, mounts) and skips with the reason elsewhere.
"""

from __future__ import annotations

import _thread
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from kubeflow.training import ApiClient, TrainingClient, models
from kubernetes import client as k8s
from kubernetes import config as kube_config

from tests.conftest import ROOT
from trainer.checkpoint import SIGNING_KEY_ENV, latest_checkpoint, manifest_signature
from trainer.emulation.apiserver import RBAC_FILE
from trainer.emulation.cluster import Cluster, cluster_problem, emulated_cluster
from trainer.events import FaultFired, NodesPreempted, Restart, RunEnd, Step, final_losses, read_events, select
from trainer.launch.k8s import JobFailed, run_pytorchjob

PROBLEM = cluster_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"the emulated cluster cannot run here: {PROBLEM}")
NS = "default"  # TrainingClient's namespace outside a pod, and the kubeconfig's
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    (root / "pvc").mkdir()
    claims = {"rfsdp-workspace": root / "pvc", "scratch": root / "pvc"}
    with emulated_cluster(
        root / "state", claims=claims, secrets_data={"creds": {"TOKEN": "s3cret"}}, restart_backoff_s=0.2
    ) as c:
        yield c


def configuration(kubeconfig: Path) -> k8s.Configuration:
    """A client configuration from a kubeconfig file (not the process-wide default)."""
    cfg = k8s.Configuration()
    kube_config.load_kube_config(str(kubeconfig), client_configuration=cfg)
    return cfg


def step_client(cluster: Cluster) -> TrainingClient:
    """What the train step holds: the ServiceAccount of deploy/rbac.yaml."""
    return TrainingClient(client_configuration=configuration(cluster.kubeconfig), namespace=NS)


def admin(cluster: Cluster) -> tuple[k8s.CustomObjectsApi, k8s.CoreV1Api]:
    api = k8s.ApiClient(configuration(cluster.admin_kubeconfig))
    return k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)


def tiny_job(
    name: str,
    script: str = "",
    *,
    claim: str = "missing",
    restart_policy: str = "OnFailure",
    replicas: int = 1,
    **run_policy,
) -> dict:  # noqa: ANN003
    """A PyTorchJob whose pods run ``python -c script``. With the default claim (one the cluster
    lacks) its pods stay Pending and no process starts: the API tests need none.
    """
    container = {
        "name": "pytorch",
        "image": "local",
        "command": [sys.executable, "-c", script or "pass"],
        "ports": [{"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/mnt/scratch"}],
    }
    pod = {
        "spec": {
            "containers": [container],
            "volumes": [{"name": "scratch", "persistentVolumeClaim": {"claimName": claim}}],
        }
    }
    pod["spec"]["terminationGracePeriodSeconds"] = 5
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app": "tiny"}},
        "spec": {
            "nprocPerNode": "1",
            "pytorchReplicaSpecs": {"Worker": {"replicas": replicas, "restartPolicy": restart_policy, "template": pod}},
            "runPolicy": {"cleanPodPolicy": "None", "suspend": False, **run_policy},
        },
    }


def as_model(job: dict) -> models.KubeflowOrgV1PyTorchJob:
    """A PyTorchJob dict as the kubeflow-training model ``TrainingClient.create_job`` takes."""
    return ApiClient().deserialize(SimpleNamespace(data=json.dumps(job)), "KubeflowOrgV1PyTorchJob")


def api_error(excinfo: pytest.ExceptionInfo) -> tuple[int, dict]:
    """The HTTP status and the Status object of an ApiException (raised or wrapped by TrainingClient)."""
    e = excinfo.value if isinstance(excinfo.value, k8s.ApiException) else excinfo.value.__cause__
    return e.status, json.loads(e.body)


def wait_for(predicate, timeout: float = 60, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def conditions(obj: dict) -> list[str]:
    return [c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c["status"] == "True"]


# ----------------------------------------------------------------------------- API semantics
def test_create_twice_is_409_already_exists(cluster: Cluster) -> None:
    tc = step_client(cluster)
    job = as_model(tiny_job("dup"))
    tc.create_job(job=job, namespace=NS)
    with pytest.raises(RuntimeError, match="Failed to create PyTorchJob") as excinfo:
        tc.create_job(job=job, namespace=NS)
    code, status = api_error(excinfo)
    assert (code, status["kind"], status["reason"]) == (409, "Status", "AlreadyExists")
    assert status["message"] == 'pytorchjobs.kubeflow.org "dup" already exists'
    stored = cluster.stored(PLURAL, NS, "dup")
    assert stored["metadata"]["uid"] and stored["metadata"]["resourceVersion"] and stored["metadata"]["generation"] == 1
    # Its pod waits for the claim it names, as on a cluster without it: the job stays Created.
    wait_for(
        lambda: (cluster.stored("pods", NS, "dup-worker-0") or {}).get("status", {}).get("conditions"),
        what="the pod's condition",
    )
    pod = cluster.stored("pods", NS, "dup-worker-0")
    assert (
        pod["status"]["phase"] == "Pending"
        and pod["status"]["conditions"][0]["message"] == 'persistentvolumeclaim "missing" not found'
    )
    assert conditions(cluster.stored(PLURAL, NS, "dup")) == ["Created"]


def test_the_crd_schema_prunes_defaults_and_refuses(cluster: Cluster) -> None:
    jobs, _ = admin(cluster)
    typo = tiny_job("typo")
    typo["spec"]["runPolicy"]["backofLimit"] = 2
    del typo["spec"]["runPolicy"]["suspend"]
    del typo["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"][0]["protocol"]
    with pytest.raises(k8s.ApiException) as excinfo:  # strict field validation: refused
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, typo, field_validation="Strict")
    code, status = api_error(excinfo)
    assert (code, status["reason"]) == (400, "BadRequest")
    assert 'unknown field "spec.runPolicy.backofLimit"' in status["message"]
    # The default (Warn): the unknown field is dropped with a warning, schema defaults are applied.
    _, code, headers = jobs.create_namespaced_custom_object_with_http_info(GROUP, VERSION, NS, PLURAL, typo)
    assert code == 201 and 'unknown field \\"spec.runPolicy.backofLimit\\"' in headers["Warning"]
    stored = cluster.stored(PLURAL, NS, "typo")
    assert stored["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "suspend": False}
    assert (
        stored["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"][0]["protocol"]
        == "TCP"
    )
    wrong = tiny_job("wrong-type")
    wrong["spec"]["runPolicy"]["backoffLimit"] = "3"
    with pytest.raises(k8s.ApiException) as excinfo:
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, wrong)
    code, status = api_error(excinfo)
    assert (code, status["reason"]) == (422, "Invalid")
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.runPolicy.backoffLimit"]
    renamed = tiny_job("renamed")
    renamed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    with pytest.raises(k8s.ApiException) as excinfo:  # the operator's webhook
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, renamed)
    assert api_error(excinfo)[0] == 422 and "no container named pytorch" in api_error(excinfo)[1]["message"]
    assert cluster.stored(PLURAL, NS, "wrong-type") is None and cluster.stored(PLURAL, NS, "renamed") is None


def test_rbac_refuses_what_the_role_does_not_grant(cluster: Cluster) -> None:
    api = k8s.ApiClient(configuration(cluster.kubeconfig))
    jobs, core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
    refused = [
        lambda: jobs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL),  # list: the step never lists jobs
        lambda: core.read_namespaced_pod("any", NS),
        lambda: core.delete_namespaced_pod("any", NS),
        lambda: jobs.create_namespaced_custom_object(
            GROUP, VERSION, "team-b", PLURAL, tiny_job("elsewhere")
        ),  # another namespace
    ]
    for call in refused:
        with pytest.raises(k8s.ApiException) as excinfo:
            call()
        code, status = api_error(excinfo)
        assert (code, status["kind"], status["reason"]) == (403, "Status", "Forbidden")
        assert f'User "{cluster.service_account}" cannot' in status["message"]
    assert (
        'cannot create resource "pytorchjobs" in API group "kubeflow.org" in the namespace "team-b"'
        in status["message"]
    )


def test_label_selectors_and_namespaces(cluster: Cluster) -> None:
    jobs, core = admin(cluster)
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, tiny_job("sel", replicas=3))
    jobs.create_namespaced_custom_object(GROUP, VERSION, "team-b", PLURAL, tiny_job("sel", replicas=2))
    wait_for(lambda: len(core.list_namespaced_pod("team-b").items) == 2, what="team-b's pods")

    def names(namespace: str, selector: str) -> list[str]:
        wait_for(lambda: cluster.stored("pods", NS, "sel-worker-2") is not None, what="sel's pods")
        return sorted(p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=selector).items)

    job = "training.kubeflow.org/job-name=sel"
    assert names(NS, job) == ["sel-worker-0", "sel-worker-1", "sel-worker-2"]
    assert names("team-b", job) == ["sel-worker-0", "sel-worker-1"]
    assert names(NS, f"{job},training.kubeflow.org/replica-index=1") == ["sel-worker-1"]
    assert names(NS, f"{job},training.kubeflow.org/replica-index!=1") == ["sel-worker-0", "sel-worker-2"]
    assert names(NS, f"{job},training.kubeflow.org/replica-index in (0,2)") == ["sel-worker-0", "sel-worker-2"]
    assert names(NS, f"{job},training.kubeflow.org/replica-index notin (0,2)") == ["sel-worker-1"]
    assert names(NS, f"{job},training.kubeflow.org/job-role") == ["sel-worker-0"]  # Worker 0 is the master role
    assert names(NS, f"{job},!training.kubeflow.org/job-role") == ["sel-worker-1", "sel-worker-2"]
    assert names(NS, "training.kubeflow.org/job-name=nope") == []
    # A job's pods are its own namespace's: deleting team-b's job leaves default's alone.
    jobs.delete_namespaced_custom_object(GROUP, VERSION, "team-b", PLURAL, "sel")
    wait_for(lambda: core.list_namespaced_pod("team-b").items == [], what="team-b's pods to go")
    assert names(NS, job) == ["sel-worker-0", "sel-worker-1", "sel-worker-2"]


# ----------------------------------------------------------------------------- pods and the operator
PROBE = """
import json, os, socket
shm = os.statvfs("/dev/shm")
print(json.dumps({
    "argv": __import__("sys").argv[1:], "hostname": socket.gethostname(), "cwd": os.getcwd(),
    "peers": [socket.gethostbyname(f"probe-worker-{i}") for i in range(2)],
    "env": {k: v for k, v in os.environ.items() \
if k.startswith(("PET_", "MASTER", "TOKEN", "GREETING", "PYTHONUNBUFFERED"))},
    "claim": open("/mnt/scratch/probe-marker").read(), "secret": open("/mnt/secret/TOKEN").read(),
    "shm_bytes": shm.f_blocks * shm.f_frsize,
}), flush=True)
"""


def test_a_pod_runs_its_container_as_the_operator_and_kubelet_would(cluster: Cluster) -> None:
    jobs, core = admin(cluster)
    job = tiny_job("probe", PROBE, claim="scratch", replicas=2)
    spec = job["spec"]
    spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3}
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    container["args"] = ["$(GREETING)", "$(PET_NNODES)", "$$(GREETING)"]
    # An env value sees envFrom and the variables before it (not the operator's, appended after it).
    container["env"] = [{"name": "GREETING", "value": "hi-$(TOKEN)-$(PET_NNODES)"}]
    container["envFrom"] = [{"secretRef": {"name": "creds"}}, {"secretRef": {"name": "absent", "optional": True}}]
    container["volumeMounts"] += [
        {"name": "secret", "mountPath": "/mnt/secret"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pod["volumes"] += [
        {"name": "secret", "secret": {"secretName": "creds"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}},
    ]
    (Path(cluster.kubeconfig).parent.parent / "pvc" / "probe-marker").write_text("on the claim")
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    wait_for(lambda: "Succeeded" in conditions(cluster.stored(PLURAL, NS, "probe")), what="the probe to finish")
    seen = [
        json.loads(core.read_namespaced_pod_log(f"probe-worker-{i}", NS, _preload_content=False).data) for i in range(2)
    ]
    pods = [cluster.stored("pods", NS, f"probe-worker-{i}") for i in range(2)]
    for i, (out, stored) in enumerate(zip(seen, pods, strict=True)):
        assert out["argv"] == ["hi-s3cret-$(PET_NNODES)", "2:2", "$(GREETING)"]  # $(VAR) expanded, $$ escaped
        assert out["hostname"] == f"probe-worker-{i}" and out["cwd"] != os.getcwd()
        assert out["peers"] == [p["status"]["podIP"] for p in pods]  # the job's service names resolve
        assert out["env"] == {
            "GREETING": "hi-s3cret-$(PET_NNODES)",
            "TOKEN": "s3cret",
            "PYTHONUNBUFFERED": "1",
            "PET_RDZV_ENDPOINT": "probe-worker-0:29400",
            "PET_RDZV_BACKEND": "c10d",
            "PET_NNODES": "2:2",
            "PET_MAX_RESTARTS": "3",
            "PET_NPROC_PER_NODE": "1",
        }
        assert (out["claim"], out["secret"], out["shm_bytes"]) == ("on the claim", "s3cret", 32 * 2**20)
        assert stored["metadata"]["labels"]["training.kubeflow.org/replica-index"] == str(i)
        assert stored["metadata"]["ownerReferences"][0]["uid"] == cluster.stored(PLURAL, NS, "probe")["metadata"]["uid"]


SHM_PROBE = """
import os, subprocess, sys
seen = open("/dev/shm/marker").read() if os.path.exists("/dev/shm/marker") else ""
open("/dev/shm/marker", "a").write("x")
print("seen", repr(seen), flush=True)
if not seen:  # the first run leaves a process of a session of its own behind, and fails
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open("/mnt/scratch/left-behind", "w").write(str(child.pid))
    sys.exit(1)
"""


def _running(pid: int) -> bool:
    """Whether the process runs (a killed one waiting to be reaped, a zombie, does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_memory_empty_dir_outlives_a_container_restart_and_a_container_ends_whole(cluster: Cluster) -> None:
    """A pod's `medium: Memory` emptyDir (the workers' /dev/shm) lives as long as the pod, as on a
    node: the restarted container finds what the failed one wrote there. What a container started
    ends with it, even in a session of its own, as a runtime kills the container's cgroup.
    """
    jobs, core = admin(cluster)
    job = tiny_job("shm", SHM_PROBE, claim="scratch")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}})
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    wait_for(lambda: "Succeeded" in conditions(cluster.stored(PLURAL, NS, "shm")), what="the job to succeed")
    assert core.read_namespaced_pod_log("shm-worker-0", NS, previous=True) == "seen ''\n"
    assert core.read_namespaced_pod_log("shm-worker-0", NS) == "seen 'x'\n"
    left = int((Path(cluster.kubeconfig).parent.parent / "pvc" / "left-behind").read_text())
    assert not _running(left)


NODE_PROBE = """
import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path("/mnt/scratch") / os.environ["HOSTNAME"]
print("seen", repr(open("/dev/shm/marker").read() if os.path.exists("/dev/shm/marker") else ""), flush=True)
open("/dev/shm/marker", "w").write("x")
signal.signal(signal.SIGTERM, lambda *_: (out.with_suffix(".term").write_text("got SIGTERM"), sys.exit(1)))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
out.with_suffix(".child").write_text(str(child.pid))
time.sleep(600)
"""


def test_a_deleted_node_is_lost_with_its_pods_processes_and_memory(tmp_path: Path) -> None:
    """`kubectl delete node`: every process of the node's pod dies at once, with no SIGTERM (no
    `Killing` event), a process in a session of its own included, and its memory with it; the pod
    is failed and deleted as the pod garbage collector does it, the operator recreates it and the
    scheduler binds it to the node left. The other pod goes on."""
    (tmp_path / "pvc").mkdir()
    with emulated_cluster(
        tmp_path / "state", claims={"scratch": tmp_path / "pvc"}, restart_backoff_s=0.2, nodes=2
    ) as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig), "HOME": str(tmp_path)}

        def kubectl(*args: str) -> str:
            return subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, check=True).stdout

        assert [line.split()[:2] for line in kubectl("get", "nodes").splitlines()] == [
            ["NAME", "STATUS"],
            ["emulated-node-0", "Ready"],
            ["emulated-node-1", "Ready"],
        ]
        job = tiny_job("doomed-node", NODE_PROBE, claim="scratch", replicas=2)
        pod_spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        pod_spec["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        pod_spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}})
        jobs, core = admin(cluster)
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
        children = [tmp_path / "pvc" / f"doomed-node-worker-{i}.child" for i in range(2)]
        wait_for(lambda: all(c.exists() for c in children), what="both pods to run")
        lost = cluster.stored("pods", NS, "doomed-node-worker-1")
        kept = cluster.stored("pods", NS, "doomed-node-worker-0")
        assert (kept["spec"]["nodeName"], lost["spec"]["nodeName"]) == ("emulated-node-0", "emulated-node-1")
        pid = int(children[1].read_text())
        children[1].unlink()
        kubectl("delete", "node", "emulated-node-1")
        wait_for(lambda: children[1].exists(), what="the replacement pod to run")
        assert not _running(pid) and not (tmp_path / "pvc" / "doomed-node-worker-1.term").exists()
        replacement = cluster.stored("pods", NS, "doomed-node-worker-1")
        assert replacement["metadata"]["uid"] != lost["metadata"]["uid"]
        assert replacement["spec"]["nodeName"] == "emulated-node-0"
        assert _log(core, "doomed-node-worker-1") == "seen ''\n"  # a new pod's memory: nothing of the lost one's
        assert cluster.stored("pods", NS, "doomed-node-worker-0")["metadata"]["uid"] == kept["metadata"]["uid"]
        assert _running(int(children[0].read_text()))
        with cluster.store.lock:
            events = [
                (e["involvedObject"], e["reason"], e["source"]["component"]) for e in cluster.store.items("events")
            ]
            changes = list(cluster.store.history)
        assert {r for o, r, _ in events if o["uid"] == lost["metadata"]["uid"]} == {
            "Scheduled",
            "Pulled",
            "Created",
            "Started",
        }  # no Killing: no SIGTERM was sent
        removing = [o for o, r, c in events if r == "RemovingNode" and c == "node-controller"]
        assert [(o["kind"], o["name"]) for o in removing] == [("Node", "emulated-node-1")]
        deleted = [
            c.object
            for c in changes
            if c.type == "DELETED" and c.resource == "pods" and c.object["metadata"]["uid"] == lost["metadata"]["uid"]
        ]
        assert len(deleted) == 1 and deleted[0]["status"]["phase"] == "Failed"
        assert deleted[0]["status"]["conditions"][-1]["reason"] == "DeletionByPodGC"
        assert deleted[0]["metadata"]["deletionGracePeriodSeconds"] == 0


def test_restart_policies_and_backoff_limit(cluster: Cluster) -> None:
    jobs, core = admin(cluster)
    # OnFailure: the kubelet restarts the failed container in the same pod (the claim keeps the
    # count of runs); the second run succeeds and so does the job.
    once = (
        "import pathlib, sys; p = pathlib.Path('/mnt/scratch/{0}'); n = int(p.read_text()) if p.exists() else 0; "
        "p.write_text(str(n + 1)); sys.exit({1})"
    )
    jobs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, tiny_job("flaky", once.format("flaky", "0 if n else 3"), claim="scratch")
    )
    # ExitCode: 137 (killed) is retryable: the operator recreates the pod; then 1 is permanent.
    exit_code = once.format("exitcode", "1 if n else 137")
    jobs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, tiny_job("exitcode", exit_code, claim="scratch", restart_policy="ExitCode")
    )
    # OnFailure that always fails: the job fails once the restarts reach backoffLimit.
    jobs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, tiny_job("doomed", "import sys; sys.exit(2)", claim="scratch", backoffLimit=2)
    )
    for name in ("flaky", "exitcode", "doomed"):
        wait_for(
            lambda n=name: {"Succeeded", "Failed"} & set(conditions(cluster.stored(PLURAL, NS, n))),
            what=f"{name} to finish",
        )
    flaky = cluster.stored(PLURAL, NS, "flaky")
    assert (
        conditions(flaky) == ["Created", "Succeeded"] and flaky["status"]["replicaStatuses"]["Worker"]["succeeded"] == 1
    )
    pod = core.read_namespaced_pod_status("flaky-worker-0", NS).status
    assert pod.phase == "Succeeded" and pod.container_statuses[0].restart_count == 1
    assert pod.container_statuses[0].last_state.terminated.exit_code == 3
    exitcode = cluster.stored(PLURAL, NS, "exitcode")
    assert conditions(exitcode) == ["Created", "Failed"]
    assert (
        exitcode["status"]["conditions"][-1]["message"]
        == "PyTorchJob exitcode is failed because 1 Worker replica(s) failed."
    )
    assert (Path(cluster.kubeconfig).parent.parent / "pvc" / "exitcode").read_text() == "2"  # ran twice: 137, then 1
    assert (
        core.read_namespaced_pod("exitcode-worker-0", NS).spec.restart_policy == "Never"
    )  # the operator restarts, not the kubelet
    doomed = cluster.stored(PLURAL, NS, "doomed")
    assert doomed["status"]["conditions"][-1]["reason"] == "PyTorchJobFailed"
    assert (
        doomed["status"]["conditions"][-1]["message"]
        == "PyTorchJob doomed has failed because it has reached the specified backoff limit"
    )


def test_clean_pod_policy_and_ttl(cluster: Cluster) -> None:
    jobs, _ = admin(cluster)
    kept = tiny_job("brief", "print('done')", claim="scratch", cleanPodPolicy="All", ttlSecondsAfterFinished=3600)
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, kept)
    wait_for(
        lambda: "Succeeded" in conditions(cluster.stored(PLURAL, NS, "brief")), what="brief to succeed"
    )  # kept for its TTL
    wait_for(lambda: cluster.stored("pods", NS, "brief-worker-0") is None, what="cleanPodPolicy All to delete the pod")
    # OnFailure without a backoff limit: only success ends the job, then its TTL of 0 deletes it.
    marker = "import pathlib; pathlib.Path('/mnt/scratch/expired').write_text('ran')"
    jobs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, tiny_job("expired", marker, claim="scratch", ttlSecondsAfterFinished=0)
    )
    wait_for(lambda: cluster.stored(PLURAL, NS, "expired") is None, what="the TTL to delete the job")
    wait_for(
        lambda: cluster.stored("pods", NS, "expired-worker-0") is None, what="the garbage collector to delete its pod"
    )
    assert (Path(cluster.kubeconfig).parent.parent / "pvc" / "expired").read_text() == "ran"


def test_the_step_creates_follows_cancels_and_uses_exactly_the_roles_verbs(
    cluster: Cluster, capsys: pytest.CaptureFixture
) -> None:
    """run_pytorchjob (the step's code) to success, and cancelled: the job is deleted gracefully
    (its pod gets SIGTERM and exits through its handler; the job is 404 once the pod is gone) and
    the ServiceAccount used every verb of the Role and nothing else."""
    start = len(cluster.audit)
    tc = step_client(cluster)
    ok = tiny_job("ok", "print('hello from the pod', flush=True)", claim="scratch")
    final = run_pytorchjob(as_model(ok), training_client=tc, poll_s=1, log=lambda s: None)
    assert conditions(final)[-1] == "Succeeded"
    printed: list[str] = []  # the step follows worker 0's log in a thread of its own: wait for it

    def followed() -> bool:
        printed.append(capsys.readouterr().out)
        return "[Pod ok-worker-0]: hello from the pod" in "".join(printed)

    wait_for(followed, what="worker 0's log to be followed")
    graceful = (
        "import signal, sys, time\n"
        "def stop(*_):\n    print('terminating', flush=True); time.sleep(0.5); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop); print('up', flush=True); time.sleep(600)"
    )
    job = as_model(tiny_job("cancelled", graceful, claim="scratch"))
    _, core = admin(cluster)

    def cancel_once_up() -> None:
        wait_for(lambda: "up" in _log(core, "cancelled-worker-0"), what="the pod to start")
        _thread.interrupt_main()  # what the step's SIGTERM handler raises

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupt_main needs Python's handler
    try:
        threading.Thread(target=cancel_once_up, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_pytorchjob(job, training_client=tc, poll_s=1, timeout_s=120, log=lambda s: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert cluster.stored(PLURAL, NS, "cancelled") is None and cluster.stored("pods", NS, "cancelled-worker-0") is None
    log = next((Path(cluster.kubeconfig).parent / "pods").glob(f"{NS}_cancelled-worker-0_*/pytorch-0.log")).read_text()
    assert log.splitlines() == ["up", "terminating"]  # stopped by SIGTERM within its grace period, not killed
    # A failed job: the step reads its events too.
    failing = as_model(tiny_job("failed", "import sys; sys.exit(2)", claim="scratch", restart_policy="Never"))
    with pytest.raises(JobFailed):
        run_pytorchjob(failing, training_client=tc, poll_s=1, timeout_s=60, log=lambda s: None)
    step = [a for a in cluster.audit[start:] if a.user == cluster.service_account]
    assert all(a.code < 400 or (a.verb, a.code) == ("get", 404) for a in step), step
    used = {(a.verb, a.resource) for a in step}
    role = next(d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d and d["kind"] == "Role")
    granted = {(verb, resource) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert used == granted


def test_the_step_fails_with_the_jobs_reason_and_deletes_the_failed_job(cluster: Cluster) -> None:
    """Past its backoff limit an OnFailure job's pods would keep restarting until its TTL: the step
    prints its workers' last lines, deletes it and its pods, then fails with the job's reason."""
    failing = "import sys; print('disk full', flush=True); sys.exit(2)"
    job = as_model(tiny_job("broken", failing, claim="scratch", replicas=2, backoffLimit=1))
    reason = "PyTorchJobFailed: PyTorchJob broken has failed because it has reached the specified backoff limit"
    lines: list[str] = []
    with pytest.raises(JobFailed, match=f"PyTorchJob {NS}/broken failed: {re.escape(reason)}$"):
        run_pytorchjob(job, training_client=step_client(cluster), poll_s=1, timeout_s=60, log=lines.append)
    assert cluster.stored(PLURAL, NS, "broken") is None
    assert [p for p in (cluster.stored("pods", NS, f"broken-worker-{i}") for i in range(2)) if p] == []
    # Each worker's log (its text depends on when the kubelet restarted the container again).
    headers = [line.splitlines()[0] for line in lines if line.startswith("---")]
    assert headers[:2] == [f"--- broken-worker-{i} (last lines)" for i in range(2)]
    assert re.fullmatch(rf"--- events of PyTorchJob {NS}/broken \(latest \d+\)", headers[2]), headers
    events = next(line for line in lines if line.startswith("--- events")).splitlines()[1:]
    assert any("BackOff" in e and "pod/broken-worker-" in e for e in events), events  # the kubelet's
    assert any("PyTorchJobFailed" in e and "pytorchjob/broken" in e for e in events), events  # the operator's
    assert lines[-1] == f"deleted PyTorchJob {NS}/broken"


def test_a_rerun_deletes_the_ended_job_of_its_name_and_refuses_a_live_one(cluster: Cluster) -> None:
    """A preempted run's PyTorchJob ends Succeeded and stays until its TTL: running the training
    run again (to resume it) deletes that job first instead of failing with 409 AlreadyExists. A
    job of the name that is still running is refused and left alone."""
    job = as_model(tiny_job("again", "print('done', flush=True)", claim="scratch"))
    lines: list[str] = []
    run_pytorchjob(job, training_client=step_client(cluster), poll_s=1, timeout_s=60, log=lines.append)
    assert "Succeeded" in conditions(cluster.stored(PLURAL, NS, "again"))
    first_uid = cluster.stored(PLURAL, NS, "again")["metadata"]["uid"]
    run_pytorchjob(job, training_client=step_client(cluster), poll_s=1, timeout_s=60, log=lines.append)
    assert f"deleting the ended PyTorchJob {NS}/again (Succeeded) before running it again" in lines
    assert lines.index(f"deleted PyTorchJob {NS}/again") < lines.index(
        f"created PyTorchJob {NS}/again", 1 + lines.index(f"created PyTorchJob {NS}/again")
    )
    assert cluster.stored(PLURAL, NS, "again")["metadata"]["uid"] != first_uid

    live = as_model(tiny_job("busy"))  # its pod waits for a claim the cluster lacks: it never ends
    step_client(cluster).create_job(job=live, namespace=NS)
    with pytest.raises(
        JobFailed, match=f"PyTorchJob {NS}/busy is still running with another spec: wait for it to end, or delete it"
    ):
        run_pytorchjob(live, training_client=step_client(cluster), poll_s=1, timeout_s=60, log=lines.append)
    assert cluster.stored(PLURAL, NS, "busy") is not None


_FIRST_STEP = """
import json, sys
from types import SimpleNamespace
from kubeflow.training import ApiClient, TrainingClient
from kubernetes import client as k8s, config
from trainer.launch.k8s import run_pytorchjob
cfg = k8s.Configuration()
config.load_kube_config(sys.argv[1], client_configuration=cfg)
job = ApiClient().deserialize(SimpleNamespace(data=sys.argv[2]), "KubeflowOrgV1PyTorchJob")
run_pytorchjob(job, training_client=TrainingClient(client_configuration=cfg, namespace=sys.argv[3]), poll_s=1)
"""


def test_a_retried_step_follows_the_job_it_made_instead_of_starting_another(cluster: Cluster) -> None:
    """The train step's pod dies while its PyTorchJob runs (the process following the job is
    killed) and KFP retries the step: the new step finds the live job with its own spec and
    follows it to the end. No AlreadyExists, no second job: one pod, one run of its container.
    """
    script = "import time; print('up', flush=True); time.sleep(8); print('done', flush=True)"
    manifest = tiny_job("retried", script, claim="scratch")
    _, core = admin(cluster)
    first = subprocess.Popen(
        [sys.executable, "-c", _FIRST_STEP, str(cluster.kubeconfig), json.dumps(manifest), NS], cwd=ROOT
    )
    try:
        wait_for(lambda: "up" in _log(core, "retried-worker-0"), what="the job's pod to run")
    finally:
        first.kill()
        first.wait()
    uid = cluster.stored(PLURAL, NS, "retried")["metadata"]["uid"]
    pod_uid = cluster.stored("pods", NS, "retried-worker-0")["metadata"]["uid"]
    lines: list[str] = []
    final = run_pytorchjob(
        as_model(manifest), training_client=step_client(cluster), poll_s=1, timeout_s=120, log=lines.append
    )
    assert conditions(final)[-1] == "Succeeded" and final["metadata"]["uid"] == uid
    assert lines[0] == f"following PyTorchJob {NS}/retried, which this step created before it was retried", lines
    pod = cluster.stored("pods", NS, "retried-worker-0")
    assert pod["metadata"]["uid"] == pod_uid and pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert _log(core, "retried-worker-0").split() == ["up", "done"]


def test_a_job_deleted_by_someone_else_fails_the_step(cluster: Cluster) -> None:
    jobs, core = admin(cluster)

    def delete_once_up() -> None:
        wait_for(lambda: "up" in _log(core, "vanishing-worker-0"), what="the pod to start")
        jobs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "vanishing")

    threading.Thread(target=delete_once_up, daemon=True).start()
    job = as_model(tiny_job("vanishing", "import time; print('up', flush=True); time.sleep(600)", claim="scratch"))
    lines: list[str] = []
    with pytest.raises(
        JobFailed, match=f"^PyTorchJob {NS}/vanishing was deleted while it ran \\(its events are above\\)$"
    ):
        run_pytorchjob(job, training_client=step_client(cluster), poll_s=1, timeout_s=60, log=lines.append)
    events = next(line for line in lines if line.startswith(f"--- events of PyTorchJob {NS}/vanishing")).splitlines()[
        1:
    ]
    assert any("SuccessfulCreatePod" in e for e in events) and any(
        "Started" in e and "pod/vanishing-worker-0" in e for e in events
    )
    assert not any(line.startswith("could not delete") for line in lines), lines  # gone already: nothing to delete
    # The step gives up only once the garbage collector's deletion has stopped the pod (it may be
    # checkpointing into the run dir until then), so the events show that stop too.
    assert cluster.stored("pods", NS, "vanishing-worker-0") is None
    assert any("Killing" in e and "pod/vanishing-worker-0" in e for e in events), events


def _log(core: k8s.CoreV1Api, pod: str) -> str:
    try:
        return core.read_namespaced_pod_log(pod, NS, container="pytorch")
    except k8s.ApiException:  # not created or not started yet
        return ""


# ----------------------------------------------------------------------------- end to end
def test_run_local_runs_the_whole_pipeline_through_the_emulated_cluster(tmp_path: Path) -> None:
    """`rfsdp pipeline run-local --set backend=kubernetes`: the train step creates the PyTorchJob of
    `rfsdp pipeline manifest` through a kubeconfig, 2 Worker pods run real ft_launchers on CPU, an
    exception on rank 1 (in-process restart) and a SIGKILL of rank 0 (in-job restart) recover, rank
    0's progress reaches the step's log, the validate step finds the checkpoint valid and MLflow
    holds the restarts. The checkpoint key of the environment reaches the workers through the
    rfsdp-checkpoint-key secret: they sign every manifest, and validation accepts only signed ones.
    """
    import mlflow

    settings = ["backend=kubernetes", "training_run=e2e", "nnodes=2", "nproc_per_node=1", "steps=12", "ckpt_every=4"]
    settings += ["fault=exception@3:1,sigkill@7:0", "hang_timeout=6"]
    uri, key = f"sqlite:///{tmp_path / 'mlflow.db'}", "the run's key"
    sets = [arg for s in settings for arg in ("--set", s)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, SIGNING_KEY_ENV: key}
    root = tmp_path / "root"
    cli = [sys.executable, "-m", "trainer.cli", "pipeline"]
    proc = subprocess.run(
        [*cli, "run-local", "--root", str(root), *sets], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    stored = yaml.safe_load((root / "cluster" / "e2e.pytorchjob.yaml").read_text())
    assert conditions(stored)[-1] == "Succeeded"
    server_fields = {"uid", "resourceVersion", "generation", "creationTimestamp"}
    stored["metadata"] = {k: v for k, v in stored["metadata"].items() if k not in server_fields}
    del stored["status"]
    shown = subprocess.run([*cli, "manifest", *sets], env=env, capture_output=True, text=True, timeout=120, check=True)
    expected = yaml.safe_load(shown.stdout)
    expected["metadata"]["namespace"] = NS  # the client's namespace: the manifest leaves it to the step's pod
    assert stored == expected

    run = root / "workspace" / "e2e" / "run"
    events = read_events(run)
    assert {(f.kind, f.step, f.rank) for f in select(events, FaultFired)} == {("exception", 3, 1), ("sigkill", 7, 0)}
    assert {r.layer for r in select(events, Restart)} >= {"in_process", "in_job"}
    # Rank 0's progress lines reach the step's log through worker 0's followed log.
    steps_log = (root / "steps.log").read_text()
    assert "[Pod e2e-worker-0]: step 12/12" in steps_log
    assert "(in_process): resumed from step" in steps_log and "(in_job): resumed from step" in steps_log
    # The terminal shows the faults and recoveries from the run's events, as they happen.
    assert "fault exception at step 3 on rank 1" in proc.stdout and "fault sigkill at step 7 on rank 0" in proc.stdout
    assert "(in_job): resumed from step" in proc.stdout and "train: success in" in proc.stdout
    latest = json.loads((latest_checkpoint(run) / "manifest.json").read_text())
    assert latest["step"] == 12 and latest["signature"] == manifest_signature(latest, key.encode())

    run_id = re.search(r"MLflow run id:\s*([0-9a-f]{32})", proc.stdout)[1]
    logged = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    assert logged.info.status == "FINISHED" and logged.data.tags["backend"] == "kubernetes"
    assert logged.data.tags["rfsdp.valid"] == "true" and logged.data.tags["training_run"] == "e2e"
    restarts = select(events, Restart)
    for layer in ("in_process", "in_job"):
        assert logged.data.metrics[f"restarts_{layer}"] == len([r for r in restarts if r.layer == layer])


def test_a_preempted_pytorchjob_fails_the_train_step_and_is_logged_failed(tmp_path: Path) -> None:
    """A 2-node PyTorchJob preempted as a whole (the sigterm fault on both ranks: every worker's
    container gets SIGTERM): the ranks checkpoint step 6 and exit 0, and the elastic job ends
    Succeeded, yet the train step fails with how to resume the run, and MLflow holds a FAILED run
    with that reason (never a FINISHED, validated partial model)."""
    import mlflow

    settings = [
        "backend=kubernetes",
        "training_run=preempted",
        "nnodes=2",
        "nproc_per_node=1",
        "steps=12",
        "ckpt_every=4",
    ]
    settings += ["fault=sigterm@6:0,sigterm@6:1", "hang_timeout=6"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sets = [arg for s in settings for arg in ("--set", s)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    root = tmp_path / "root"
    cli = [sys.executable, "-m", "trainer.cli", "pipeline", "run-local", "--root", str(root), *sets]
    proc = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "'train'" in proc.stderr and "validate-checkpoint: started" not in proc.stdout, proc.stdout[-3000:]
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resilient-fsdp").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["rfsdp.failed_step"] == "train"
    assert (
        run.data.tags["rfsdp.failure_reason"]
        == "RuntimeError: preempted at step 6; start a run with training_run=preempted to resume"
    )


def test_an_evicted_worker_pod_checkpoints_and_the_job_resumes_in_its_replacement(tmp_path: Path) -> None:
    """`kubectl delete pod NAME-worker-1` mid-run, as an eviction or a node drain does it (SIGTERM,
    then the grace period). Both ranks checkpoint the step reached. The evicted pod ends Failed,
    never Succeeded (a deleted pod reaches a terminal phase, and one Succeeded worker completes an
    elastic job). Worker 0's ranks wait in the rendezvous: its container never restarts. The
    operator recreates worker 1 and the job resumes from that step, losing none, and succeeds.
    """
    settings = [
        "backend=kubernetes",
        "training_run=evicted",
        "nnodes=2",
        "nproc_per_node=1",
        "steps=60",
        "ckpt_every=50",
    ]
    settings += ["hang_timeout=6"]
    sets = [arg for s in settings for arg in ("--set", s)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    root = tmp_path / "root"
    run = root / "workspace" / "evicted" / "run"
    cli = [sys.executable, "-m", "trainer.cli", "pipeline", "run-local", "--root", str(root), *sets]
    with subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            wait_for(lambda: any(e.step >= 5 for e in select(read_events(run), Step)), timeout=300, what="step 5")
            kubectl = {**env, "KUBECONFIG": str(root / "cluster" / "admin.kubeconfig"), "HOME": str(tmp_path)}
            subprocess.run(
                ["kubectl", "delete", "pod", "evicted-worker-1", "--wait=false"], env=kubectl, check=True, timeout=60
            )
            out, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
    assert proc.returncode == 0, out[-6000:]
    events = read_events(run)
    (left,) = select(events, NodesPreempted)
    assert (left.nodes, left.nnodes, left.others) == ([1], 2, "wait") and 5 <= left.step < 60
    (restart,) = select(events, Restart)
    assert (restart.layer, restart.resumed_from_step, restart.lost_steps) == ("in_job", left.step, 0)
    assert [e.status for e in select(events, RunEnd)] == ["completed"] and max(final_losses(events)) == 60
    stored = yaml.safe_load((root / "cluster" / "evicted.pytorchjob.yaml").read_text())
    assert conditions(stored)[-1] == "Succeeded"
    # Each pod's folder holds a log per run of its container: worker 0's ran once, worker 1 was two pods.
    pods = {p: sorted(log.name for log in p.glob("*.log")) for p in (root / "cluster" / "pods").iterdir()}
    assert sorted((p.name.split("_")[1], logs) for p, logs in pods.items()) == [
        ("evicted-worker-0", ["pytorch-0.log"]),
        ("evicted-worker-1", ["pytorch-0.log"]),
        ("evicted-worker-1", ["pytorch-0.log"]),
    ]


LOST_NODE_SETTINGS = [
    "nnodes=2",
    "nproc_per_node=1",
    "steps=60",  # baseline_60's trajectory: 2 ranks, the built-in data, the default model and seed
    "ckpt_every=60",  # no durable checkpoint before the end: what comes back is the local tier's
    "local_ckpt_every=1",
    "local_replicas=1",
    "hang_timeout=6",
]


def _json_stream(text: str) -> list[dict]:
    """The JSON objects `kubectl get -w -o json` printed one after the other (a last one still
    being written is left out)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_node_takes_its_pod_and_memory_and_the_job_resumes_from_the_peer_replica(
    tmp_path: Path, baseline_60: Path, lost: int
) -> None:
    """`kubectl delete node` of the node under worker LOST mid-run: the machine is gone, so every
    process of its pod dies at once (SIGKILL, no SIGTERM: no `Killing` event, no checkpoint of
    a preemption) with the pod's memory, where its local tier lay; the pod garbage collector
    fails and deletes the pod, and the operator recreates it on another node. The new rank has no
    snapshot of its own: its state comes back from the replica its peer holds (`source` `peer`),
    at most one step is redone, the losses are those of an uninterrupted `rfsdp train` of the same
    trajectory (``baseline_60``), and the job succeeds.
    Worker 0 holds the rendezvous: when it is lost, worker 1's launcher ends and the kubelet
    restarts its container, whose memory (the pod's Memory emptyDir) outlives that restart.
    """
    name = f"lost{lost}"
    sets = [a for s in ["backend=kubernetes", f"training_run={name}", *LOST_NODE_SETTINGS] for a in ("--set", s)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    root = tmp_path / "root"
    run = root / "workspace" / name / "run"
    kubectl_env = {**env, "KUBECONFIG": str(root / "cluster" / "admin.kubeconfig"), "HOME": str(tmp_path)}
    watched = {what: tmp_path / f"{what}.json" for what in ("pods", "events")}
    watchers: list[subprocess.Popen] = []
    cli = [sys.executable, "-m", "trainer.cli", "pipeline", "run-local", "--root", str(root), *sets]
    with subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            wait_for(lambda: any(e.step >= 5 for e in select(read_events(run), Step)), timeout=300, what="step 5")
            for what, path in watched.items():  # what the cluster did, until it stops with the pipeline
                extra = ["--output-watch-events"] if what == "pods" else ["-A"]
                with open(path, "w") as sink:
                    watchers.append(
                        subprocess.Popen(
                            ["kubectl", "get", what, "-w", "-o", "json", *extra], env=kubectl_env, stdout=sink
                        )
                    )
            wait_for(lambda: all(_json_stream(p.read_text()) for p in watched.values()), what="the watches to list")
            pod = json.loads(
                subprocess.run(
                    ["kubectl", "get", "pod", f"{name}-worker-{lost}", "-o", "json"],
                    env=kubectl_env,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=60,
                ).stdout
            )
            node, uid = pod["spec"]["nodeName"], pod["metadata"]["uid"]
            subprocess.run(["kubectl", "delete", "node", node], env=kubectl_env, check=True, timeout=60)
            out, _ = proc.communicate(timeout=900)
        finally:
            proc.kill()
            for watcher in watchers:
                try:
                    watcher.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    watcher.kill()
    assert proc.returncode == 0, out[-6000:]

    # The training: no preemption, one recovery from the peer's replica, the same trajectory.
    events = read_events(run)
    assert select(events, NodesPreempted) == []
    (restart,) = select(events, Restart)
    assert (restart.layer, restart.source) == ("in_job", "peer") and restart.lost_steps <= 1, restart
    assert [e.status for e in select(events, RunEnd)] == ["completed"]
    assert final_losses(events) == final_losses(read_events(baseline_60))
    stored = yaml.safe_load((root / "cluster" / f"{name}.pytorchjob.yaml").read_text())
    assert conditions(stored)[-1] == "Succeeded"

    # The cluster: the pod failed with its node and was deleted, with no SIGTERM; its replacement
    # runs on another node.
    pod_changes = _json_stream(watched["pods"].read_text())
    changes = [c for c in pod_changes if c["object"]["metadata"]["uid"] == uid]
    assert changes[-1]["type"] == "DELETED"
    gone = changes[-1]["object"]
    assert gone["status"]["phase"] == "Failed" and gone["metadata"]["deletionGracePeriodSeconds"] == 0
    assert {"type": "DisruptionTarget", "reason": "DeletionByPodGC"}.items() <= gone["status"]["conditions"][-1].items()
    replacements = {
        c["object"]["metadata"]["uid"]: c["object"]["spec"].get("nodeName")
        for c in pod_changes
        if c["object"]["metadata"]["name"] == f"{name}-worker-{lost}" and c["object"]["metadata"]["uid"] != uid
    }
    assert len(replacements) == 1 and next(iter(replacements.values())) not in (None, node)
    # The peer's pod stays: its ranks wait in the rendezvous (worker 1 lost), or, the rendezvous
    # host lost, its launcher ends and the kubelet restarts its container in the same pod.
    peer = [c["object"] for c in pod_changes if c["object"]["metadata"]["name"] == f"{name}-worker-{1 - lost}"]
    assert len({p["metadata"]["uid"] for p in peer}) == 1
    restarts = peer[-1]["status"]["containerStatuses"][0]["restartCount"]
    assert restarts >= 1 if lost == 0 else restarts == 0, restarts
    cluster_events = _json_stream(watched["events"].read_text())
    about_pod = {e["reason"] for e in cluster_events if e["involvedObject"].get("uid") == uid}
    assert about_pod == {"Scheduled", "Pulled", "Created", "Started"}  # no Killing: no SIGTERM was sent
    assert any(
        e["reason"] == "RemovingNode" and e["involvedObject"] == {**e["involvedObject"], "kind": "Node", "name": node}
        for e in cluster_events
    )
    print(
        f"\nnode under worker {lost} lost: resumed from step {restart.resumed_from_step} ({restart.source}), "
        f"{restart.lost_steps} step(s) redone, {restart.recovery_s:.1f} s"
    )
