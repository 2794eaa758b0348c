"""The real `kubectl` against the emulated cluster (trainer.emulation): what a platform engineer
types works as it does on a real cluster.

kubectl (client-go) sends its bearer token over TLS only, discovers the API (aggregated
discovery), reads OpenAPI v3 for `explain` and to learn that the server validates fields, prints
the server's Tables, watches from resourceVersions, sends access reviews as protobuf. Every test
drives the real binary through the cluster's kubeconfigs and skips where none is installed. The
API tests need no root (no pod is started: the kubelet is off without it); the tests that run
pods need the emulated cluster's namespaces and skip with the reason elsewhere.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from trainer.emulation import handlers
from trainer.emulation.api import RBAC_FILE, ApiError, Store
from trainer.emulation.cluster import Cluster, cluster_problem, emulated_cluster
from trainer.emulation.tls import make_pki

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="no kubectl on the PATH (it is not installed by the project)")
PROBLEM = cluster_problem()
needs_pods = pytest.mark.skipif(PROBLEM is not None, reason=f"pods cannot run here: the emulated cluster {PROBLEM}")
SA = "system:serviceaccount:default:rfsdp-pipeline"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("kubectl")
    with emulated_cluster(root / "state", restart_backoff_s=0.2, kubelet=PROBLEM is None) as c:
        yield c


def kubectl(cluster: Cluster, *args: str, kubeconfig: Path | None = None, check: bool = True, stdin: str | None = None):  # noqa: ANN201
    """Run kubectl with a kubeconfig of the cluster (the admin's by default) and its own cache."""
    home = cluster.admin_kubeconfig.parent / "home"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig or cluster.admin_kubeconfig), "HOME": str(home)}
    env["KUBECACHEDIR"] = str(home / "cache")
    done = subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, input=stdin, timeout=120)
    if check:
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done


def job(name: str, script: str = "pass", *, replicas: int = 1, claim: str = "", **run_policy) -> dict:  # noqa: ANN003
    """A PyTorchJob whose Worker pods run ``python -c script``; with a claim the cluster lacks,
    its pods stay Pending and nothing runs.
    """
    container = {"name": "pytorch", "image": "local", "command": [sys.executable, "-c", script]}
    pod: dict = {"spec": {"containers": [container], "terminationGracePeriodSeconds": 5}}
    if claim:
        container["volumeMounts"] = [{"name": "data", "mountPath": "/mnt/data"}]
        pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    worker = {"replicas": replicas, "restartPolicy": "OnFailure", "template": pod}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"pytorchReplicaSpecs": {"Worker": worker}, "runPolicy": {"cleanPodPolicy": "None", **run_policy}},
    }


def apply(cluster: Cluster, manifest: dict, *extra: str, check: bool = True):  # noqa: ANN201
    return kubectl(cluster, "apply", "-f", "-", *extra, stdin=yaml.safe_dump(manifest), check=check)


def rows(output: str) -> list[list[str]]:
    """A printed table, split into its cells (header first)."""
    return [line.split() for line in output.splitlines() if line.strip()]


