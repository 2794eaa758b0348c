"""MLflow logging of real runs against a real `mlflow server` on loopback (trainer.results.tracking)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, MlflowServer, rfsdp
from trainer.errors import ParameterError
from trainer.events import (
    Checkpoint,
    EventLog,
    Restart,
    RunEnd,
    RunStart,
    Step,
    SystemSample,
    from_record,
    read_events,
    summarize,
)
from trainer.results.summary import VERDICT, headline_metrics
from trainer.results.tracking import (
    EVENTS_HASH_TAG,
    FAILED_STEP_TAG,
    FAILURE_REASON_TAG,
    Failure,
    TrackingError,
    check_tracking_uri,
    log_failed_attempt,
    log_run,
    logged_runs,
    redact_uri,
    run_url,
)

SPEC = "exception@12:1,sigkill@22:0"


def _snapshot(client: MlflowClient, experiment: str) -> dict:
    """Everything the experiment holds: runs, params, tags and every metric's full history."""
    exp = client.get_experiment_by_name(experiment)
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        rid = run.info.run_id
        history = {
            k: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(rid, k))
            for k in run.data.metrics
        }
        out[rid] = {"params": run.data.params, "tags": run.data.tags, "metrics": history, "status": run.info.status}
    return out


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_summary_definitions() -> None:
    """Goodput counts each step's last line once and wall time only inside sessions."""
    records = [
        {"event": "run_start", "time": 100.0, "rank": 0, "config": {}, "resumed_from_step": 0, "world_size": 2},
        {"event": "step", "time": 101.0, "rank": 0, "step": 1, "loss": 5.0, "step_time_s": 1.0, "tokens": 100},
        {"event": "step", "time": 102.0, "rank": 0, "step": 2, "loss": 4.0, "step_time_s": 1.0, "tokens": 100},
        {
            "event": "checkpoint",
            "time": 102.5,
            "rank": 0,
            "step": 2,
            "mode": "sync",
            "blocking_s": 0.5,
            "total_s": 1.0,
            "bytes": 2_000_000,
        },
        {"event": "fault", "time": 103.0, "rank": 1, "kind": "exception", "step": 3},
        {"event": "step", "time": 106.0, "rank": 0, "step": 3, "loss": 3.5, "step_time_s": 1.0, "tokens": 100},
        {
            "event": "restart",
            "time": 106.0,
            "rank": 0,
            "layer": "in_process",
            "attempt": 1,
            "resumed_from_step": 2,
            "lost_steps": 0,
            "recovery_s": 3.0,
        },
        {"event": "step", "time": 107.0, "rank": 0, "step": 4, "loss": 3.0, "step_time_s": 1.0, "tokens": 100},
        {"event": "run_end", "time": 107.0, "rank": 0, "status": "stopped", "step": 4},
        # resumed later from the step-2 checkpoint: steps 3 and 4 run again; the gap is not wall time
        {"event": "run_start", "time": 200.0, "rank": 0, "config": {}, "resumed_from_step": 2, "world_size": 2},
        {"event": "step", "time": 201.0, "rank": 0, "step": 3, "loss": 3.5, "step_time_s": 0.5, "tokens": 100},
        {"event": "step", "time": 202.0, "rank": 0, "step": 4, "loss": 3.0, "step_time_s": 0.5, "tokens": 100},
        {"event": "step", "time": 203.0, "rank": 0, "step": 5, "loss": 2.5, "step_time_s": 0.5, "tokens": 100},
        {"event": "run_end", "time": 203.5, "rank": 0, "status": "completed", "step": 5},
    ]
    ev = [from_record(r) for r in records]  # as read back from events.jsonl
    assert None not in ev
    s = summarize(ev)
    wall = (107 - 100) + (203.5 - 200)
    assert s["wall_time_s"] == wall
    assert s["useful_time_s"] == 1 + 1 + 0.5 + 0.5 + 0.5
    assert s["goodput"] == pytest.approx(3.5 / wall)
    assert s["ckpt_overhead"] == pytest.approx(0.5 / wall)
    assert (s["final_step"], s["final_loss"], s["steps_executed"]) == (5, 2.5, 7)
    assert (s["restarts_in_process"], s["restarts_in_job"], s["recovery_s_max"]) == (1, 0, 3.0)
    assert s["ckpt_write_mb_s_mean"] == pytest.approx(2.0)
    assert s["tokens_per_s"] == pytest.approx(500 / 3.5)


