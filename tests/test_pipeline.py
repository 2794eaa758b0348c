"""The Kubeflow pipeline: compiled IR (strict protobuf parse: cluster defaults, a run-unique name,
the exit handler, the headline Metrics), parameters checked before anything starts, the
upload/submit path against a recording KFP server on loopback (a contract test: no real KFP server
can run here) and its refusals, and real end-to-end ``kfp.local`` runs of the whole pipeline: with a
fault, with its restarts exhausted (failed, and logged FAILED to MLflow), twice with the defaults,
and resumed under an explicit name.
"""

from __future__ import annotations

import email.parser
import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import torch
import yaml
from google.protobuf import json_format
from kfp import dsl
from kfp.dsl import Artifact, Dataset
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from components.runs import FAILURE_FILE, TRAIN_STEP
from components.train import train
from pipelines.resilient_fsdp import PIPELINE_NAME, parameter_defaults
from pipelines.run import compile_pipeline, run_local, submit
from tests.conftest import MlflowServer, as_unprivileged
from trainer.cli import main
from trainer.errors import ParameterError
from trainer.events import EventLog, FaultFired, Restart, RunStart, read_events, select
from trainer.faults import FAULT_KINDS
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_ENV, WORKSPACE_MOUNT
from trainer.launch.spec import resolve_run_name
from trainer.results.summary import VERDICT
from trainer.results.tracking import FAILED_STEP_TAG, FAILURE_REASON_TAG

ROOT = Path(__file__).resolve().parent.parent
MLFLOW = "http://mlflow.team-a:5000"
BODY = ["check-run", "prepare-data", "train", "validate-checkpoint", "export-model"]
EXIT = "log-to-mlflow"
EXPECTED_PARAMETERS = {
    "steps", "ckpt_every", "ckpt_mode", "local_ckpt_every", "local_replicas", "nnodes", "nproc_per_node", "max_restarts",
    "inprocess_restart", "fault",
    "model", "seed", "hang_timeout", "grace_period", "system_metrics_every", "backend", "training_run", "image", "job_namespace", "gpus",
    "cpu", "memory", "source", "pvc_name", "checkpoint_uri", "tracking_uri", "experiment",
    "tokenizer", "text_field", "seq_len", "grad_accum_steps", "activation_checkpointing", "export_uri", "registered_model",
}  # fmt: skip
HEADLINE = {
    "goodput (%)", "restarts in-process", "restarts in-job", "recovery p50 (s)", "recovery max (s)", "lost steps",
    "lost steps max per fault", "checkpoint stall p50 (s)", "checkpoint overhead (%)", "final loss", VERDICT,
}  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("ir") / "pipeline.yaml")
    return list(yaml.safe_load_all(path.read_text()))


def _spec(compiled: list[dict]) -> pipeline_spec_pb2.PipelineSpec:
    return json_format.ParseDict(compiled[0], pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)


def test_the_steps_hand_on_references_and_validation_gets_a_workers_resources(compiled: list[dict]) -> None:
    """The run stays on the shared volume: no step copies it into the artifact store. Validation
    loads the whole state and starts the run's world size of ranks: a worker's requests."""
    executors = compiled[0]["deploymentSpec"]["executors"]
    assert executors["exec-validate-checkpoint"]["container"]["resources"] == {
        "resourceCpuRequest": "{{$.inputs.parameters['pipelinechannel--cpu']}}",
        "resourceMemoryRequest": "{{$.inputs.parameters['pipelinechannel--memory']}}",
    }
    train_source = " ".join(executors["exec-train"]["container"]["command"])
    assert "run_descriptor(" in train_source and "copytree(cfg.run_dir" not in train_source


def test_compiled_ir_parses_strictly(compiled: list[dict]) -> None:
    assert len(compiled) == 2, "the IR and the kubernetes platform document"
    spec = _spec(compiled)
    assert spec.pipeline_info.name == PIPELINE_NAME and spec.schema_version == "2.1.0"
    # Every parameter has a default and a description the Kubeflow UI shows.
    inputs = spec.root.input_definitions.parameters
    assert set(inputs) == EXPECTED_PARAMETERS
    for name, param in inputs.items():
        assert param.description.strip(), f"parameter {name} has no description"
        assert param.HasField("default_value"), f"parameter {name} has no default"
    assert not [n for n in inputs if re.search("password|secret|token(?!izer)|access_key", n)], "credentials are never parameters"
    assert not {"run_name", "namespace"} & set(inputs), "names beside KFP's own 'Run name' and profile namespace confuse"
    # A person starting a run from the UI gets a PyTorchJob and a training run of its own.
    assert inputs["backend"].default_value.string_value == "kubernetes"
    assert inputs["training_run"].default_value.string_value == ""
    assert inputs["tracking_uri"].default_value.string_value == ""
    # The fault kinds come from the fault grammar itself, so a new kind is described at once.
    assert all(kind in inputs["fault"].description for kind in FAULT_KINDS)