def request(
    cluster: Cluster, path: str, *, token: bool = True, method: str = "GET", body: bytes | None = None
) -> tuple[int, dict]:
    """One request to the API server with the admin's token, verifying it with the cluster's CA."""
    config = yaml.safe_load(cluster.admin_kubeconfig.read_text())
    req = urllib.request.Request(
        cluster.url + path, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    if token:
        req.add_header("Authorization", f"Bearer {config['users'][0]['user']['token']}")
    try:
        with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=str(cluster.ca)), timeout=30) as r:
            return r.status, json.loads(r.read().splitlines()[0])
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ----------------------------------------------------------------------------- TLS and discovery
def test_tls_with_the_clusters_ca_and_tokens_only_over_it(cluster: Cluster, tmp_path: Path) -> None:
    config = yaml.safe_load(cluster.admin_kubeconfig.read_text())
    server = config["clusters"][0]["cluster"]
    assert server["server"].startswith("https://127.0.0.1:")
    assert base64.b64decode(server["certificate-authority-data"]) == cluster.ca.read_bytes()
    assert request(cluster, "/version")[1]["minor"] == "32"
    code, status = request(cluster, "/api/v1/namespaces/default/pods", token=False)
    assert (code, status["reason"]) == (401, "Unauthorized")
    # Plain http is not served at all: a token never travels in the clear.
    plain = cluster.url.replace("https://", "http://") + "/api"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(urllib.request.Request(plain, headers={"Authorization": "Bearer x"}), timeout=10)
    # A client that trusts another CA refuses the server.
    other = make_pki(tmp_path / "other")
    server["certificate-authority-data"] = base64.b64encode(other.ca.read_bytes()).decode()
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    done = kubectl(cluster, "get", "pods", kubeconfig=tmp_path / "kubeconfig", check=False)
    assert done.returncode != 0 and "certificate signed by unknown authority" in done.stderr
    # The server is still serving after the refused handshake.
    assert kubectl(cluster, "get", "pods").returncode == 0


def test_discovery_version_and_openapi(cluster: Cluster) -> None:
    version = json.loads(kubectl(cluster, "version", "-o", "json").stdout)
    assert version["serverVersion"]["major"] == "1" and version["serverVersion"]["minor"] == "32"
    names = kubectl(cluster, "api-resources", "-o", "name").stdout.split()
    assert {"pods", "events", "pytorchjobs.kubeflow.org", "selfsubjectaccessreviews.authorization.k8s.io"} <= set(names)
    wide = rows(kubectl(cluster, "api-resources", "--api-group=kubeflow.org").stdout)
    assert wide[1] == ["pytorchjobs", "kubeflow.org/v1", "true", "PyTorchJob"]
    explained = kubectl(cluster, "explain", "pytorchjobs.spec.runPolicy.backoffLimit").stdout
    assert "KIND:       PyTorchJob" in explained and "backoffLimit <integer>" in explained
    assert "Optional number of retries before marking this job failed." in explained