def test_faulty_run_logged_to_real_server(
    faulty_run: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = read_events(faulty_run)
    restarts = [e for e in events if isinstance(e, Restart)]
    ckpts = [
        e for e in events if isinstance(e, Checkpoint) and e.tier == "durable"
    ]  # the local tier's are logged apart
    steps = [e for e in events if isinstance(e, Step)]
    assert {e.layer for e in restarts} == {"in_process", "in_job"}  # both faults really recovered

    validation = {"valid": True, "step": 30}
    tags = {"kfp_run_id": "run-123", "kfp_pipeline_job": "resilient-fsdp-abc"}
    run_id = log_run(faulty_run, tracking_uri=mlflow_server.uri, experiment="faulty", tags=tags, validation=validation)
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    m, p = run.data.metrics, run.data.params

    # counts and values match events.jsonl
    for layer in ("in_process", "in_job"):
        assert m[f"restarts_{layer}"] == sum(e.layer == layer for e in restarts)
    recovery = client.get_metric_history(run_id, "restart_recovery_s")
    assert sorted((x.step, x.value) for x in recovery) == sorted((e.attempt, e.recovery_s) for e in restarts)
    assert m["recovery_s_max"] == max(e.recovery_s for e in restarts)
    assert m["lost_steps"] == sum(e.lost_steps for e in restarts)
    blocking = client.get_metric_history(run_id, "ckpt_blocking_s")
    assert sorted((x.step, x.value) for x in blocking) == sorted((e.step, e.blocking_s) for e in ckpts)
    assert m["checkpoints"] == len(ckpts) and m["ckpt_blocking_s_total"] == pytest.approx(
        sum(e.blocking_s for e in ckpts)
    )
    loss = client.get_metric_history(run_id, "loss")  # every step line, at its real time
    assert sorted((x.step, x.timestamp) for x in loss) == sorted((e.step, int(e.time * 1000)) for e in steps)
    redone = [e for i, e in enumerate(steps) if e.step <= max((s.step for s in steps[:i]), default=0)]
    # Each step a recovery lost is logged again, and marked. (With the local tier a recovery may
    # lose none: the SIGKILL's loses one when the write of the step before it is still in flight.)
    assert len(redone) == sum(e.lost_steps for e in restarts)
    marked = client.get_metric_history(run_id, "redone_step")
    assert sorted((x.step, x.timestamp) for x in marked) == sorted((e.step, int(e.time * 1000)) for e in redone)
    assert m["final_loss"] == [e for e in steps if e.step == 30][-1].loss
    assert m["goodput"] == pytest.approx(summarize(events)["goodput"]) and 0 < m["goodput"] < 1

    assert (p["ckpt_mode"], p["fault"], p["world_size"], p["backend"], p["steps"]) == (
        "async",
        SPEC,
        "2",
        "local",
        "30",
    )
    assert run.data.tags["kfp_run_id"] == "run-123" and run.data.tags["rfsdp.valid"] == "true"
    assert run.info.status == "FINISHED"
    assert (
        run_url(mlflow_server.uri, run_id)
        == f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    )

    # artifacts: the events file byte for byte, the validation report, the restart table
    dst = Path(client.download_artifacts(run_id, "events.jsonl", str(faulty_run.parent / "dl")))
    assert dst.read_bytes() == (faulty_run / "events.jsonl").read_bytes()
    assert (
        json.loads(
            Path(client.download_artifacts(run_id, "validation.json", str(faulty_run.parent / "dl"))).read_text()
        )
        == validation
    )
    table = json.loads(
        Path(client.download_artifacts(run_id, "restarts.json", str(faulty_run.parent / "dl"))).read_text()
    )
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [r["layer"] for r in rows] == [e.layer for e in restarts]
    assert [r["recovery_s"] for r in rows] == pytest.approx(
        [e.recovery_s for e in restarts]
    )  # the table rounds to 10 digits
    assert [r["fault_kind"] for r in rows] == ["exception", "sigkill"]

    # logging again (through the CLI, the server named by MLFLOW_TRACKING_URI) changes nothing
    before = _snapshot(client, "faulty")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    proc = rfsdp("log-mlflow", "--run-dir", str(faulty_run), "--experiment", "faulty")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == run_id
    assert (
        log_run(faulty_run, tracking_uri=mlflow_server.uri, experiment="faulty", tags=tags, validation=validation)
        == run_id
    )
    assert _snapshot(client, "faulty") == before

    # even a full re-log (as after a logging interrupted half-way) adds no duplicate point
    client.delete_tag(run_id, EVENTS_HASH_TAG)
    assert (
        log_run(faulty_run, tracking_uri=mlflow_server.uri, experiment="faulty", tags=tags, validation=validation)
        == run_id
    )
    assert _snapshot(client, "faulty") == before


def test_default_store_is_local_sqlite_under_work(
    faulty_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # from a subdirectory, as a notebook kernel runs
    run_id = log_run(faulty_run)
    store = tmp_path / "work" / "mlflow"
    assert (store / "mlflow.db").is_file()
    logged = store / "artifacts" / "resilient-fsdp" / run_id / "artifacts" / "events.jsonl"
    assert logged.read_bytes() == (faulty_run / "events.jsonl").read_bytes()
    assert log_run(faulty_run) == run_id


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    proc = rfsdp("log-mlflow", "--run-dir", str(tmp_path / "missing"), "--tracking-uri", f"sqlite:///{tmp_path}/x.db")
    assert proc.returncode == 2 and "--run-dir" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="--run-dir"):
        log_run(tmp_path, tracking_uri=f"sqlite:///{tmp_path}/x.db")
    assert not (tmp_path / "x.db").exists()


def test_server_down_retries_then_fails_clearly_and_nothing_is_lost(
    faulty_run: Path, mlflow_server: MlflowServer
) -> None:
    uri = mlflow_server.uri
    before = _tree_digest(faulty_run)
    mlflow_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(TrackingError, match=re.escape(uri)) as err:
            log_run(faulty_run, tracking_uri=uri, experiment="after-outage", retries=3, backoff_s=0.2)
        assert time.monotonic() - t0 >= 0.2 + 0.4  # backed off between the attempts
        assert "3 attempts" in str(err.value) and str(faulty_run) in str(err.value)
        proc = rfsdp(
            "log-mlflow",
            "--run-dir",
            str(faulty_run),
            "--tracking-uri",
            uri,
            "--experiment",
            "after-outage",
            "--retries",
            "2",
        )
        assert proc.returncode == 1 and uri in proc.stderr and "Traceback" not in proc.stderr
    finally:
        mlflow_server.start()
    assert _tree_digest(faulty_run) == before

    run_id = log_run(faulty_run, tracking_uri=uri, experiment="after-outage")
    run = MlflowClient(uri).get_run(run_id)
    events = read_events(faulty_run)
    assert run.data.metrics["restarts"] == sum(isinstance(e, Restart) for e in events)
    assert run.data.metrics["checkpoints"] == sum(isinstance(e, Checkpoint) and e.tier == "durable" for e in events)


def test_a_pipeline_failure_is_logged_failed_then_cleared_when_the_run_succeeds(
    faulty_run: Path, tmp_path: Path
) -> None:
    """The exit handler's path: a failed pipeline run ends FAILED with the step and reason; the same
    run dir logged again after a successful resume is FINISHED with the failure tags gone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    failure = Failure("validate checkpoint", "RuntimeError: checkpoint at step 30 is invalid: failed check(s): replays")
    run_id = log_run(faulty_run, tracking_uri=uri, experiment="failures", failure=failure, run_name="fsdp-a")
    run = client.get_run(run_id)
    assert (run.info.status, run.info.run_name) == ("FAILED", "fsdp-a")
    assert run.data.tags[FAILED_STEP_TAG] == failure.step and run.data.tags[FAILURE_REASON_TAG] == failure.reason
    assert run.data.metrics["restarts"] == sum(
        isinstance(e, Restart) for e in read_events(faulty_run)
    )  # the events are logged too

    assert log_run(faulty_run, tracking_uri=uri, experiment="failures") == run_id  # nothing new but the outcome
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert not {FAILED_STEP_TAG, FAILURE_REASON_TAG} & set(run.data.tags)
    assert (
        run_url(uri, run_id) == f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    )  # `mlflow ui`


def test_a_run_that_failed_before_training_is_its_own_failed_run(faulty_run: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    failure = Failure("check parameters", "ParameterError: fault: exception@5:0 and sigkill@5:1 are both at step 5")
    run_id = log_failed_attempt(
        "kfp-run-1", failure, tracking_uri=uri, experiment="e", run_name="rfsdp-1", tags={"backend": "kubernetes"}
    )
    assert (
        log_failed_attempt("kfp-run-1", failure, tracking_uri=uri, experiment="e", run_name="rfsdp-1") == run_id
    )  # idempotent
    other = log_failed_attempt("kfp-run-2", failure, tracking_uri=uri, experiment="e", run_name="rfsdp-2")
    assert other != run_id
    run = MlflowClient(uri).get_run(run_id)
    assert (
        run.info.status == "FAILED"
        and run.data.tags[FAILURE_REASON_TAG] == failure.reason
        and run.data.tags["backend"] == "kubernetes"
    )
    logged = log_run(faulty_run, tracking_uri=uri, experiment="e")
    assert [r.run_id for r in logged_runs("e", uri)] == [logged], "runs without events are not compared"


def test_headline_metrics_are_rounded_and_named_for_a_person(faulty_run: Path) -> None:
    events = read_events(faulty_run)
    figures, headline = summarize(events), headline_metrics(events, valid=True)
    assert headline["goodput (%)"] == round(figures["goodput"] * 100, 1)
    assert headline["restarts in-process"] == figures["restarts_in_process"] == 1
    assert headline["restarts in-job"] == figures["restarts_in_job"] == 1
    assert headline["recovery max (s)"] == round(figures["recovery_s_max"], 2)
    assert headline["checkpoint stall p50 (s)"] == round(figures["ckpt_blocking_s_p50"], 3)
    assert headline["final loss"] == round(figures["final_loss"], 4) and headline[VERDICT] == 1
    assert VERDICT not in headline_metrics(events, valid=None)  # not validated: no verdict shown
    assert headline_metrics([], valid=None) == {}


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("mlflow.example.com:5000", "is not an MLflow tracking URI"),
        ("http://", "names no host"),
        ("sqlite://relative.db", "is not sqlite:///PATH"),
        ("ftp://host/x", "is not an MLflow tracking URI"),
    ],
)
def test_malformed_tracking_uris_are_refused(uri: str, problem: str) -> None:
    with pytest.raises(ParameterError, match=f"^--tracking-uri: '{re.escape(uri)}' {problem}"):
        check_tracking_uri(uri)
    for good in (
        "http://mlflow.ns:5000",
        "https://mlflow.example.com",
        "sqlite:////mnt/rfsdp/mlflow.db",
        "postgresql+psycopg2://u@db/m",
    ):
        assert check_tracking_uri(good) == good


@pytest.mark.slow
def test_mlflow_follows_a_run_while_it_trains(data_dir: Path, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """``rfsdp train --tracking-uri``: the run's loss curve and each node's system metrics are in
    MLflow (RUNNING) while it trains; preempted, the same MLflow run is completed, every step and
    every system sample once."""
    run = tmp_path / "run"
    cmd = [
        "train",
        "--quiet",
        "--data",
        str(data_dir),
        "--run-dir",
        str(run),
        "--steps",
        "2000",
        "--tracking-uri",
        mlflow_server.uri,
    ]
    cmd += ["--nnodes", "2", "--nproc-per-node", "1", "--system-metrics-every", "1"]
    cpu = [f"system/node_{n}/cpu_utilization_percentage" for n in (0, 1)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *cmd, "--experiment", "live"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client, deadline, seen = MlflowClient(mlflow_server.uri), time.monotonic() + 300, None
    while seen is None:  # the run goes on until the test stops it: no race with its end
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        experiment = client.get_experiment_by_name("live")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        if runs and all(client.get_metric_history(runs[0].info.run_id, key) for key in ("loss", *cpu)):
            seen = runs[0]
        time.sleep(0.5)
    assert seen.info.status == "RUNNING"
    proc.send_signal(signal.SIGTERM)  # preempted: it checkpoints the step it reached and logs the whole run
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0 and f"MLflow run {seen.info.run_id}" in err, err
    end = [e for e in read_events(run) if isinstance(e, RunEnd)][-1]
    final = client.get_run(seen.info.run_id)
    assert final.info.status == "FINISHED" and final.data.tags["rfsdp.run_key"]
    assert sorted(m.step for m in client.get_metric_history(seen.info.run_id, "loss")) == list(range(1, end.step + 1))
    samples = [e for e in read_events(run) if isinstance(e, SystemSample)]
    for node, key in enumerate(cpu):  # logged live and again at the end: one point per sample
        history = client.get_metric_history(seen.info.run_id, key)
        assert sorted(m.timestamp for m in history) == sorted(int(e.time * 1000) for e in samples if e.node == node)
    assert len(client.search_runs([seen.info.experiment_id])) == 1


@pytest.mark.slow
def test_a_tracking_server_that_is_down_costs_the_training_nothing(data_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    run = tmp_path / "run"
    proc = rfsdp(
        "train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), "--steps", "20", "--tracking-uri", down
    )
    assert proc.returncode == 0 and "not logged to MLflow" in proc.stderr and down in proc.stderr, proc.stderr
    assert max(e.step for e in read_events(run) if isinstance(e, Step)) == 20  # and log-mlflow can log it later


def test_runs_are_tagged_with_the_code_that_logged_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """An image's build argument names the commit; a checkout's HEAD does where there is none."""
    from trainer.results.tracking import GIT_COMMIT_ENV, GIT_COMMIT_TAG, VERSION_TAG, source_tags

    monkeypatch.setenv(GIT_COMMIT_ENV, "0123abc")
    assert source_tags() == {VERSION_TAG: "0.1.0", GIT_COMMIT_TAG: "0123abc"}
    monkeypatch.delenv(GIT_COMMIT_ENV)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    assert source_tags().get(GIT_COMMIT_TAG) == (head or None)


def test_credentials_in_the_tracking_uri_are_shown_nowhere(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 34: a tracking URI with ``user:password@`` (MLflow's client sends it as basic auth;
    this server has no auth and ignores it) logs the run, yet the password is in no URL, report,
    message, tag, param or artifact; nor are secret query values."""
    from components.runs import log_pipeline_run
    from trainer.launch import WORKSPACE_ENV

    secret = "pw-never-shown-9f3"
    uri = mlflow_server.uri.replace("://", f"://alice:{secret}@")
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "ws"))
    run_dir = tmp_path / "ws" / "leak" / "run"
    run_dir.mkdir(parents=True)
    events = EventLog(run_dir, rank=0)  # a small finished run: what is logged, not how it trained, matters here
    events.emit(
        RunStart(config={"steps": 3, "ckpt_mode": "sync", "run_dir": str(run_dir)}, resumed_from_step=0, world_size=2)
    )
    for step in (1, 2, 3):
        events.emit(Step(step=step, loss=5.0 - step / 10, step_time_s=0.1, tokens=1024))
    events.emit(RunEnd(status="completed", step=3))
    kfp = {
        "pipeline_job": "resilient-fsdp-training-leak",
        "pipeline_job_id": "kfp-leak",
        "image": "img:1",
        "backend": "local",
    }
    logged = log_pipeline_run(
        state="SUCCEEDED", error_message="", training_run="leak", tracking_uri=uri, experiment="leak", **kfp
    )
    assert logged.mlflow_url.startswith(f"{mlflow_server.uri}/#/experiments/")
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(logged.mlflow_run_id)
    assert run.info.status == "FINISHED"
    shown = [logged.mlflow_url, logged.markdown, json.dumps(run.data.tags), json.dumps(run.data.params)]
    artifacts = Path(client.download_artifacts(logged.mlflow_run_id, "", str(tmp_path / "artifacts")))
    shown += [f.read_text(errors="replace") for f in artifacts.rglob("*") if f.is_file()]

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        down = f"http://alice:{secret}@127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(TrackingError, match=re.escape("http://127.0.0.1:")) as err:
        log_run(run_dir, tracking_uri=down, experiment="leak", retries=1)
    shown.append(str(err.value))
    with pytest.raises(TrackingError) as err:
        log_failed_attempt(
            "kfp-leak", Failure("train", "x"), tracking_uri=down, experiment="leak", run_name="leak", retries=1
        )
    shown.append(str(err.value))
    with pytest.raises(ParameterError) as bad:
        check_tracking_uri(f"ftp://alice:{secret}@host/x?token={secret}")
    shown.append(str(bad.value))
    proc = rfsdp(
        "log-mlflow", "--run-dir", str(run_dir), "--tracking-uri", down, "--experiment", "leak", "--retries", "1"
    )
    assert proc.returncode == 1 and "127.0.0.1" in proc.stderr
    shown += [proc.stdout, proc.stderr, *capsys.readouterr()]
    assert [s for s in shown if secret in s] == []

    assert (
        redact_uri(f"https://mlflow/p?token={secret}&experiment=a%20b") == "https://mlflow/p?token=***&experiment=a%20b"
    )
    assert redact_uri(f"https://{secret}@mlflow:443/") == "https://mlflow:443/"
    assert redact_uri("sqlite:////mnt/rfsdp/mlflow.db") == "sqlite:////mnt/rfsdp/mlflow.db"