def test_the_steps_run_inside_an_exit_handler_that_logs_every_run(compiled: list[dict]) -> None:
    spec = _spec(compiled)
    root = spec.root.dag.tasks
    (handler,) = (name for name in root if name != EXIT)
    body = spec.components[root[handler].component_ref.name].dag.tasks
    assert sorted(body) == sorted(BODY)
    for before, after in zip(BODY, BODY[1:], strict=False):
        assert before in body[after].dependent_tasks, f"{after} must run after {before}"
    exit_task = root[EXIT]
    strategy = pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.TriggerStrategy
    assert exit_task.trigger_policy.strategy == strategy.ALL_UPSTREAM_TASKS_COMPLETED
    assert exit_task.inputs.parameters["status"].task_final_status.producer_task == handler
    # The exit handler finds the run by name: the same parameter and KFP run placeholders as the check step.
    check = body["check-run"].inputs.parameters
    for task_inputs in (check, exit_task.inputs.parameters):
        assert task_inputs["training_run"].component_input_parameter.endswith("training_run")
        assert task_inputs["pipeline_job"].runtime_value.constant.string_value == dsl.PIPELINE_JOB_NAME_PLACEHOLDER
        assert task_inputs["pipeline_job_id"].runtime_value.constant.string_value == dsl.PIPELINE_JOB_ID_PLACEHOLDER
    for step in ("prepare-data", "train", "validate-checkpoint", "export-model"):  # the name the check step derived
        named = body[step].inputs.parameters["training_run"].task_output_parameter
        assert (named.producer_task, named.output_parameter_key) == ("check-run", "Output")


def test_the_headline_is_the_one_metrics_artifact(compiled: list[dict]) -> None:
    spec = _spec(compiled)
    metrics = [
        (component, name)
        for component, c in spec.components.items()
        for name, a in c.output_definitions.artifacts.items()
        if a.artifact_type.schema_title == "system.Metrics"
    ]
    assert metrics == [(spec.root.dag.tasks[EXIT].component_ref.name, "metrics")]
    exit_outputs = spec.components[spec.root.dag.tasks[EXIT].component_ref.name].output_definitions
    assert exit_outputs.artifacts["report"].artifact_type.schema_title == "system.Markdown"
    assert spec.root.output_definitions.artifacts["metrics"].artifact_type.schema_title == "system.Metrics"
    # Large dicts are never parameters: no step passes a struct to another.
    for c in spec.components.values():
        for p in list(c.input_definitions.parameters.values()) + list(c.output_definitions.parameters.values()):
            assert p.parameter_type != pipeline_spec_pb2.ParameterType.STRUCT


def test_kubernetes_platform_config_parses_strictly(compiled: list[dict]) -> None:
    platform = json_format.ParseDict(compiled[1], pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False)
    executors = json_format.MessageToDict(platform.platforms["kubernetes"].deployment_spec)["executors"]
    configs = {
        name: json_format.ParseDict(cfg, kubernetes_executor_config_pb2.KubernetesExecutorConfig(), ignore_unknown_fields=False)
        for name, cfg in executors.items()
    }
    assert set(configs) == {f"exec-{t}" for t in [*BODY, EXIT]}
    for name, cfg in configs.items():
        secrets = {s.secret_name_parameter.runtime_value.constant.string_value: s for s in cfg.secret_as_env}
        assert set(secrets) == set(CREDENTIAL_SECRETS), name
        assert all(s.optional for s in secrets.values())
        assert "MLFLOW_TRACKING_URI" in {k.env_var for s in secrets.values() for k in s.key_to_env}, name
        mounts = [(m.mount_path, m.pvc_name_parameter.component_input_parameter) for m in cfg.pvc_mount]
        # Every step finds the run by its name on the volume (inside the exit handler the parameter is a channel).
        assert [(path, param.removeprefix("pipelinechannel--")) for path, param in mounts] == [(WORKSPACE_MOUNT, "pvc_name")], name


