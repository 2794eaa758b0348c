"""The Kubeflow pipeline: compiled IR (strict protobuf parse: cluster defaults, a run-unique name,
the exit handler, the headline Metrics), parameters checked before anything starts, and the
upload/submit path against a recording KFP server on loopback (a contract test: no real KFP server
can run here) and its refusals. The steps with real jobs, MLflow and the CLI:
tests/integration/test_pipeline_runs.py; whole ``kfp.local`` runs: tests/e2e/test_pipeline_e2e.py.
"""

from __future__ import annotations

import email.parser
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from google.protobuf import json_format
from kfp import dsl
from kfp.dsl import Artifact, Dataset
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from components.check_run import check_run
from components.runs import FAILURE_FILE, TRAIN_STEP, read_run_spec, write_run_spec
from components.train import train
from pipelines.resilient_fsdp import PIPELINE_NAME, parameter_defaults
from pipelines.run import compile_pipeline, submit
from trainer.cli import main
from trainer.errors import ParameterError
from trainer.faults import FAULT_KINDS
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_ENV, WORKSPACE_MOUNT
from trainer.launch.spec import resolve_run_name

MLFLOW = "http://mlflow.team-a:5000"
BODY = ["check-run", "prepare-data", "train", "validate-checkpoint", "export-model"]
EXIT = "log-to-mlflow"
EXPECTED_PARAMETERS = {
    "steps",
    "ckpt_every",
    "ckpt_mode",
    "local_ckpt_every",
    "local_replicas",
    "nnodes",
    "nproc_per_node",
    "max_restarts",
    "inprocess_restart",
    "max_bug_retries",
    "fault",
    "model",
    "seed",
    "hang_timeout",
    "grace_period",
    "system_metrics_every",
    "backend",
    "training_run",
    "image",
    "job_namespace",
    "gpus",
    "cpu",
    "memory",
    "source",
    "pvc_name",
    "checkpoint_uri",
    "tracking_uri",
    "experiment",
    "tokenizer",
    "text_field",
    "seq_len",
    "grad_accum_steps",
    "activation_checkpointing",
    "export_uri",
    "registered_model",
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("ir") / "pipeline.yaml")
    return list(yaml.safe_load_all(path.read_text()))


