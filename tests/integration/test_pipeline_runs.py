"""The Kubeflow pipeline's steps with real processes: the train step's local backend (real jobs,
MLflow following them), the check and exit-handler steps logging to MLflow, the quiet local
view, and the CLI's refusals in a subprocess. The compiled pipeline: tests/unit/test_pipeline.py.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kfp.dsl import Artifact, Dataset

from components.runs import TRAIN_STEP, read_run_spec, write_run_spec
from components.train import train
from pipelines.resilient_fsdp import parameter_defaults
from tests.conftest import MlflowServer, as_unprivileged
from trainer.errors import ParameterError
from trainer.events import EventLog, FaultFired, Restart, RunStart, read_events, select
from trainer.launch import WORKSPACE_ENV
from trainer.launch.spec import resolve_run_name
from trainer.results.tracking import FAILED_STEP_TAG, FAILURE_REASON_TAG

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = "http://mlflow.team-a:5000"


def test_a_kubernetes_run_local_without_root_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """backend=kubernetes runs on the emulated cluster, which needs root: another user is refused
    in one line naming the parameter (as root, the command runs as nobody)."""
    root = tmp_path / "root"
    command = [
        sys.executable,
        "-m",
        "trainer.cli",
        "pipeline",
        "run-local",
        "--root",
        str(root),
        "--set",
        "backend=kubernetes",
    ]
    command += ["--set", f"tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    proc = subprocess.run(as_unprivileged(command), cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "rfsdp pipeline: error: backend: run-local runs kubernetes on the emulated cluster, which needs root"
    )
    assert not root.exists() and not (tmp_path / "mlflow.db").exists(), "nothing may be started or written"


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
        host, expected = (
            "http://127.0.0.1:9",
            "--host: cannot reach http://127.0.0.1:9",
        )  # port 9 (discard): nothing listens
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
def _run_spec(path: Path, params: dict, name: str) -> Artifact:
    """The run spec the check step would hand the train step, at ``path``."""
    write_run_spec(path, params, name)
    return Artifact(uri=str(path))


def test_train_step_two_replicas_one_rendezvous(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train component's local backend on 2 replicas x 1 process: two ft_launchers meet in one
    c10d rendezvous through the PET_* contract, and an exception on rank 1 is recovered in-process.
    The run dir lives on the (local stand-in for the) shared volume under the run's name.
    """
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    params = {**parameter_defaults(), "pipeline_job": "resilient-fsdp-training-x7k2p", "pipeline_job_id": "kfp-1"}
    params.update(steps=10, ckpt_every=5, nnodes=2, nproc_per_node=1, fault="exception@4:1", backend="local")
    params.update(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # MLflow follows the step's job
    run = Artifact(uri=str(tmp_path / "run"))
    train.python_func(
        data=Dataset(uri=str(data_dir)), run=run, run_spec=_run_spec(tmp_path / "run_spec", params, "two-replicas")
    )
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
    params = {**parameter_defaults(), "training_run": "preempted"}
    params.update(
        steps=12, ckpt_every=4, nnodes=1, nproc_per_node=2, fault="sigterm@6:0", backend="local", tracking_uri=uri
    )
    params.update(pipeline_job="resilient-fsdp-training-p1", pipeline_job_id="kfp-p1")
    message = "preempted at step 6; start a run with training_run=preempted to resume"
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        train.python_func(
            data=Dataset(uri=str(data_dir)),
            run=Artifact(uri=str(tmp_path / "run")),
            run_spec=_run_spec(tmp_path / "run_spec", params, "preempted"),
        )
    assert not (tmp_path / "run").exists(), "nothing handed on to validation"
    logged = log_pipeline_run(
        state="FAILED",
        error_message="Task exit-handler-1 failed.",
        **{
            k: params[k]
            for k in (
                "training_run",
                "backend",
                "tracking_uri",
                "experiment",
                "pipeline_job",
                "pipeline_job_id",
                "image",
            )
        },
    )
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logged.mlflow_run_id)
    assert run.info.status == "FAILED" and run.data.tags[FAILED_STEP_TAG] == TRAIN_STEP
    assert run.data.tags[FAILURE_REASON_TAG] == f"RuntimeError: {message}"
    assert message in logged.markdown

    params.update(pipeline_job="resilient-fsdp-training-p2", pipeline_job_id="kfp-p2")  # the fault fired once
    train.python_func(
        data=Dataset(uri=str(data_dir)),
        run=Artifact(uri=str(tmp_path / "run")),
        run_spec=_run_spec(tmp_path / "run_spec", params, "preempted"),
    )
    run_dir = tmp_path / "workspace" / "preempted" / "run"
    assert [s.resumed_from_step for s in select(read_events(run_dir), RunStart)] == [0, 6]


