"""Real end-to-end ``kfp.local`` runs of the whole pipeline (``rfsdp pipeline run-local``): with a
fault, with its restarts exhausted (failed, and logged FAILED to MLflow) and resumed under an
explicit name, twice with the defaults, and a Hugging Face model exported and registered.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from components.runs import TRAIN_STEP
from pipelines.run import run_local
from tests.conftest import MlflowServer
from trainer.events import Restart, RunStart, read_events, select
from trainer.results.summary import VERDICT
from trainer.results.tracking import FAILED_STEP_TAG, FAILURE_REASON_TAG

EXIT = "log-to-mlflow"
HEADLINE = {
    "goodput (%)",
    "restarts in-process",
    "restarts in-job",
    "recovery p50 (s)",
    "recovery max (s)",
    "lost steps",
    "lost steps max per fault",
    "OOM kills",  # its peak RSS only where a rank was OOM-killed
    "checkpoint stall p50 (s)",
    "checkpoint overhead (%)",
    "final loss",
    VERDICT,
}


def _run_local(root: Path, *settings: str) -> subprocess.CompletedProcess:
    """`rfsdp pipeline run-local` in a subprocess (its own kfp.local and environment)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "pipeline",
            "run-local",
            "--root",
            str(root),
            *sum((["--set", s] for s in settings), []),
        ],
        cwd=root.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _exit_output(root: Path, name: str) -> Path:
    """An output file of the exit handler task of the one pipeline run under ``root``."""
    (found,) = (root / "pipeline_root").glob(f"*/{EXIT}/{name}")
    return found


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
    settings = [
        "steps=12",
        "ckpt_every=4",
        "nnodes=2",
        "nproc_per_node=1",
        "fault=exception@6:1",
        f"tracking_uri={uri}",
        "experiment=e2e",
    ]
    settings += ["system_metrics_every=1", "max_bug_retries=2"]
    proc = _run_local(root, *settings)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_id = re.search(r"MLflow run id:\s*([0-9a-f]{32})", proc.stdout)[1]
    (run_dir,) = (root / "workspace").glob("rfsdp-*/run")
    assert [e.layer for e in select(read_events(run_dir), Restart)] == ["in_process"]
    # The check step's run spec carries the parameters to the trainer (issue 36).
    assert {s.config["max_bug_retries"] for s in select(read_events(run_dir), RunStart)} == {2}
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
    assert max(len(line) for line in (proc.stdout + proc.stderr + steps_log).splitlines()) < 1000, (
        "nothing is printed whole"
    )
    # Quiet: the steps' executor logs go to steps.log; the terminal shows each step, the fault and
    # its recovery as they happen, the tables and what to do next.
    assert "executor_input" in steps_log and "executor_input" not in proc.stdout + proc.stderr
    for step in ("check-run", "prepare-data", "train", "validate-checkpoint", "log-to-mlflow"):
        assert f"{step}: started" in proc.stdout and f"{step}: success in" in proc.stdout
    assert (
        "fault exception at step 6 on rank 1" in proc.stdout
        and "restart 1 (in_process): resumed from step" in proc.stdout
    )
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
    assert (
        logged.info.run_name == f"{run_dir.parent.name} @ {logged.data.tags['kfp_pipeline_job']}"
    )  # the run + the KFP run
    assert {"system/node_0/cpu_utilization_percentage", "system/node_1/cpu_utilization_percentage"} <= set(
        logged.data.metrics
    )
    assert logged.data.tags["rfsdp.valid"] == "true"
    assert client.get_experiment(logged.info.experiment_id).name == "e2e"


def test_a_failed_run_is_logged_failed_and_the_same_name_resumes_it(tmp_path: Path) -> None:
    """Restarts exhausted (a SIGKILL with max_restarts=0): the pipeline fails and the exit handler
    leaves a FAILED MLflow run naming the step and the reason, with the events so far. The same
    explicit training_run again resumes that run (the fault fired once) into the same MLflow run.
    """
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "root"
    # Sync checkpoints: step 3's is durable before the SIGKILL at step 5 (an async first save may not be).
    settings = [
        "steps=8",
        "ckpt_every=3",
        "ckpt_mode=sync",
        "max_restarts=0",
        "fault=sigkill@5:0",
        "training_run=resume-me",
    ]
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


def test_two_runs_with_the_defaults_do_not_touch_each_other(tmp_path: Path) -> None:
    """run_local passes the local overrides itself; each run gets a name of its own, so its run
    dir, its checkpoints and its MLflow run are its own."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # 8 steps: enough for the validation's quality check (eval loss 0.5 below initialization).
    results = [
        run_local({"steps": 8, "ckpt_every": 4, "nproc_per_node": 1, "tracking_uri": uri}, tmp_path / "root")
        for _ in range(2)
    ]
    first, second = results
    assert first["training_run"] != second["training_run"]
    assert first["mlflow_run_id"] != second["mlflow_run_id"]
    client = mlflow.MlflowClient(tracking_uri=uri)
    for result in results:
        starts = select(read_events(Path(result["run_dir"])), RunStart)
        assert [s.resumed_from_step for s in starts] == [0], "a fresh run, never a resume of the other"
        assert Path(result["run_dir"]).parent.name == result["training_run"]
        assert client.get_run(result["mlflow_run_id"]).data.tags["training_run"] == result["training_run"]
    assert sorted(p.name for p in (tmp_path / "root" / "workspace").iterdir()) == sorted(
        r["training_run"] for r in results
    )


def test_a_pipeline_run_of_an_hf_model_exports_logs_and_registers_it(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """model=hf:DIR with export_uri and registered_model: after validation passes, the validated
    checkpoint is exported as a Hugging Face model directory, logged as the MLflow run's model
    (under model/) and registered as version 1."""
    import mlflow
    from transformers import AutoModelForCausalLM

    from tests.integration.test_models import save_model
    from trainer.checkpoint import read_full_state

    model = save_model(tmp_path / "llama", "llama", weights=True)
    out, root = tmp_path / "exported", tmp_path / "root"
    settings = [
        "steps=12",
        "ckpt_every=4",
        "seq_len=32",
        "nproc_per_node=1",
        f"model=hf:{model}",
        f"tracking_uri={mlflow_server.uri}",
    ]
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
    assert {
        "model/config.json",
        "model/model.safetensors.index.json",
        "model/model-00001-of-00001.safetensors",
    } <= logged
    (version,) = client.search_model_versions("name = 'tiny-llama'")
    assert version.version == "1" and version.run_id == run_id and version.source == f"runs:/{run_id}/model"
    assert version.tags["rfsdp.step"] == "12"