def _run_spec(path: Path, params: dict, name: str) -> Artifact:
    """The run spec the check step would hand the train step, at ``path``."""
    write_run_spec(path, params, name)
    return Artifact(uri=str(path))


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
    assert not [n for n in inputs if re.search("password|secret|token(?!izer)|access_key", n)], (
        "credentials are never parameters"
    )
    assert not {"run_name", "namespace"} & set(inputs), (
        "names beside KFP's own 'Run name' and profile namespace confuse"
    )
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
    for step in ("prepare-data", "validate-checkpoint", "export-model"):  # the name the check step derived
        named = body[step].inputs.parameters["training_run"].task_output_parameter
        assert (named.producer_task, named.output_parameter_key) == ("check-run", "Output")
    # The check step takes every parameter once; the train step takes them from its run spec (issue 36).
    assert set(spec.root.input_definitions.parameters) <= set(check)
    assert not {"steps", "model", "backend", "training_run"} & set(body["train"].inputs.parameters)
    handed = body["train"].inputs.artifacts["run_spec"].task_output_artifact
    assert (handed.producer_task, handed.output_artifact_key) == ("check-run", "run_spec")


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
        name: json_format.ParseDict(
            cfg, kubernetes_executor_config_pb2.KubernetesExecutorConfig(), ignore_unknown_fields=False
        )
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
        assert [(path, param.removeprefix("pipelinechannel--")) for path, param in mounts] == [
            (WORKSPACE_MOUNT, "pvc_name")
        ], name


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
        (
            "tracking_uri=mlflow.example.com:5000",
            "tracking_uri: 'mlflow.example.com:5000' is not an MLflow tracking URI",
        ),
        ("tracking_uri=http://", "tracking_uri: 'http://' names no host"),
        ("steps=abc", "--set steps: 'abc' is not a valid int"),
        ("stepz=10", "--set: unknown parameter 'stepz'"),
        ("model=hf:/no/such/model", "model: hf:/no/such/model: no model directory there"),
        (
            "model=py:no_such_package.module:build",
            "model: py:no_such_package.module:build: cannot import no_such_package.module",
        ),
        ("text_field= ", "text_field: must not be empty"),
        ("export_uri=models/llama", "export_uri: 'models/llama' is not s3://bucket/prefix nor an absolute path"),
        ("registered_model=llama", "registered_model: 'llama' needs a model to register: set export_uri"),
        ("grad_accum_steps=0", "grad_accum_steps: must be positive"),
        ("seq_len=-1", "seq_len: must be at least 0"),
        ("max_bug_retries=-1", "max_bug_retries: must be at least 0, got -1"),
    ],
)
def test_bad_parameters_fail_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture, setting: str, named: str
) -> None:
    root = tmp_path / "root"
    assert main(["pipeline", "run-local", "--root", str(root), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not root.exists(), "nothing may be started or written"


def test_max_bug_retries_reaches_the_trainers_arguments_through_the_run_spec(
    compiled: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A UI parameter like the CLI's --max-bug-retries: the check step puts it in the run spec, and
    the train step's worker command carries it on both backends (local replicas, PyTorchJob workers)."""
    from trainer.launch.k8s import build_pytorchjob, cluster_options, to_manifest
    from trainer.launch.local import job_from_parameters, worker_command

    described = _spec(compiled).root.input_definitions.parameters["max_bug_retries"]
    assert described.parameter_type == pipeline_spec_pb2.ParameterType.NUMBER_INTEGER
    assert described.default_value.number_value == 1 and "bug" in described.description
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    params = {**parameter_defaults(), "max_bug_retries": 3, "tracking_uri": MLFLOW}
    params.update(pipeline_job="resilient-fsdp-training-x7k2p", pipeline_job_id="kfp-1")
    spec = Artifact(uri=str(tmp_path / "run_spec"))
    name = check_run.python_func(run_spec=spec, **params)
    handed = read_run_spec(spec.path)
    assert handed == {**params, "training_run": name}
    cfg, launch = job_from_parameters(handed, data="/mnt/rfsdp/d", run_dir="/mnt/rfsdp/r")  # as the train step does
    job = to_manifest(build_pytorchjob(cfg, launch, cluster_options(handed)))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    for argv in (worker_command(cfg), container["command"]):
        assert argv[argv.index("--max-bug-retries") + 1] == "3"


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
    assert (
        command[command.index("--model") + 1] == "hf:s3://bucket/m"
        and command[command.index("--world-size") + 1] == "16"
    )
    assert command[command.index("--grad-accum-steps") + 1] == "4" and "--activation-checkpointing" in command
    described = {p.name: p.description for p in parameters()}
    assert (
        "hf:PATH" in described["model"]
        and "py:package.module:factory" in described["model"]
        and "s3://" in described["model"]
    )
    assert "export_uri" in described["registered_model"] and "MLflow" in described["export_uri"]


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
    params = {**parameter_defaults(), "pipeline_job": "resilient-fsdp-training-x7k2p", "pipeline_job_id": "kfp-1"}
    run = Artifact(uri=str(tmp_path / "run"))
    data = Dataset(uri=str(tmp_path / "data"))
    with pytest.raises(ValueError, match="fault: step 99 in 'exception@99' is outside the run"):
        train.python_func(
            data=data, run=run, run_spec=_run_spec(tmp_path / "s1", {**params, "fault": "exception@99"}, "ui-run")
        )
    with pytest.raises(ValueError, match="backend: 'slurm'"):
        train.python_func(
            data=data, run=run, run_spec=_run_spec(tmp_path / "s2", {**params, "backend": "slurm"}, "ui-run")
        )
    assert not (tmp_path / "run").exists()
    record = json.loads((tmp_path / "workspace" / "ui-run" / FAILURE_FILE).read_text())
    assert record == {
        "kfp_run": "kfp-1",
        "step": TRAIN_STEP,
        "reason": "ParameterError: backend: 'slurm' is not one of local, kubernetes",
    }
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
                    self._reply(
                        {"pipelines": outer.pipelines, "total_size": len(outer.pipelines)} if outer.pipelines else {}
                    )
                elif req["path"] == "/apis/v2beta1/pipelines/p-1/versions":
                    self._reply(
                        {"pipeline_versions": [{"pipeline_id": "p-1", "pipeline_version_id": "v-1"}], "total_size": 1}
                    )
                elif req["path"] == "/apis/v2beta1/experiments":
                    self._reply(
                        {"experiments": outer.experiments, "total_size": len(outer.experiments)}
                        if outer.experiments
                        else {}
                    )
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
        message = email.parser.BytesParser().parsebytes(
            b"Content-Type: " + request["type"].encode() + b"\r\n\r\n" + request["body"]
        )
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
        ids = submit(
            server.url,
            overrides,
            kfp_experiment="fsdp-runs",
            service_account="rfsdp-pipeline",
            package=tmp_path / "p.yaml",
        )
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
        with pytest.raises(
            ParameterError, match="^tracking_uri: 'sqlite:///tmp/m.db' is a file in the logging step's pod"
        ):
            submit(server.url, {"tracking_uri": "sqlite:///tmp/m.db"})
        assert server.requests == []
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