# ----------------------------------------------------------------------------- get, apply, selectors
def test_apply_and_get_tables_wide_yaml_jsonpath_and_selectors(cluster: Cluster) -> None:
    manifest = job("idle", replicas=2, claim="missing")
    assert apply(cluster, manifest).stdout.strip() == "pytorchjob.kubeflow.org/idle created"
    assert apply(cluster, manifest).stdout.strip() == "pytorchjob.kubeflow.org/idle unchanged"
    manifest["metadata"]["labels"]["tier"] = "demo"
    assert apply(cluster, manifest).stdout.strip() == "pytorchjob.kubeflow.org/idle configured"

    table = rows(kubectl(cluster, "get", "pytorchjobs", "-l", "tier=demo").stdout)
    assert table[0] == ["NAME", "STATE", "AGE"] and table[1][:2] == ["idle", "Created"]
    for _ in range(100):  # the operator creates the pods
        pods = rows(kubectl(cluster, "get", "pods", "-l", "training.kubeflow.org/job-name=idle").stdout)
        if len(pods) == 3:
            break
        time.sleep(0.1)
    assert pods[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert [p[:4] for p in pods[1:]] == [
        ["idle-worker-0", "0/1", "Pending", "0"],
        ["idle-worker-1", "0/1", "Pending", "0"],
    ]
    wide = kubectl(cluster, "get", "pods", "-o", "wide", "-l", "training.kubeflow.org/job-name=idle").stdout
    assert rows(wide)[0] == [
        "NAME",
        "READY",
        "STATUS",
        "RESTARTS",
        "AGE",
        "IP",
        "NODE",
        "NOMINATED",
        "NODE",
        "READINESS",
        "GATES",
    ]
    assert rows(wide)[1][5] == "127.10.0.1"
    one = kubectl(
        cluster,
        "get",
        "pods",
        "-l",
        "training.kubeflow.org/job-name=idle,training.kubeflow.org/replica-index in (1)",
        "-o",
        "name",
    )
    assert one.stdout.split() == ["pod/idle-worker-1"]
    pending = kubectl(cluster, "get", "pods", "--field-selector", "status.phase=Pending", "-o", "name").stdout.split()
    assert {"pod/idle-worker-0", "pod/idle-worker-1"} <= set(pending)
    refused = kubectl(cluster, "get", "pods", "--field-selector", "spec.bogus=1", check=False)
    assert refused.returncode == 1 and "field label not supported: spec.bogus" in refused.stderr

    stored = yaml.safe_load(kubectl(cluster, "get", "pytorchjob", "idle", "-o", "yaml").stdout)
    assert (stored["kind"], stored["metadata"]["name"], stored["metadata"]["generation"]) == ("PyTorchJob", "idle", 1)
    assert stored["metadata"]["labels"] == {"app": "idle", "tier": "demo"}
    assert "kubectl.kubernetes.io/last-applied-configuration" in stored["metadata"]["annotations"]
    path = "{.status.conditions[*].type} {.spec.pytorchReplicaSpecs.Worker.replicas}"
    assert kubectl(cluster, "get", "pytorchjob", "idle", "-o", f"jsonpath={path}").stdout == "Created 2"


def test_apply_validates_strictly_on_the_server(cluster: Cluster) -> None:
    typo = job("typo")
    typo["spec"]["runPolicy"]["backofLimit"] = 3
    done = apply(cluster, typo, check=False)
    assert done.returncode == 1
    assert 'strict decoding error: unknown field "spec.runPolicy.backofLimit"' in done.stderr
    wrong = job("wrong")
    wrong["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    done = apply(cluster, wrong, check=False)
    assert (
        done.returncode == 1
        and "is invalid" in done.stderr
        and "spec.pytorchReplicaSpecs.Worker.replicas" in done.stderr
    )
    assert kubectl(cluster, "get", "pytorchjob", "typo", check=False).returncode == 1
    odd = job("odd")
    odd["spec"]["pytorchReplicaSpecs"]["Chief"] = odd["spec"]["pytorchReplicaSpecs"].pop("Worker")
    done = apply(cluster, odd, check=False)
    assert (
        done.returncode == 1
        and 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied' in done.stderr
    )


def test_apply_deploy_rbac(cluster: Cluster) -> None:
    applied = kubectl(cluster, "apply", "-f", str(RBAC_FILE)).stdout.split("\n")
    assert applied[:3] == [
        "serviceaccount/rfsdp-pipeline created",
        "role.rbac.authorization.k8s.io/rfsdp-pytorchjobs created",
        "rolebinding.rbac.authorization.k8s.io/rfsdp-pipeline-pytorchjobs created",
    ]
    again = kubectl(cluster, "apply", "-f", str(RBAC_FILE)).stdout.split()
    assert again == ["serviceaccount/rfsdp-pipeline", "unchanged"] + again[2:] and again.count("unchanged") == 3
    role = yaml.safe_load(kubectl(cluster, "get", "role", "rfsdp-pytorchjobs", "-o", "yaml").stdout)
    assert role["rules"] == next(d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d["kind"] == "Role")["rules"]
    changed = yaml.safe_load(kubectl(cluster, "get", "sa", "rfsdp-pipeline", "-o", "yaml").stdout)
    changed["metadata"]["labels"]["extra"] = "yes"
    assert apply(cluster, changed).stdout.strip() == "serviceaccount/rfsdp-pipeline configured"
    assert kubectl(cluster, "get", "sa", "rfsdp-pipeline", "-o", "jsonpath={.metadata.labels.extra}").stdout == "yes"


def test_auth_can_i_is_answered_from_deploy_rbac(cluster: Cluster) -> None:
    def can_i(*args: str, kubeconfig: Path | None = None) -> tuple[int, str]:
        done = kubectl(cluster, "auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
        return done.returncode, done.stdout.strip()

    assert can_i("delete", "pods") == (0, "yes")  # the admin
    assert can_i("create", "pytorchjobs", f"--as={SA}") == (0, "yes")
    assert can_i("get", "pods", "--subresource=log", f"--as={SA}") == (0, "yes")
    assert can_i("list", "pytorchjobs", f"--as={SA}") == (1, "no")
    assert can_i("create", "pytorchjobs", "-n", "other", f"--as={SA}") == (1, "no")
    assert can_i("delete", "pytorchjobs", kubeconfig=cluster.kubeconfig) == (0, "yes")  # the step's own credentials
    assert can_i("watch", "pods", kubeconfig=cluster.kubeconfig) == (1, "no")
    refused = kubectl(cluster, "get", "pytorchjobs", kubeconfig=cluster.kubeconfig, check=False)
    assert refused.returncode == 1 and f'User "{SA}" cannot list resource "pytorchjobs"' in refused.stderr


# ----------------------------------------------------------------------------- watches and bad input
def test_a_watch_from_a_version_no_longer_kept_is_410_expired(cluster: Cluster) -> None:
    store = Store()
    store.put("events", {"metadata": {"name": "a", "namespace": "default"}})
    store.compacted = 5
    with pytest.raises(ApiError) as excinfo:
        store.since(3)
    assert (excinfo.value.code, excinfo.value.reason) == (410, "Expired")

    code, listed = request(cluster, "/api/v1/namespaces/default/pods")
    version = int(listed["metadata"]["resourceVersion"])
    with cluster.store.lock:
        kept, cluster.store.compacted = cluster.store.compacted, version
    try:
        code, event = request(cluster, f"/api/v1/namespaces/default/pods?watch=true&resourceVersion={version - 1}")
    finally:
        with cluster.store.lock:
            cluster.store.compacted = kept
    assert code == 200 and event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")


def test_bad_input_is_a_status_and_the_server_keeps_serving(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"
    assert request(cluster, jobs, method="POST", body=b"{not json")[0] == 400
    code, status = request(cluster, jobs, method="POST", body=b"[1, 2]")
    assert (code, status["kind"], status["reason"]) == (400, "Status", "BadRequest")
    code, status = request(cluster, jobs, method="POST", body=json.dumps({**job("x"), "metadata": "x"}).encode())
    assert (code, status["reason"]) == (400, "BadRequest")
    assert request(cluster, "/api/v1/namespaces/default/nothings")[0] == 404

    def broken(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("a bug in the emulator")

    monkeypatch.setattr(handlers, "table", broken)
    done = kubectl(cluster, "get", "pods", check=False)
    assert done.returncode == 1 and "RuntimeError: a bug in the emulator" in done.stderr
    monkeypatch.undo()
    assert kubectl(cluster, "get", "pods").returncode == 0


# ----------------------------------------------------------------------------- a job that runs
@needs_pods
def test_a_running_job_logs_watch_wait_describe_and_events(cluster: Cluster) -> None:
    script = "import time; print('step 1', flush=True); time.sleep(2); print('step 2')"
    watcher = subprocess.Popen(
        [KUBECTL, "get", "pytorchjobs", "-w", "--request-timeout=60s"],
        env={
            **os.environ,
            "KUBECONFIG": str(cluster.admin_kubeconfig),
            "HOME": str(cluster.admin_kubeconfig.parent / "home"),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        apply(cluster, job("tiny", script, replicas=2))
        kubectl(cluster, "wait", "--for=condition=Running", "pytorchjob/tiny", "--timeout=60s")
        followed = kubectl(cluster, "logs", "-f", "tiny-worker-0").stdout
        assert followed.splitlines() == ["step 1", "step 2"]
        waited = kubectl(cluster, "wait", "--for=condition=Succeeded", "pytorchjob/tiny", "--timeout=60s").stdout
        assert waited.strip() == "pytorchjob.kubeflow.org/tiny condition met"
        prefixed = kubectl(cluster, "logs", "-l", "training.kubeflow.org/job-name=tiny", "--prefix").stdout.splitlines()
        assert sorted(prefixed) == sorted(f"[pod/tiny-worker-{i}/pytorch] step {s}" for i in (0, 1) for s in (1, 2))
    finally:
        watcher.terminate()
        watched, _ = watcher.communicate(timeout=30)
    lines = rows(watched)
    assert lines[0] == ["NAME", "STATE", "AGE"] and ["NAME", "STATE", "AGE"] not in lines[1:]
    assert any(line[:2] == ["tiny", "Succeeded"] for line in lines)

    described = kubectl(cluster, "describe", "pytorchjob", "tiny").stdout
    events = described[described.index("Events:") :]
    assert "SuccessfulCreatePod" in events and "Created pod: tiny-worker-1" in events
    assert "PyTorchJobSucceeded" in events and "PyTorchJob default/tiny successfully completed." in events
    pod = kubectl(cluster, "describe", "pod", "tiny-worker-0").stdout
    reasons = [line.split()[1] for line in pod[pod.index("Events:") :].splitlines()[3:] if line.strip()]
    assert reasons == ["Scheduled", "Pulled", "Created", "Started"]
    assert "Successfully assigned default/tiny-worker-0 to emulated-node" in pod
    assert rows(kubectl(cluster, "get", "pods", "tiny-worker-0").stdout)[1][1:3] == ["0/1", "Completed"]


@needs_pods
def test_a_failing_job_backs_off_and_fails_with_events(cluster: Cluster) -> None:
    apply(cluster, job("crash", "import sys; print('boom'); sys.exit(3)", backoffLimit=2))
    kubectl(cluster, "wait", "--for=condition=Failed", "pytorchjob/crash", "--timeout=60s")
    listed = kubectl(
        cluster, "get", "events", "--field-selector", "involvedObject.name=crash-worker-0", "-o", "json"
    ).stdout
    reasons = {e["reason"]: e for e in json.loads(listed)["items"]}
    assert reasons["BackOff"]["type"] == "Warning" and reasons["BackOff"]["message"].startswith(
        "Back-off restarting failed container pytorch"
    )
    assert reasons["Started"]["count"] >= 2  # the kubelet restarted it
    job_events = kubectl(cluster, "describe", "pytorchjob", "crash").stdout
    assert "PyTorchJobFailed" in job_events and "has reached the specified backoff limit" in job_events
    assert kubectl(cluster, "logs", "crash-worker-0", "--previous").stdout.strip() == "boom"


@needs_pods
def test_delete_a_running_job(cluster: Cluster) -> None:
    apply(cluster, job("long", "import time; print('up', flush=True); time.sleep(600)"))
    kubectl(cluster, "wait", "--for=condition=Running", "pytorchjob/long", "--timeout=60s")
    for _ in range(100):  # the container has started printing
        if kubectl(cluster, "logs", "long-worker-0").stdout == "up\n":
            break
        time.sleep(0.1)
    assert kubectl(cluster, "logs", "long-worker-0").stdout == "up\n"
    deleted = kubectl(cluster, "delete", "pytorchjob", "long")  # waits until the job is gone
    assert deleted.stdout.strip() == 'pytorchjob.kubeflow.org "long" deleted'
    kubectl(cluster, "wait", "--for=delete", "pod/long-worker-0", "--timeout=60s")
    gone = kubectl(cluster, "get", "pytorchjob", "long", check=False)
    assert gone.returncode == 1 and 'pytorchjobs.kubeflow.org "long" not found' in gone.stderr
    killing = kubectl(
        cluster, "get", "events", "--field-selector", "reason=Killing,involvedObject.name=long-worker-0", "-o", "json"
    )
    assert [e["message"] for e in json.loads(killing.stdout)["items"]] == ["Stopping container pytorch"]
