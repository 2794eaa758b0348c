"""The Kubernetes backend: the PyTorchJob manifest against the real CRD schema and the webhook's
rules, one launch contract with the local backend, and submit / wait / logs / delete through the
real ``TrainingClient`` against a small fake kube-apiserver on loopback (no real API server can
run here: these are contract tests of the requests and of how the answers are handled).
"""

from __future__ import annotations

import _thread
import copy
import json
import re
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import jsonschema
import pytest
import yaml
from kubeflow.training import TrainingClient
from kubernetes import client as k8s

from pipelines.resilient_fsdp import check_parameters, pytorchjob_manifest
from trainer.launch.k8s import JobFailed, build_pytorchjob, cluster_options, run_pytorchjob, shared_paths
from trainer.launch.local import job_from_parameters, operator_env, worker_command

CRD = Path(__file__).resolve().parents[1] / "deploy" / "crds" / "kubeflow.org_pytorchjobs.v1.9.4.yaml"  # vendored, see its header
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def strict(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever it lists the known ones."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


CASES = [{}, {"nnodes": 2, "nproc_per_node": 1}, {"nnodes": 4, "nproc_per_node": 8, "gpus": True, "model": "1b", "namespace": "team-a"}]


def webhook_violations(job: dict) -> list[str]:
    """The training operator's admission webhook rules (kubeflow/training-operator v1.9,
    pkg/webhooks/pytorch), checked independently of trainer.launch.k8s."""
    out = []
    name = job["metadata"]["name"]
    if not DNS_1035.match(name) or len(name) > 63:
        out.append("name is not DNS-1035")
    specs = job["spec"]["pytorchReplicaSpecs"]
    for kind, replica in specs.items():
        if not any(c["name"] == "pytorch" for c in replica["template"]["spec"]["containers"]):
            out.append(f"{kind}: no container named pytorch")
    if "Master" in specs and specs["Master"].get("replicas", 1) != 1:
        out.append("Master replicas must be 1")
    elastic = job["spec"].get("elasticPolicy")
    if elastic is not None and "Worker" not in specs:
        out.append("elasticPolicy needs a Worker replica spec")
    if not isinstance(job["spec"].get("nprocPerNode"), str):
        out.append("nprocPerNode must be a string")
    if elastic and "nProcPerNode" in elastic:
        out.append("elasticPolicy.nProcPerNode set together with nprocPerNode")
    return out


@pytest.mark.parametrize("overrides", CASES)
def test_manifest_validates_against_crd_and_webhook_rules(validator: jsonschema.Draft7Validator, overrides: dict) -> None:
    job = pytorchjob_manifest(overrides)
    errors = sorted(validator.iter_errors(job), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    assert webhook_violations(job) == []
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == overrides.get("nnodes", 1) and worker["restartPolicy"] == "OnFailure"
    assert job["spec"]["nprocPerNode"] == str(overrides.get("nproc_per_node", 2))
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    pod = worker["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == (str(overrides["nproc_per_node"]) if overrides.get("gpus") else None)


def test_the_strict_schema_and_rules_catch_bad_manifests(validator: jsonschema.Draft7Validator) -> None:
    job = pytorchjob_manifest({})
    typo = copy.deepcopy(job)
    typo["spec"]["elasticPolicy"]["rdzvBackendd"] = "c10d"
    assert any("rdzvBackendd" in e.message for e in validator.iter_errors(typo))
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["runPolicy"]["backoffLimit"] = "3"
    assert list(validator.iter_errors(wrong_type))
    renamed = copy.deepcopy(job)
    renamed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    renamed["spec"]["nprocPerNode"] = 2
    assert webhook_violations(renamed) == ["Worker: no container named pytorch", "nprocPerNode must be a string"]


def test_one_launch_contract_local_and_cluster() -> None:
    """The pod runs exactly the local worker command, and the operator's PET_* env from the job's
    elasticPolicy equals what the local backend injects."""
    params = check_parameters({"nnodes": 3, "nproc_per_node": 2, "max_restarts": 5, "fault": "sigkill@7:5"})
    data, run_dir = shared_paths(params["run_name"])
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    job = k8s.ApiClient().sanitize_for_serialization(build_pytorchjob(cfg, spec, cluster_options(params)))
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == worker_command(cfg)
    elastic = job["spec"]["elasticPolicy"]
    endpoint = f"{job['metadata']['name']}-worker-0:{elastic['rdzvPort']}"
    injected = {
        "PYTHONUNBUFFERED": "1",
        "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_BACKEND": elastic["rdzvBackend"],
        "PET_RDZV_ID": "job-uid",
        "PET_MAX_RESTARTS": str(elastic["maxRestarts"]),
    }
    assert operator_env(spec, rdzv_endpoint=endpoint, job_id="job-uid") == injected
    assert {"name": "pytorchjob-port", "containerPort": elastic["rdzvPort"]} in container["ports"]


# --------------------------------------------------------------------- fake kube-apiserver
class FakeApiServer:
    """Just enough of kube-apiserver + the training operator for TrainingClient: the job's
    conditions advance one step per GET along ``script``; every request is recorded.
    """

    def __init__(self, script: list[dict]) -> None:
        self.script = script
        self.requests: list[tuple[str, str, dict | None]] = []
        self.jobs: dict[str, dict] = {}
        self.gets = 0
        self.on_get = lambda gets: None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: object, content_type: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> dict | None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                outer.requests.append((self.command, self.path, body))
                return body

            def do_POST(self) -> None:  # noqa: N802
                body = self._record()
                outer.jobs[body["metadata"]["name"]] = body
                self._send(201, body)

            def do_DELETE(self) -> None:  # noqa: N802
                self._record()
                name = urlparse(self.path).path.rsplit("/", 1)[1]
                outer.jobs.pop(name, None)
                self._send(200, {"kind": "Status", "status": "Success"})

            def do_GET(self) -> None:  # noqa: N802
                self._record()
                url = urlparse(self.path)
                if url.path.endswith("/log"):
                    self._send(200, "step 1 loss 5.5\nstep 2 loss 5.1\n", "text/plain")
                elif url.path.endswith("/pods"):
                    selector = parse_qs(url.query)["labelSelector"][0]
                    name = selector.split(",")[0].split("=")[1]
                    pod = {"metadata": {"name": f"{name}-worker-0"}, "status": {"phase": "Running"}}
                    self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [pod]})
                else:
                    name = url.path.rsplit("/", 1)[1]
                    if name not in outer.jobs:
                        self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                        return
                    outer.gets += 1
                    step = min(outer.gets, len(outer.script)) - 1
                    self._send(200, {**outer.jobs[name], "status": {"conditions": outer.script[: step + 1]}})
                    outer.on_get(outer.gets)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def client(self) -> TrainingClient:
        config = k8s.Configuration()
        config.host = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return TrainingClient(client_configuration=config, namespace="team-a")

    def calls(self) -> list[tuple[str, str]]:
        return [(method, urlparse(path).path) for method, path, _ in self.requests]


def condition(kind: str, reason: str = "", message: str = "") -> dict:
    return {
        "type": kind,
        "status": "True",
        "reason": reason or f"PyTorchJob{kind}",
        "message": message,
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }


def job_for(overrides: dict | None = None):  # noqa: ANN201
    params = check_parameters({"namespace": "team-a", "run_name": "exp-1", **(overrides or {})})
    data, run_dir = shared_paths(params["run_name"])
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    return build_pytorchjob(cfg, spec, cluster_options(params))


JOBS = "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs"
RBAC = Path(__file__).resolve().parent.parent / "deploy" / "rbac.yaml"


def assert_rbac_allows(calls: list[tuple[str, str]]) -> None:
    """Every API call the step made is granted by deploy/rbac.yaml's Role."""
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role")
    for method, path in calls:
        m = re.match(
            r"^/apis?/(?:(?P<group>[a-z.]+)/)?v1/namespaces/[^/]+/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$", path
        )
        assert m, path
        group = m["group"] if m["group"] != "v1" else ""
        resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
        verb = {"POST": "create", "DELETE": "delete", "GET": "get" if m["name"] else "list"}[method]
        assert any((group or "") in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role["rules"]), (
            f"deploy/rbac.yaml does not allow {verb} {resource} ({method} {path})"
        )


def test_run_pytorchjob_creates_follows_and_succeeds() -> None:
    job = job_for({"nnodes": 2})
    script = [condition("Created"), condition("Running"), condition("Running"), condition("Succeeded")]
    with FakeApiServer(script) as api:
        final = run_pytorchjob(job, training_client=api.client(), poll_s=1, log=lambda s: None)
    created = api.requests[0]
    assert created[:2] == ("POST", JOBS)
    assert created[2] == k8s.ApiClient().sanitize_for_serialization(job)
    assert final["status"]["conditions"][-1]["type"] == "Succeeded"
    assert ("GET", "/api/v1/namespaces/team-a/pods/exp-1-worker-0/log") in api.calls()
    assert not any(method == "DELETE" for method, _ in api.calls())
    assert_rbac_allows(api.calls())


def test_run_pytorchjob_fails_with_the_jobs_reason() -> None:
    script = [condition("Created"), condition("Running"), condition("Failed", "BackoffLimitExceeded", "Worker exited with code 13")]
    with FakeApiServer(script) as api, pytest.raises(JobFailed, match="failed: BackoffLimitExceeded: Worker exited with code 13"):
        run_pytorchjob(job_for(), training_client=api.client(), poll_s=1, log=lambda s: None)


def test_cancel_deletes_the_job() -> None:
    # interrupt_main() does nothing where SIGINT is ignored (tests started as a background job of a
    # shell): SIGINT gets Python's own handler for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with FakeApiServer([condition("Created"), condition("Running")]) as api:
            # Cancel while the step is polling the running job: what the step's SIGTERM handler raises.
            api.on_get = lambda gets: _thread.interrupt_main() if gets == 3 else None
            with pytest.raises(KeyboardInterrupt):
                run_pytorchjob(job_for(), training_client=api.client(), poll_s=1, timeout_s=60, log=lambda s: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ("DELETE", f"{JOBS}/exp-1") in api.calls()
    assert api.jobs == {}
    assert_rbac_allows(api.calls())


def test_a_job_deleted_by_someone_else_fails_the_step() -> None:
    with FakeApiServer([condition("Created"), condition("Running")]) as api:
        api.on_get = lambda gets: api.jobs.clear() if gets == 2 else None
        with pytest.raises(JobFailed, match="could not be followed to completion: Failed to get PyTorchJob"):
            run_pytorchjob(job_for(), training_client=api.client(), poll_s=1, timeout_s=60, log=lambda s: None)