def test_a_run_is_findable_by_its_tag_from_the_request_that_creates_it(tmp_path: Path) -> None:
    """An outage right after a run is created must not leave it unfindable: the next attempt would
    create a second run and leave the first RUNNING for ever. The tag comes with the creation."""
    from trainer.results.tracking.runs import _client, find_or_create_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = _client(uri)
    run_id, found = find_or_create_run(client, uri, "exp", "rfsdp.run_key", "abc", run_name="r")
    assert found is None  # created, and nothing else asked of the server since
    again, found = find_or_create_run(client, uri, "exp", "rfsdp.run_key", "abc", run_name="r")
    assert again == run_id and found is not None and found.data.tags["rfsdp.run_key"] == "abc"
    assert len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1


def test_under_kubeflows_own_mlflow_run_the_training_run_is_nested_in_it(
    faulty_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KFP's MLflow integration gives each pipeline run a parent run and each task a nested one,
    named to the task by ``MLFLOW_RUN_ID``. The training run goes under the pipeline's run, in its
    experiment; the exit handler (another task, another nested run) finds the same run again.
    Without ``MLFLOW_RUN_ID``, or with one this store lacks, nothing changes."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    kfp = client.create_experiment("kfp-experiment")
    pipeline = client.create_run(kfp, run_name="pipeline-run").info.run_id
    train_task, exit_task = (
        client.create_run(kfp, run_name=n, tags={"mlflow.parentRunId": pipeline}).info.run_id
        for n in ("train", "exit-handler")
    )
    monkeypatch.setenv("MLFLOW_RUN_ID", train_task)
    run_id = log_run(faulty_run, tracking_uri=uri)
    logged = client.get_run(run_id)
    assert logged.data.tags["mlflow.parentRunId"] == pipeline and logged.info.experiment_id == kfp
    monkeypatch.setenv("MLFLOW_RUN_ID", exit_task)
    assert log_run(faulty_run, tracking_uri=uri) == run_id
    assert len(client.search_runs([kfp], filter_string="tags.`mlflow.parentRunId` = '" + pipeline + "'")) == 3

    elsewhere = f"sqlite:///{tmp_path / 'other.db'}"  # a store that does not hold that run: logged beside
    beside = MlflowClient(tracking_uri=elsewhere).get_run(log_run(faulty_run, tracking_uri=elsewhere))
    assert "mlflow.parentRunId" not in beside.data.tags
    monkeypatch.delenv("MLFLOW_RUN_ID")
    plain = f"sqlite:///{tmp_path / 'plain.db'}"
    alone = MlflowClient(tracking_uri=plain).get_run(log_run(faulty_run, tracking_uri=plain))
    assert "mlflow.parentRunId" not in alone.data.tags
    assert MlflowClient(tracking_uri=plain).get_experiment(alone.info.experiment_id).name == "resilient-fsdp"


# Processes that meet a new sqlite store at once, each with a temp folder of its own (as a pod's
# or a pipeline step's is): before, both migrated it and one failed with "table
# _alembic_tmp_experiments already exists".
_FIRST_USE = """
import sys
from trainer.results.tracking.uri import client_of
client_of(sys.argv[1]).search_experiments()
"""


def test_processes_with_their_own_temp_folders_open_a_new_sqlite_store_at_once(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    procs = []
    for i in range(4):
        (own_tmp := tmp_path / f"tmp{i}").mkdir()
        env = {**os.environ, "TMPDIR": str(own_tmp)}
        command = [sys.executable, "-c", _FIRST_USE, uri]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errors)
    assert [e.name for e in MlflowClient(tracking_uri=uri).search_experiments()] == ["Default"]