def test_the_default_training_run_is_unique_per_kfp_run_and_an_explicit_one_is_kept() -> None:
    first = resolve_run_name("", "resilient-fsdp-training-x7k2p", "3f2a9c1e-0b7d-4e55-9a41-2c6d8e0f1a2b")
    again = resolve_run_name("", "resilient-fsdp-training-x7k2p", "3f2a9c1e-0b7d-4e55-9a41-2c6d8e0f1a2b")
    other = resolve_run_name("", "resilient-fsdp-training-q9w3z", "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f")
    assert first == again != other
    assert re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", first) and len(first) <= 53
    assert resolve_run_name("fsdp-1b-a", "any", "any") == "fsdp-1b-a"
    with pytest.raises(ParameterError, match="^training_run: 'Bad_Name' is not a DNS-1035 label"):
        resolve_run_name("Bad_Name", "any", "any")


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("model=huge", "model: unknown model 'huge'"),
        ("fault=boom@3", "fault: unknown kind 'boom'"),
        ("fault=sigkill@5:7", "fault: rank 7"),
        ("fault=exception@5:0,sigkill@5:1", "fault: exception@5:0 and sigkill@5:1 are both at step 5"),
        ("ckpt_every=0", "ckpt_every: must be positive"),
        ("nproc_per_node=0", "nproc_per_node: must be at least 1"),
        ("training_run=Bad_Name", "training_run: 'Bad_Name' is not a DNS-1035 label"),
        ("backend=slurm", "backend: 'slurm' is not one of local, kubernetes"),
        ("memory=lots", "memory: 'lots' is not a Kubernetes quantity"),
        ("job_namespace=Team_A", "job_namespace: 'Team_A' is not a valid namespace name"),
        ("grace_period=2", "grace_period: must be at least 5 s"),
        ("fault=node-loss@3:0", "fault: node-loss@3:0 are node-level faults"),
        ("checkpoint_uri=/data/ckpts", "checkpoint_uri: '/data/ckpts' is not s3://bucket/prefix"),
        ("tracking_uri=mlflow.example.com:5000", "tracking_uri: 'mlflow.example.com:5000' is not an MLflow tracking URI"),
        ("tracking_uri=http://", "tracking_uri: 'http://' names no host"),
        ("steps=abc", "--set steps: 'abc' is not a valid int"),
        ("stepz=10", "--set: unknown parameter 'stepz'"),
        ("model=hf:/no/such/model", "model: hf:/no/such/model: no model directory there"),
        ("model=py:no_such_package.module:build", "model: py:no_such_package.module:build: cannot import no_such_package.module"),
        ("text_field= ", "text_field: must not be empty"),
        ("export_uri=models/llama", "export_uri: 'models/llama' is not s3://bucket/prefix nor an absolute path"),
        ("registered_model=llama", "registered_model: 'llama' needs a model to register: set export_uri"),
        ("grad_accum_steps=0", "grad_accum_steps: must be positive"),
        ("seq_len=-1", "seq_len: must be at least 0"),
    ],
)
def test_bad_parameters_fail_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture, setting: str, named: str) -> None:
    root = tmp_path / "root"
    assert main(["pipeline", "run-local", "--root", str(root), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not root.exists(), "nothing may be started or written"


def test_a_manifest_for_an_hf_model_in_a_bucket_is_a_2x8_gpu_job(capsys: pytest.CaptureFixture) -> None:
    """The model in a bucket is not fetched to show the job (the check step checks it, where the
    cluster's credentials are); its description says so."""
    from pipelines.resilient_fsdp import parameters

    settings = ["model=hf:s3://bucket/m", "gpus=true", "nnodes=2", "nproc_per_node=8"]
    settings += ["grad_accum_steps=4", "activation_checkpointing=true"]
    assert main(["pipeline", "manifest", *sum((["--set", s] for s in settings), [])]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and job["spec"]["nprocPerNode"] == "8"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    command = container["command"]
    assert command[command.index("--model") + 1] == "hf:s3://bucket/m" and command[command.index("--world-size") + 1] == "16"
    assert command[command.index("--grad-accum-steps") + 1] == "4" and "--activation-checkpointing" in command
    described = {p.name: p.description for p in parameters()}
    assert "hf:PATH" in described["model"] and "py:package.module:factory" in described["model"] and "s3://" in described["model"]
    assert "export_uri" in described["registered_model"] and "MLflow" in described["export_uri"]


def test_a_kubernetes_run_local_without_root_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """backend=kubernetes runs on the emulated cluster, which needs root: another user is refused
    in one line naming the parameter (as root, the command runs as nobody)."""
    root = tmp_path / "root"
    command = [sys.executable, "-m", "trainer.cli", "pipeline", "run-local", "--root", str(root), "--set", "backend=kubernetes"]
    command += ["--set", f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    proc = subprocess.run(as_unprivileged(command), cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("rfsdp pipeline: error: backend: run-local runs kubernetes on the emulated cluster, which needs root")
    assert not root.exists() and not (tmp_path / "mlflow.db").exists(), "nothing may be started or written"


def test_compile_into_a_missing_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "missing" / "pipeline.yaml"
    assert main(["pipeline", "compile", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out: folder {out.parent} does not exist" in err and "Traceback" not in err
    assert not out.parent.exists()


def test_train_step_rejects_bad_parameters_before_any_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started from the Kubeflow UI bypasses the CLI: the step itself checks first, and
    records its refusal for the exit handler."""
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    params = {k: v for k, v in parameter_defaults().items() if k in train.component_spec.inputs}
    params.update(training_run="ui-run", pipeline_job="resilient-fsdp-training-x7k2p", pipeline_job_id="kfp-1")
    run = Artifact(uri=str(tmp_path / "run"))
    data = Dataset(uri=str(tmp_path / "data"))
    with pytest.raises(ValueError, match="fault: step 99 in 'exception@99' is outside the run"):
        train.python_func(data=data, run=run, **{**params, "fault": "exception@99"})
    with pytest.raises(ValueError, match="backend: 'slurm'"):
        train.python_func(data=data, run=run, **{**params, "backend": "slurm"})
    assert not (tmp_path / "run").exists()
    record = json.loads((tmp_path / "workspace" / "ui-run" / FAILURE_FILE).read_text())
    assert record == {"kfp_run": "kfp-1", "step": TRAIN_STEP, "reason": "ParameterError: backend: 'slurm' is not one of local, kubernetes"}
    assert [p.name for p in (tmp_path / "workspace" / "ui-run").iterdir()] == [FAILURE_FILE], "no process, no run dir"


# --------------------------------------------------------------------- recording KFP server
class RecordingKfpServer:
    """Answers the KFP v2beta1 REST calls that ``kfp.Client`` makes for upload + run, records them."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.pipelines: list[dict] = []
        self.experiments: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> dict:
                url = urlparse(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                entry = {
                    "method": self.command,
                    "path": url.path,
                    "query": parse_qs(url.query),
                    "body": raw,
                    "type": self.headers["Content-Type"],
                }
                outer.requests.append(entry)
                return entry

            def do_GET(self) -> None:  # noqa: N802
                req = self._record()
                if req["path"] == "/apis/v2beta1/healthz":
                    self._reply({"multi_user": False})
                elif req["path"] == "/apis/v2beta1/pipelines":
                    self._reply({"pipelines": outer.pipelines, "total_size": len(outer.pipelines)} if outer.pipelines else {})
                elif req["path"] == "/apis/v2beta1/pipelines/p-1/versions":
                    self._reply({"pipeline_versions": [{"pipeline_id": "p-1", "pipeline_version_id": "v-1"}], "total_size": 1})
                elif req["path"] == "/apis/v2beta1/experiments":
                    self._reply({"experiments": outer.experiments, "total_size": len(outer.experiments)} if outer.experiments else {})
                else:
                    self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                req = self._record()
                if req["path"] == "/apis/v2beta1/pipelines/upload":
                    outer.pipelines.append({"pipeline_id": "p-1", "display_name": req["query"]["name"][0]})
                    self._reply(outer.pipelines[0])
                elif req["path"] == "/apis/v2beta1/pipelines/upload_version":
                    self._reply(
                        {
                            "pipeline_id": req["query"]["pipelineid"][0],
                            "pipeline_version_id": "v-2",
                            "display_name": req["query"]["name"][0],
                        }
                    )
                elif req["path"] == "/apis/v2beta1/experiments":
                    outer.experiments.append({**json.loads(req["body"]), "experiment_id": "e-1"})
                    self._reply(outer.experiments[0])
                elif req["path"] == "/apis/v2beta1/runs":
                    self._reply({**json.loads(req["body"]), "run_id": f"r-{len(outer.requests)}", "state": "PENDING"})
                else:
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def calls(self, since: int = 0) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests[since:]]

    def uploaded_ir(self, request: dict) -> dict:
        message = email.parser.BytesParser().parsebytes(b"Content-Type: " + request["type"].encode() + b"\r\n\r\n" + request["body"])
        part = next(p for p in message.walk() if p.get_filename())
        return next(yaml.safe_load_all(part.get_payload(decode=True)))


@pytest.mark.contract
def test_submit_uploads_then_versions_and_starts_runs(tmp_path: Path) -> None:
    server = RecordingKfpServer()
    try:
        overrides = {
            "training_run": "exp-7",
            "nnodes": 2,
            "nproc_per_node": 4,
            "gpus": True,
            "fault": "sigkill@30:5",
            "tracking_uri": MLFLOW,
        }
        ids = submit(server.url, overrides, kfp_experiment="fsdp-runs", service_account="rfsdp-pipeline", package=tmp_path / "p.yaml")
        assert server.calls() == [
            ("GET", "/apis/v2beta1/healthz"),  # ours: is it KFP at all?
            ("GET", "/apis/v2beta1/healthz"),
            ("GET", "/apis/v2beta1/pipelines"),
            ("POST", "/apis/v2beta1/pipelines/upload"),
            ("GET", "/apis/v2beta1/pipelines/p-1/versions"),
            ("GET", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/runs"),
        ]
        upload = server.requests[3]
        assert upload["query"]["name"] == [PIPELINE_NAME]
        assert server.uploaded_ir(upload) == next(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))
        assert server.requests[4]["query"]["sort_by"] == ["created_at desc"]
        assert json.loads(server.requests[6]["body"])["display_name"] == "fsdp-runs"
        run = json.loads(server.requests[7]["body"])
        assert run["experiment_id"] == "e-1" and run["service_account"] == "rfsdp-pipeline"
        assert run["pipeline_version_reference"] == {"pipeline_id": "p-1", "pipeline_version_id": "v-1"}
        assert run["runtime_config"]["parameters"] == overrides
        assert run["display_name"].startswith("exp-7-")
        assert ids == {"pipeline_id": "p-1", "version_id": "v-1", "experiment_id": "e-1", "run_id": "r-8"}

        # Second submit: the pipeline exists, so a new version is uploaded and run; the experiment is reused.
        seen = len(server.requests)
        ids = submit(server.url, {"steps": 120, "tracking_uri": MLFLOW}, kfp_experiment="fsdp-runs")
        assert server.calls(seen) == [
            ("GET", "/apis/v2beta1/healthz"),
            ("GET", "/apis/v2beta1/healthz"),
            ("GET", "/apis/v2beta1/pipelines"),
            ("POST", "/apis/v2beta1/pipelines/upload_version"),
            ("GET", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/runs"),
        ]
        run = json.loads(server.requests[-1]["body"])
        assert run["pipeline_version_reference"] == {"pipeline_id": "p-1", "pipeline_version_id": "v-2"}
        assert run["runtime_config"]["parameters"] == {"steps": 120, "tracking_uri": MLFLOW}
        assert run["display_name"].startswith("rfsdp-")  # the training run's own name is derived inside the run
        assert ids["version_id"] == "v-2"
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def test_submit_refuses_bad_parameters_before_contacting_the_server() -> None:
    server = RecordingKfpServer()
    try:
        with pytest.raises(ParameterError, match="^nnodes: must be at least 1"):  # named as the pipeline parameter
            submit(server.url, {"nnodes": 0, "tracking_uri": MLFLOW})
        # A cluster run must say where MLflow is: the submitter cannot see the cluster's secret.
        with pytest.raises(ParameterError, match="^tracking_uri: a kubernetes run needs an MLflow tracking server"):
            submit(server.url, {"training_run": "exp-8"})
        with pytest.raises(ParameterError, match="^tracking_uri: 'sqlite:///tmp/m.db' is a file in the logging step's pod"):
            submit(server.url, {"tracking_uri": "sqlite:///tmp/m.db"})
        assert server.requests == []
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


class NotKfp(BaseHTTPRequestHandler):
    """Some other web server: a page for every path."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        body = b"<html>dashboard</html>"
        self.send_response(200 if self.path == "/" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.contract
@pytest.mark.parametrize("kind", ["unreachable", "not-kfp"])
def test_submit_to_a_host_that_is_not_kfp_is_one_line(tmp_path: Path, kind: str) -> None:
    if kind == "unreachable":
        host, expected = "http://127.0.0.1:9", "--host: cannot reach http://127.0.0.1:9"  # port 9 (discard): nothing listens
    else:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotKfp)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        host = f"http://127.0.0.1:{httpd.server_address[1]}"
        expected = f"--host: {host} is not a Kubeflow Pipelines API: GET {host}/apis/v2beta1/healthz answered HTTP 404"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "pipeline", "submit", "--host", host, "--set", f"tracking_uri={MLFLOW}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rfsdp pipeline: error: {expected}")
    assert list(tmp_path.iterdir()) == [], "nothing is compiled or written"


# --------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_step_two_replicas_one_rendezvous(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The train component's local backend on 2 replicas x 1 process: two ft_launchers meet in one
    c10d rendezvous through the PET_* contract, and an exception on rank 1 is recovered in-process.
    The run dir lives on the (local stand-in for the) shared volume under the run's name.
    """
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    params = {k: v for k, v in parameter_defaults().items() if k in train.component_spec.inputs}
    params.update(steps=10, ckpt_every=5, nnodes=2, nproc_per_node=1, fault="exception@4:1", backend="local")
    params.update(training_run="two-replicas", pipeline_job="resilient-fsdp-training-x7k2p", pipeline_job_id="kfp-1")
    params.update(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # MLflow follows the step's job
    run = Artifact(uri=str(tmp_path / "run"))
    train.python_func(data=Dataset(uri=str(data_dir)), run=run, **params)
    run_dir = tmp_path / "workspace" / "two-replicas" / "run"
    joined = [
        re.findall(
            r"joined round \d+ of the rendezvous '\S+' as rank (\d) in a world of size 2",
            (run_dir / "logs" / f"replica_{i}.log").read_text(),
        )
        for i in (0, 1)
    ]
    assert sorted(j[0] for j in joined) == ["0", "1"], joined
    assert [r.layer for r in select(read_events(run_dir), Restart)] == ["in_process"]
    # The artifact is a reference to the run on the shared volume, not a copy of it.
    described = json.loads((tmp_path / "run").read_text())
    assert described["run"] == "two-replicas/run" and described["latest_checkpoint"] == "step_000010"
    assert described["manifest"] == json.loads((run_dir / "checkpoints" / "step_000010" / "manifest.json").read_text())
    assert (tmp_path / "run").stat().st_size < 20_000  # whatever the model's size
    assert run.metadata["world_size"] == 2 and run.metadata["latest_checkpoint"] == "step_000010"
    assert run.metadata["run_dir"] == str(run_dir)


@pytest.mark.slow
def test_a_preempted_local_job_fails_the_train_step_and_is_logged_failed(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole job preempted (SIGTERM to its one replica's container): every rank checkpoints
    and exits 0, yet the train step fails with how to resume the run, the exit handler logs it
    FAILED with that reason, and the same training_run resumes it to the end."""
    import mlflow

    from components.runs import log_pipeline_run

    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {k: v for k, v in parameter_defaults().items() if k in train.component_spec.inputs}
    params.update(steps=12, ckpt_every=4, nnodes=1, nproc_per_node=2, fault="sigterm@6:0", backend="local", tracking_uri=uri)
    params.update(training_run="preempted", pipeline_job="resilient-fsdp-training-p1", pipeline_job_id="kfp-p1")
    message = "preempted at step 6; start a run with training_run=preempted to resume"
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        train.python_func(data=Dataset(uri=str(data_dir)), run=Artifact(uri=str(tmp_path / "run")), **params)
    assert not (tmp_path / "run").exists(), "nothing handed on to validation"
    logged = log_pipeline_run(
        state="FAILED",
        error_message="Task exit-handler-1 failed.",
        **{k: params[k] for k in ("training_run", "backend", "tracking_uri", "experiment", "pipeline_job", "pipeline_job_id", "image")},
    )
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logged.mlflow_run_id)
    assert run.info.status == "FAILED" and run.data.tags[FAILED_STEP_TAG] == TRAIN_STEP
    assert run.data.tags[FAILURE_REASON_TAG] == f"RuntimeError: {message}"
    assert message in logged.markdown

    params.update(pipeline_job="resilient-fsdp-training-p2", pipeline_job_id="kfp-p2")  # the fault fired once
    train.python_func(data=Dataset(uri=str(data_dir)), run=Artifact(uri=str(tmp_path / "run")), **params)
    run_dir = tmp_path / "workspace" / "preempted" / "run"
    assert [s.resumed_from_step for s in select(read_events(run_dir), RunStart)] == [0, 6]


def _run_local(root: Path, *settings: str) -> subprocess.CompletedProcess:
    """`rfsdp pipeline run-local` in a subprocess (its own kfp.local and environment)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "pipeline", "run-local", "--root", str(root), *sum((["--set", s] for s in settings), [])],
        cwd=root.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _exit_output(root: Path, name: str) -> Path:
    """An output file of the exit handler task of the one pipeline run under ``root``."""
    (found,) = (root / "pipeline_root").glob(f"*/{EXIT}/{name}")
    return found


@pytest.mark.slow
def test_run_local_whole_pipeline_with_a_fault(tmp_path: Path) -> None:
    """`rfsdp pipeline run-local` through kfp.local: an exception on rank 1 recovered in-process, a
    checkpoint the validation step finds valid, an MLflow run that counts the restart, and the
    headline figures and report the Kubeflow UI would show.

    Runs on 2 replicas x 1 process (multi-node rendezvous); the validator replays on 1 x 2, which
    must give the same bits (one intra-op thread per rank, whatever the topology).
    """
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "root"
    settings = ["steps=12", "ckpt_every=4", "nnodes=2", "nproc_per_node=1", "fault=exception@6:1", f"tracking_uri={uri}", "experiment=e2e"]
    settings.append("system_metrics_every=1")
    proc = _run_local(root, *settings)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_id = re.search(r"MLflow run id:\s*([0-9a-f]{32})", proc.stdout)[1]
    (run_dir,) = (root / "workspace").glob("rfsdp-*/run")
    assert [e.layer for e in select(read_events(run_dir), Restart)] == ["in_process"]
    assert (run_dir / "checkpoints" / "step_000012" / "manifest.json").is_file()

    executor_output = json.loads(_exit_output(root, "executor_output.json").read_text())
    metrics = executor_output["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert set(metrics) == HEADLINE
    assert metrics["restarts in-process"] == 1 and metrics["restarts in-job"] == 0 and metrics[VERDICT] == 1
    assert 0 < metrics["goodput (%)"] < 100 and metrics["goodput (%)"] == round(metrics["goodput (%)"], 1)
    report = _exit_output(root, "report").read_text()
    url = executor_output["parameterValues"]["mlflow_url"]
    assert url.endswith(f"/runs/{run_id}") and f"]({url})" in report
    assert "**valid**" in report and "| replays | pass |" in report and "| goodput (%) |" in report
    steps_log = (root / "steps.log").read_text()
    assert max(len(line) for line in (proc.stdout + proc.stderr + steps_log).splitlines()) < 1000, "nothing is printed whole"
    # Quiet: the steps' executor logs go to steps.log; the terminal shows each step, the fault and
    # its recovery as they happen, the tables and what to do next.
    assert "executor_input" in steps_log and "executor_input" not in proc.stdout + proc.stderr
    for step in ("check-run", "prepare-data", "train", "validate-checkpoint", "log-to-mlflow"):
        assert f"{step}: started" in proc.stdout and f"{step}: success in" in proc.stdout
    assert "fault exception at step 6 on rank 1" in proc.stdout and "restart 1 (in_process): resumed from step" in proc.stdout
    assert f"steps' output:     {root.resolve() / 'steps.log'}" in proc.stdout and "next:" in proc.stdout
    # (the export step: two lines, even with nothing to export; the fault's failure rows: one per rank that met it)
    assert len((proc.stdout + proc.stderr).splitlines()) <= 66
    # One definition of each figure: the run's table and the headline agree.
    assert float(re.search(r"stall p50 ([0-9.]+) s", proc.stdout)[1]) == metrics["checkpoint stall p50 (s)"]

    client = mlflow.MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id)
    assert logged.info.status == "FINISHED" and FAILED_STEP_TAG not in logged.data.tags
    assert logged.data.metrics["restarts_in_process"] == 1
    assert logged.data.metrics["final_step"] == 12
    assert logged.data.tags["backend"] == "local" and logged.data.tags["training_run"] == run_dir.parent.name
    assert logged.info.run_name == f"{run_dir.parent.name} @ {logged.data.tags['kfp_pipeline_job']}"  # the run + the KFP run
    assert {"system/node_0/cpu_utilization_percentage", "system/node_1/cpu_utilization_percentage"} <= set(logged.data.metrics)
    assert logged.data.tags["rfsdp.valid"] == "true"
    assert client.get_experiment(logged.info.experiment_id).name == "e2e"


@pytest.mark.slow
def test_a_failed_run_is_logged_failed_and_the_same_name_resumes_it(tmp_path: Path) -> None:
    """Restarts exhausted (a SIGKILL with max_restarts=0): the pipeline fails and the exit handler
    leaves a FAILED MLflow run naming the step and the reason, with the events so far. The same
    explicit training_run again resumes that run (the fault fired once) into the same MLflow run.
    """
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "root"
    # Sync checkpoints: step 3's is durable before the SIGKILL at step 5 (an async first save may not be).
    settings = ["steps=8", "ckpt_every=3", "ckpt_mode=sync", "max_restarts=0", "fault=sigkill@5:0", "training_run=resume-me"]
    settings.append(f"tracking_uri={uri}")
    failed = _run_local(root, *settings)
    assert failed.returncode == 1, failed.stdout[-4000:] + failed.stderr[-4000:]
    assert "Inner task failed" in failed.stderr and "'train'" in failed.stderr
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resilient-fsdp").experiment_id])
    assert run.info.status == "FAILED" and run.info.run_name == f"resume-me @ {run.data.tags['kfp_pipeline_job']}"
    assert run.data.tags[FAILED_STEP_TAG] == TRAIN_STEP
    assert "the local job exited with code" in run.data.tags[FAILURE_REASON_TAG]
    assert run.data.metrics["faults"] == 1 and run.data.metrics["final_step"] < 8  # the events it reached are logged

    resumed = _run_local(root, *settings)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    events = read_events(root / "workspace" / "resume-me" / "run")
    assert [s.resumed_from_step for s in select(events, RunStart)] == [0, 3]
    (again,) = client.search_runs([run.info.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert FAILED_STEP_TAG not in again.data.tags and again.data.metrics["final_step"] == 8


@pytest.mark.slow
def test_mlflow_follows_the_train_step_under_the_name_the_exit_handler_logs(
    data_dir: Path, mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the train step's job trains, its MLflow run (RUNNING, named after the training run and
    the KFP run, with the KFP tags) shows the loss curve; the exit handler completes that run."""
    import mlflow

    from components.runs import live_tracking, log_pipeline_run, run_root

    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    kfp = {"backend": "local", "pipeline_job": "resilient-fsdp-training-x7k2p", "pipeline_job_id": "kfp-1", "image": "rfsdp:test"}
    run_dir, client = run_root("live-step") / "run", mlflow.MlflowClient(mlflow_server.uri)
    cmd = [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", str(data_dir), "--run-dir", str(run_dir), "--steps", "2000"]
    with live_tracking(run_dir, tracking_uri=mlflow_server.uri, experiment="step", training_run="live-step", **kfp):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline, seen = time.monotonic() + 300, None
        while seen is None:  # the job goes on until the test stops it: no race with its end
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            experiment = client.get_experiment_by_name("step")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            seen = runs[0] if runs and client.get_metric_history(runs[0].info.run_id, "loss") else None
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # preempted: checkpointed, exit 0
        assert proc.wait(timeout=240) == 0, proc.communicate()
    assert seen.info.status == "RUNNING" and seen.info.run_name == "live-step @ resilient-fsdp-training-x7k2p"
    assert seen.data.tags["kfp_run_id"] == "kfp-1" and seen.data.tags["image"] == "rfsdp:test"
    logged = log_pipeline_run(
        state="SUCCEEDED", error_message="", training_run="live-step", tracking_uri=mlflow_server.uri, experiment="step", **kfp
    )
    assert logged.mlflow_run_id == seen.info.run_id and client.get_run(seen.info.run_id).info.status == "FINISHED"
    assert len(client.search_runs([seen.info.experiment_id])) == 1


@pytest.mark.slow
def test_two_runs_with_the_defaults_do_not_touch_each_other(tmp_path: Path) -> None:
    """run_local passes the local overrides itself; each run gets a name of its own, so its run
    dir, its checkpoints and its MLflow run are its own."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # 8 steps: enough for the validation's quality check (eval loss 0.5 below initialization).
    results = [run_local({"steps": 8, "ckpt_every": 4, "nproc_per_node": 1, "tracking_uri": uri}, tmp_path / "root") for _ in range(2)]
    first, second = results
    assert first["training_run"] != second["training_run"]
    assert first["mlflow_run_id"] != second["mlflow_run_id"]
    client = mlflow.MlflowClient(tracking_uri=uri)
    for result in results:
        starts = select(read_events(Path(result["run_dir"])), RunStart)
        assert [s.resumed_from_step for s in starts] == [0], "a fresh run, never a resume of the other"
        assert Path(result["run_dir"]).parent.name == result["training_run"]
        assert client.get_run(result["mlflow_run_id"]).data.tags["training_run"] == result["training_run"]
    assert sorted(p.name for p in (tmp_path / "root" / "workspace").iterdir()) == sorted(r["training_run"] for r in results)


def test_a_ui_run_without_a_tracking_uri_is_refused_by_the_first_step_and_logged_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started from the UI with the defaults: the check step refuses a kubernetes run that has
    no tracking URI (nothing started); with the MLflow secret's key it passes and names the run.
    A refusal of another parameter is logged by the exit handler as a FAILED run of its own."""
    import mlflow

    from components.check_run import check_run
    from components.runs import CHECK_STEP, log_pipeline_run

    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = {**parameter_defaults(), "pipeline_job": "resilient-fsdp-training-x7k2p", "pipeline_job_id": "kfp-1"}
    with pytest.raises(ParameterError, match="^tracking_uri: a kubernetes run needs an MLflow tracking server"):
        check_run.python_func(**params)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team-a:5000")  # the rfsdp-mlflow secret's key
    name = check_run.python_func(**params)
    assert name == resolve_run_name("", params["pipeline_job"], "kfp-1")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ParameterError, match="^fault: exception@5:0 and sigkill@5:1 are both at step 5"):
        check_run.python_func(**{**params, "fault": "exception@5:0,sigkill@5:1", "tracking_uri": uri})
    logged = log_pipeline_run(
        state="FAILED",
        error_message="Task exit-handler-1 failed.",
        training_run="",
        backend="kubernetes",
        tracking_uri=uri,
        experiment="ui",
        pipeline_job=params["pipeline_job"],
        pipeline_job_id="kfp-1",
        image="registry.example/resilient-fsdp:0.1.0",
    )
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logged.mlflow_run_id)
    assert run.info.status == "FAILED" and run.data.tags[FAILED_STEP_TAG] == CHECK_STEP
    # What ran: the KFP run, the image, the code's version and commit (this checkout's HEAD).
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    assert run.data.tags["kfp_run_id"] == "kfp-1" and run.data.tags["image"] == "registry.example/resilient-fsdp:0.1.0"
    assert run.data.tags.get("mlflow.source.git.commit") == (head or None) and run.data.tags["rfsdp.version"] == "0.1.0"
    assert (
        run.data.tags[FAILURE_REASON_TAG] == "ParameterError: fault: exception@5:0 and sigkill@5:1 are both at step 5: one fault per step"
    )
    assert logged.headline == {} and CHECK_STEP in logged.markdown and f"]({logged.mlflow_url})" in logged.markdown
    assert not (tmp_path / "workspace" / name / "run").exists(), "nothing was started"


def test_the_exit_handler_never_follows_a_refused_name_into_another_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``training_run=./victim`` is refused by the check step; the exit handler then logs a FAILED
    run of its own that names the refusal, and the run ``victim`` (its folder, its MLflow run) is
    left exactly as it was."""
    import mlflow

    from components.check_run import check_run
    from components.runs import CHECK_STEP, log_pipeline_run
    from trainer.events import RunEnd, Step
    from trainer.results.tracking import log_run

    workspace, uri = tmp_path / "workspace", f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv(WORKSPACE_ENV, str(workspace))
    victim_dir = workspace / "victim" / "run"
    victim_dir.mkdir(parents=True)
    events = EventLog(victim_dir, 0)
    events.emit(RunStart(config={"steps": 2}, resumed_from_step=0, world_size=1))
    events.emit(Step(step=2, loss=2.0, step_time_s=0.1, tokens=100))
    events.emit(RunEnd(status="completed", step=2))
    client = mlflow.MlflowClient(tracking_uri=uri)
    victim_id = log_run(victim_dir, tracking_uri=uri, experiment="ui", tags={"training_run": "victim"}, run_name="victim")
    before = client.get_run(victim_id)
    files = {p: p.read_bytes() for p in workspace.rglob("*") if p.is_file()}

    params = {**parameter_defaults(), "training_run": "./victim", "tracking_uri": uri, "experiment": "ui"}
    params.update(pipeline_job="resilient-fsdp-training-x7k2p", pipeline_job_id="kfp-9")
    with pytest.raises(ParameterError, match="^training_run: './victim' is not a DNS-1035 label"):
        check_run.python_func(**params)
    logged = log_pipeline_run(
        state="FAILED",
        error_message="Task exit-handler-1 failed.",
        training_run="./victim",
        backend="kubernetes",
        tracking_uri=uri,
        experiment="ui",
        pipeline_job=params["pipeline_job"],
        pipeline_job_id="kfp-9",
        image="rfsdp:test",
    )
    assert logged.mlflow_run_id != victim_id
    after = client.get_run(victim_id)
    assert (after.info.status, after.data.tags, after.data.metrics) == (before.info.status, before.data.tags, before.data.metrics)
    assert after.info.status == "FINISHED" and FAILED_STEP_TAG not in after.data.tags
    assert {p: p.read_bytes() for p in workspace.rglob("*") if p.is_file()} == files, "the victim's folder is untouched"
    own = client.get_run(logged.mlflow_run_id)
    assert own.info.status == "FAILED" and own.data.tags[FAILED_STEP_TAG] == CHECK_STEP
    assert own.data.tags[FAILURE_REASON_TAG].startswith("ParameterError: training_run: './victim' is not a DNS-1035 label")
    assert logged.headline == {}


def test_a_quiet_local_run_shows_steps_faults_and_recoveries_and_logs_the_rest(tmp_path: Path) -> None:
    """`steps_to_log` in a process of its own (it takes over the descriptors): what is written to
    stdout and stderr, by it and its children, lands in the log; the terminal gets one line per
    kfp.local step line and per fault and recovery of the run whose events appear, and the bar.
    An earlier session's events of a resumed run are not shown again.
    """
    workspace, log = tmp_path / "workspace", tmp_path / "steps.log"
    resumed = workspace / "old" / "run"
    resumed.mkdir(parents=True)
    EventLog(resumed, 1).emit(FaultFired(kind="sigkill", step=3))
    script = f"""
import subprocess, sys, time
from pathlib import Path
from pipelines.local_view import steps_to_log
from trainer.events import EventLog, FaultFired, Restart, Step

with steps_to_log(Path({str(log)!r}), Path({str(workspace)!r}), last_step=8):
    print("12:00:00.000 - INFO - Executing task \\x1b[96m'train'\\x1b[0m", flush=True)
    subprocess.run([sys.executable, "-c", "import sys; print('executor_input of a step'); print('a warning', file=sys.stderr)"])
    run = Path({str(workspace)!r}) / "new" / "run"
    run.mkdir(parents=True)
    events = EventLog(run, 0)
    events.emit(Step(step=1, loss=2.5, step_time_s=0.1, tokens=100))
    EventLog(run, 1).emit(FaultFired(kind="exception", step=2))
    time.sleep(0.5)
    events.emit(Restart(layer="in_process", attempt=1, resumed_from_step=0, lost_steps=1, recovery_s=1.25))
    events.emit(Step(step=8, loss=2.0, step_time_s=0.1, tokens=100))
    print("12:00:09.000 - INFO - Task \\x1b[96m'train'\\x1b[0m finished with status \\x1b[92mSUCCESS\\x1b[0m", flush=True)
print("after")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    shown = proc.stdout.splitlines()
    assert shown[0] == "train: started" and shown[-1] == "after"
    assert "fault exception at step 2 on rank 1" in shown
    assert "restart 1 (in_process): resumed from step 0, 1 steps redone, back 1.2 s after the fault" in shown
    assert any(line.startswith("train: success in ") for line in shown)
    assert any("step 8/8  loss 2.0000" in line and "restarts 1" in line for line in shown)  # the bar's last state
    assert "sigkill" not in proc.stdout and "executor_input" not in proc.stdout + proc.stderr
    logged = log.read_text()
    assert "executor_input of a step" in logged and "a warning" in logged and "Executing task" in logged


@pytest.mark.slow
def test_a_pipeline_run_of_an_hf_model_exports_logs_and_registers_it(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """model=hf:DIR with export_uri and registered_model: after validation passes, the validated
    checkpoint is exported as a Hugging Face model directory, logged as the MLflow run's model
    (under model/) and registered as version 1."""
    import mlflow
    from transformers import AutoModelForCausalLM

    from tests.test_models import save_model
    from trainer.checkpoint import read_full_state

    model = save_model(tmp_path / "llama", "llama", weights=True)
    out, root = tmp_path / "exported", tmp_path / "root"
    settings = ["steps=12", "ckpt_every=4", "seq_len=32", "nproc_per_node=1", f"model=hf:{model}", f"tracking_uri={mlflow_server.uri}"]
    settings += ["experiment=export", f"export_uri={out}", "registered_model=tiny-llama"]
    proc = _run_local(root, *settings)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "export-model: success in" in proc.stdout
    run_id = re.search(r"MLflow run id:\s*([0-9a-f]{32})", proc.stdout)[1]
    (run_dir,) = (root / "workspace").glob("rfsdp-*/run")

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    checkpoint = read_full_state(run_dir / "checkpoints" / "step_000012")["model"]  # the validated one
    reloaded = loaded.state_dict()
    assert all(torch.equal(reloaded[name], tensor) for name, tensor in checkpoint.items())

    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    assert client.get_run(run_id).data.tags["rfsdp.valid"] == "true"
    logged = {f.path for f in client.list_artifacts(run_id, "model")}
    assert {"model/config.json", "model/model.safetensors.index.json", "model/model-00001-of-00001.safetensors"} <= logged
    (version,) = client.search_model_versions("name = 'tiny-llama'")
    assert version.version == "1" and version.run_id == run_id and version.source == f"runs:/{run_id}/model"
    assert version.tags["rfsdp.step"] == "12"
