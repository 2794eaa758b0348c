"""The Kubeflow pipeline: compiled IR (strict protobuf parse), parameters checked before anything
starts, the upload/submit path against a recording KFP server on loopback (a contract test: no
real KFP server can run here), and one real end-to-end ``kfp.local`` run of the whole pipeline
on 2 replicas x 1 CPU worker with an injected fault.
"""

from __future__ import annotations

import email.parser
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from google.protobuf import json_format
from kfp.dsl import Artifact, Dataset
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from components.train import train
from pipelines.resilient_fsdp import PIPELINE_NAME, compile_pipeline, parameter_defaults, submit
from trainer.cli import main
from trainer.errors import ParameterError
from trainer.events import Restart, read_events, select
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_MOUNT

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["prepare-data", "train", "validate-checkpoint", "log-to-mlflow"]
EXPECTED_PARAMETERS = {
    "steps", "ckpt_every", "ckpt_mode", "nnodes", "nproc_per_node", "max_restarts", "inprocess_restart", "fault", "model", "seed",
    "hang_timeout", "backend", "run_name", "image", "namespace", "gpus", "cpu", "memory", "source", "pvc_name", "checkpoint_uri",
    "tracking_uri", "experiment",
}  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("ir") / "pipeline.yaml")
    return list(yaml.safe_load_all(path.read_text()))


def test_compiled_ir_parses_strictly(compiled: list[dict]) -> None:
    assert len(compiled) == 2, "the IR and the kubernetes platform document"
    spec = json_format.ParseDict(compiled[0], pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)
    assert spec.pipeline_info.name == PIPELINE_NAME and spec.schema_version == "2.1.0"
    # The four tasks, in order: each depends on the one before.
    tasks = spec.root.dag.tasks
    assert sorted(tasks) == sorted(TASKS)
    for before, after in zip(TASKS, TASKS[1:], strict=False):
        assert before in tasks[after].dependent_tasks, f"{after} must run after {before}"
    # Every parameter has a default and a description the Kubeflow UI shows.
    inputs = spec.root.input_definitions.parameters
    assert set(inputs) == EXPECTED_PARAMETERS
    for name, param in inputs.items():
        assert param.description.strip(), f"parameter {name} has no description"
        assert param.HasField("default_value"), f"parameter {name} has no default"
    assert not [n for n in inputs if re.search("password|secret|token|access_key", n)], "credentials are never parameters"


