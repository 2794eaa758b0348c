"""A platform engineer's workflows with the real kubectl against the emulated cluster: a cluster of
one's own (`rfsdp cluster up`) that a manifest applied with kubectl trains on, and a pipeline run
whose PyTorchJob is deleted with kubectl while it trains. Root and kubectl are needed; the tests
skip with the reason elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_nothing_of_the_run_left
from trainer.emulation.cluster import cluster_problem
from trainer.events import RunEnd, Step, read_events, select

PROBLEM = cluster_problem() or (None if shutil.which("kubectl") else "no kubectl on the PATH")
pytestmark = pytest.mark.skipif(
    PROBLEM is not None, reason=f"the emulated cluster with kubectl cannot run here: {PROBLEM}"
)
CLI = [sys.executable, "-m", "trainer.cli"]


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": kubeconfig, "HOME": str(Path(kubeconfig).parent)}
    return subprocess.run(
        ["kubectl", *args], env=env, input=stdin, capture_output=True, text=True, timeout=timeout, check=True
    )


def wait_until(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_cluster_of_ones_own_trains_a_manifest_applied_with_kubectl_and_stops_on_ctrl_c(
    data_dir: Path, tmp_path: Path
) -> None:
    """`rfsdp cluster up` prints the kubeconfig to export; `rfsdp pipeline manifest | kubectl apply
    -f -` trains with no train step in front of the job (rank 0 makes the run dir and records the
    run's identity); `kubectl wait` sees it succeed; Ctrl-C stops the cluster and every pod."""
    root = tmp_path / "cluster"
    command = [*CLI, "cluster", "up", "--root", str(root)]
    up = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = []
        while not any("Ctrl-C stops" in line for line in printed):
            line = up.stdout.readline()
            assert line, "rfsdp cluster up ended early:\n" + "".join(printed)
            printed.append(line)
        kubeconfig = re.search(r"export KUBECONFIG=(\S+)", "".join(printed))[1]
        shutil.copytree(data_dir, root / "workspace" / "demo" / "data")
        sets = ["training_run=demo", "nnodes=2", "nproc_per_node=1", "steps=12", "ckpt_every=4"]
        manifest = subprocess.run(
            [*CLI, "pipeline", "manifest", *(a for s in sets for a in ("--set", s))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert (
            kubectl(kubeconfig, "apply", "-f", "-", stdin=manifest).stdout.strip()
            == "pytorchjob.kubeflow.org/demo created"
        )
        kubectl(kubeconfig, "wait", "--for=condition=Succeeded", "pytorchjob/demo", "--timeout=300s", timeout=320)
        run = root / "workspace" / "demo" / "run"
        assert (run / "config.json").is_file()
        assert [(e.status, e.step) for e in select(read_events(run), RunEnd)] == [("completed", 12)]
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    finally:
        up.kill()
    assert up.returncode == 0 and "stopping the cluster and its pods" in rest, rest
    assert_nothing_of_the_run_left(run)


def test_a_pipelines_job_deleted_with_kubectl_fails_the_step_and_is_logged_failed(tmp_path: Path) -> None:
    """`kubectl delete pytorchjob NAME` while the pipeline's job trains: the train step fails,
    saying the job was deleted and printing its events, and the exit handler records the failed
    run in MLflow with that reason."""
    import mlflow

    settings = [
        "backend=kubernetes",
        "training_run=deleted",
        "nnodes=2",
        "nproc_per_node=1",
        "steps=150",
        "ckpt_every=50",
    ]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    root = tmp_path / "root"
    run = root / "workspace" / "deleted" / "run"
    cli = [*CLI, "pipeline", "run-local", "--root", str(root), *(a for s in settings for a in ("--set", s))]
    with subprocess.Popen(cli, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            wait_until(
                lambda: (run / "events.jsonl").is_file() and any(e.step >= 5 for e in select(read_events(run), Step)),
                300,
                "step 5",
            )
            kubectl(str(root / "cluster" / "admin.kubeconfig"), "delete", "pytorchjob", "deleted", "--wait=false")
            out, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
    assert proc.returncode == 1, out[-6000:]
    steps_log = (root / "steps.log").read_text()
    assert "PyTorchJob default/deleted was deleted while it ran (its events are above)" in steps_log
    assert (
        "--- events of PyTorchJob default/deleted" in steps_log and "Killing" in steps_log
    )  # the pods' stop, in the events
    client = mlflow.MlflowClient(tracking_uri=uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("resilient-fsdp").experiment_id])
    assert logged.info.status == "FAILED" and logged.data.tags["rfsdp.failed_step"] == "train"
    assert "was deleted while it ran" in logged.data.tags["rfsdp.failure_reason"]