def test_mlflow_follows_the_train_step_under_the_name_the_exit_handler_logs(
    data_dir: Path, mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the train step's job trains, its MLflow run (RUNNING, named after the training run and
    the KFP run, with the KFP tags) shows the loss curve; the exit handler completes that run."""
    import mlflow

    from components.runs import live_tracking, log_pipeline_run, run_root

    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "workspace"))
    kfp = {
        "backend": "local",
        "pipeline_job": "resilient-fsdp-training-x7k2p",
        "pipeline_job_id": "kfp-1",
        "image": "rfsdp:test",
    }
    run_dir, client = run_root("live-step") / "run", mlflow.MlflowClient(mlflow_server.uri)
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--quiet",
        "--data",
        str(data_dir),
        "--run-dir",
        str(run_dir),
        "--steps",
        "2000",
    ]
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
        state="SUCCEEDED",
        error_message="",
        training_run="live-step",
        tracking_uri=mlflow_server.uri,
        experiment="step",
        **kfp,
    )
    assert logged.mlflow_run_id == seen.info.run_id and client.get_run(seen.info.run_id).info.status == "FINISHED"
    assert len(client.search_runs([seen.info.experiment_id])) == 1


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
        check_run.python_func(run_spec=Artifact(uri=str(tmp_path / "run_spec")), **params)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team-a:5000")  # the rfsdp-mlflow secret's key
    spec = Artifact(uri=str(tmp_path / "run_spec"))
    name = check_run.python_func(run_spec=spec, **params)
    assert name == resolve_run_name("", params["pipeline_job"], "kfp-1")
    assert read_run_spec(spec.path) == {**params, "training_run": name}  # what the later steps read

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ParameterError, match="^fault: exception@5:0 and sigkill@5:1 are both at step 5"):
        check_run.python_func(
            run_spec=Artifact(uri=str(tmp_path / "run_spec")),
            **{**params, "fault": "exception@5:0,sigkill@5:1", "tracking_uri": uri},
        )
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
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    assert run.data.tags["kfp_run_id"] == "kfp-1" and run.data.tags["image"] == "registry.example/resilient-fsdp:0.1.0"
    assert run.data.tags.get("mlflow.source.git.commit") == (head or None) and run.data.tags["rfsdp.version"] == "0.1.0"
    assert (
        run.data.tags[FAILURE_REASON_TAG]
        == "ParameterError: fault: exception@5:0 and sigkill@5:1 are both at step 5: one fault per step"
    )
    assert logged.headline == {} and CHECK_STEP in logged.markdown and f"]({logged.mlflow_url})" in logged.markdown
    assert not (tmp_path / "workspace" / name / "run").exists(), "nothing was started"


def test_the_exit_handler_never_follows_a_refused_name_into_another_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    victim_id = log_run(
        victim_dir, tracking_uri=uri, experiment="ui", tags={"training_run": "victim"}, run_name="victim"
    )
    before = client.get_run(victim_id)
    files = {p: p.read_bytes() for p in workspace.rglob("*") if p.is_file()}

    params = {**parameter_defaults(), "training_run": "./victim", "tracking_uri": uri, "experiment": "ui"}
    params.update(pipeline_job="resilient-fsdp-training-x7k2p", pipeline_job_id="kfp-9")
    with pytest.raises(ParameterError, match="^training_run: './victim' is not a DNS-1035 label"):
        check_run.python_func(run_spec=Artifact(uri=str(tmp_path / "run_spec")), **params)
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
    assert (after.info.status, after.data.tags, after.data.metrics) == (
        before.info.status,
        before.data.tags,
        before.data.metrics,
    )
    assert after.info.status == "FINISHED" and FAILED_STEP_TAG not in after.data.tags
    assert {p: p.read_bytes() for p in workspace.rglob("*") if p.is_file()} == files, "the victim's folder is untouched"
    own = client.get_run(logged.mlflow_run_id)
    assert own.info.status == "FAILED" and own.data.tags[FAILED_STEP_TAG] == CHECK_STEP
    assert own.data.tags[FAILURE_REASON_TAG].startswith(
        "ParameterError: training_run: './victim' is not a DNS-1035 label"
    )
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
    subprocess.run([sys.executable, "-c", \
"import sys; print('executor_input of a step'); print('a warning', file=sys.stderr)"])
    run = Path({str(workspace)!r}) / "new" / "run"
    run.mkdir(parents=True)
    events = EventLog(run, 0)
    events.emit(Step(step=1, loss=2.5, step_time_s=0.1, tokens=100))
    EventLog(run, 1).emit(FaultFired(kind="exception", step=2))
    time.sleep(0.5)
    events.emit(Restart(layer="in_process", attempt=1, resumed_from_step=0, lost_steps=1, recovery_s=1.25))
    events.emit(Step(step=8, loss=2.0, step_time_s=0.1, tokens=100))
    print("12:00:09.000 - INFO - Task \\x1b[96m'train'\\x1b[0m finished with status \\x1b[92mSUCCESS\\x1b[0m", \
flush=True)
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