def test_kubernetes_platform_config_parses_strictly(compiled: list[dict]) -> None:
    platform = json_format.ParseDict(compiled[1], pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False)
    executors = json_format.MessageToDict(platform.platforms["kubernetes"].deployment_spec)["executors"]
    configs = {
        name: json_format.ParseDict(cfg, kubernetes_executor_config_pb2.KubernetesExecutorConfig(), ignore_unknown_fields=False)
        for name, cfg in executors.items()
    }
    assert set(configs) == {f"exec-{t}" for t in TASKS}
    for name, cfg in configs.items():
        secrets = {s.secret_name_parameter.runtime_value.constant.string_value: s for s in cfg.secret_as_env}
        assert set(secrets) == set(CREDENTIAL_SECRETS), name
        assert all(s.optional for s in secrets.values())
    mounts = configs["exec-train"].pvc_mount
    assert [(m.mount_path, m.pvc_name_parameter.component_input_parameter) for m in mounts] == [(WORKSPACE_MOUNT, "pvc_name")]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("model=huge", "model: unknown model 'huge'"),
        ("fault=boom@3", "fault: unknown kind 'boom'"),
        ("fault=sigkill@5:7", "fault: rank 7"),
        ("ckpt_every=0", "ckpt_every: must be positive"),
        ("nproc_per_node=0", "nproc_per_node: must be at least 1"),
        ("run_name=Bad_Name", "run_name: 'Bad_Name' is not a DNS-1035 label"),
        ("backend=slurm", "backend: 'slurm' is not one of local, kubernetes"),
        ("memory=lots", "memory: 'lots' is not a Kubernetes quantity"),
        ("steps=abc", "--set steps: 'abc' is not a valid int"),
        ("stepz=10", "--set: unknown parameter 'stepz'"),
    ],
)
def test_bad_parameters_fail_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture, setting: str, named: str) -> None:
    root = tmp_path / "root"
    assert main(["pipeline", "run-local", "--root", str(root), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not root.exists(), "nothing may be started or written"


def test_train_step_rejects_bad_parameters_before_any_process(tmp_path: Path) -> None:
    """A run started from the Kubeflow UI bypasses the CLI: the step itself checks first."""
    params = {k: v for k, v in parameter_defaults().items() if k in train.component_spec.inputs}
    run = Artifact(uri=str(tmp_path / "run"))
    data = Dataset(uri=str(tmp_path / "data"))
    with pytest.raises(ValueError, match="fault: step 99 in 'exception@99' is outside the run"):
        train.python_func(data=data, run=run, **{**params, "fault": "exception@99"})
    with pytest.raises(ValueError, match="backend: 'slurm'"):
        train.python_func(data=data, run=run, **{**params, "backend": "slurm"})
    assert not (tmp_path / "run").exists()


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
        overrides = {"backend": "kubernetes", "run_name": "exp-7", "nnodes": 2, "nproc_per_node": 4, "gpus": True, "fault": "sigkill@30:5"}
        ids = submit(server.url, overrides, kfp_experiment="fsdp-runs", service_account="rfsdp-pipeline", package=tmp_path / "p.yaml")
        assert server.calls() == [
            ("GET", "/apis/v2beta1/healthz"),
            ("GET", "/apis/v2beta1/pipelines"),
            ("POST", "/apis/v2beta1/pipelines/upload"),
            ("GET", "/apis/v2beta1/pipelines/p-1/versions"),
            ("GET", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/runs"),
        ]
        upload = server.requests[2]
        assert upload["query"]["name"] == [PIPELINE_NAME]
        assert server.uploaded_ir(upload) == next(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))
        assert server.requests[3]["query"]["sort_by"] == ["created_at desc"]
        assert json.loads(server.requests[5]["body"])["display_name"] == "fsdp-runs"
        run = json.loads(server.requests[6]["body"])
        assert run["experiment_id"] == "e-1" and run["service_account"] == "rfsdp-pipeline"
        assert run["pipeline_version_reference"] == {"pipeline_id": "p-1", "pipeline_version_id": "v-1"}
        assert run["runtime_config"]["parameters"] == overrides
        assert run["display_name"].startswith("exp-7-")
        assert ids == {"pipeline_id": "p-1", "version_id": "v-1", "experiment_id": "e-1", "run_id": "r-7"}

        # Second submit: the pipeline exists, so a new version is uploaded and run; the experiment is reused.
        seen = len(server.requests)
        ids = submit(server.url, {"steps": 120}, kfp_experiment="fsdp-runs")
        assert server.calls(seen) == [
            ("GET", "/apis/v2beta1/healthz"),
            ("GET", "/apis/v2beta1/pipelines"),
            ("POST", "/apis/v2beta1/pipelines/upload_version"),
            ("GET", "/apis/v2beta1/experiments"),
            ("POST", "/apis/v2beta1/runs"),
        ]
        run = json.loads(server.requests[-1]["body"])
        assert run["pipeline_version_reference"] == {"pipeline_id": "p-1", "pipeline_version_id": "v-2"}
        assert run["runtime_config"]["parameters"] == {"steps": 120}
        assert ids["version_id"] == "v-2"
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def test_submit_refuses_bad_parameters_before_contacting_the_server() -> None:
    with pytest.raises(ParameterError, match="^nnodes: must be at least 1"):  # named as the pipeline parameter
        submit("http://127.0.0.1:9", {"nnodes": 0})  # port 9 (discard): any request would fail differently


# --------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_step_two_replicas_one_rendezvous(data_dir: Path, tmp_path: Path) -> None:
    """The train component's local backend on 2 replicas x 1 process: two ft_launchers meet in one
    c10d rendezvous through the PET_* contract, and an exception on rank 1 is recovered in-process.
    """
    params = {k: v for k, v in parameter_defaults().items() if k in train.component_spec.inputs}
    params.update(steps=10, ckpt_every=5, nnodes=2, nproc_per_node=1, fault="exception@4:1")
    run = Artifact(uri=str(tmp_path / "run"))
    train.python_func(data=Dataset(uri=str(data_dir)), run=run, **params)
    run_dir = tmp_path / "run"
    joined = [
        re.findall(
            r"joined round \d+ of the rendezvous '\S+' as rank (\d) in a world of size 2",
            (run_dir / "logs" / f"replica_{i}.log").read_text(),
        )
        for i in (0, 1)
    ]
    assert sorted(j[0] for j in joined) == ["0", "1"], joined
    assert run.metadata["world_size"] == 2 and run.metadata["final_step"] == 10
    assert run.metadata["restarts_in_process"] == 1 and run.metadata["restarts_in_job"] == 0
    assert run.metadata["latest_checkpoint"] == "step_000010"


@pytest.mark.slow
def test_run_local_whole_pipeline_with_a_fault(tmp_path: Path) -> None:
    """`rfsdp pipeline run-local` through kfp.local: an exception on rank 1 recovered in-process, a
    checkpoint the validation step finds valid, an MLflow run that counts the restart.

    Runs on 2 replicas x 1 process (multi-node rendezvous); the validator replays on 1 x 2, which
    must give the same bits (one intra-op thread per rank, whatever the topology).
    """
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = ["steps=12", "ckpt_every=4", "nnodes=2", "nproc_per_node=1", "fault=exception@6:1", f"tracking_uri={uri}", "experiment=e2e"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "pipeline",
            "run-local",
            "--root",
            str(tmp_path / "root"),
            *sum((["--set", s] for s in settings), []),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_id = re.search(r"MLflow run id:\s*([0-9a-f]{32})", proc.stdout)[1]
    (run_dir,) = (tmp_path / "root" / "pipeline_root").glob("*/train/run")
    assert [e.layer for e in select(read_events(run_dir), Restart)] == ["in_process"]
    assert (run_dir / "checkpoints" / "step_000012" / "manifest.json").is_file()

    (executor_output,) = (tmp_path / "root" / "pipeline_root").glob("*/validate-checkpoint/executor_output.json")
    validation = json.loads(executor_output.read_text())
    assert validation["parameterValues"]["Output"]["valid"] is True
    (report,) = (tmp_path / "root" / "pipeline_root").glob("*/validate-checkpoint/report")
    assert "**valid**" in report.read_text()

    client = mlflow.MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id)
    assert logged.data.metrics["restarts_in_process"] == 1
    assert logged.data.metrics["final_step"] == 12
    assert logged.data.tags["backend"] == "local" and logged.data.tags["run_name"] == "rfsdp-run"
    assert client.get_experiment(logged.info.experiment_id).name == "e2e"
