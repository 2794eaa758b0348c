"""The comparison notebook executed headless (papermill) against small real experiments in a real
MLflow server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.conftest import ROOT, MlflowServer, train
from trainer.results import compare
from trainer.results.tracking import log_run

NOTEBOOK = ROOT / "notebooks" / "compare_experiments.ipynb"
FIGURES = {"loss_vs_reference", "wall_time", "recovery_by_layer", "lost_steps", "throughput", "timeline", "checkpoints"}
"""The figures the notebook writes to ``figures_dir`` (NAME.png), one per question it answers."""


def papermill(tmp_path: Path, out: Path, *params: str) -> nbformat.NotebookNode:
    """Execute the notebook headless with a kernel of this venv's python; returns the executed notebook."""
    kernels = tmp_path / "jupyter"
    if not kernels.exists():
        cmd = [sys.executable, "-m", "ipykernel", "install", "--prefix", str(kernels), "--name", "python3"]
        subprocess.run(cmd, check=True, capture_output=True)
    env = {
        **os.environ,
        "JUPYTER_PATH": str(kernels / "share" / "jupyter"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    cmd = [sys.executable, "-m", "papermill", str(NOTEBOOK), str(out)]
    for i in range(0, len(params), 2):
        cmd += ["-p", params[i], params[i + 1]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nb = nbformat.read(out, as_version=4)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    return nb


def outputs(nb: nbformat.NotebookNode) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_notebook_compares_real_runs(
    data_dir: Path, faulty_run: Path, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    from mlflow import MlflowClient  # here: the fast tier's tests need no MLflow

    # the reference of the faulty run: its trajectory without faults, in the other checkpoint mode
    sync_run = tmp_path / "sync-nofaults"
    train(data_dir, sync_run, "--steps", "30", "--ckpt-mode", "sync", "--ckpt-every", "5")
    uri = mlflow_server.uri
    ids = {log_run(run, tracking_uri=uri, experiment="notebook") for run in (faulty_run, sync_run)}
    ids.add(log_run(faulty_run, tracking_uri=uri, experiment="notebook-b"))  # the same name in two experiments
    client = MlflowClient(uri)
    client.create_experiment("notebook-empty")

    # the notebook's module reads back what was logged: same runs, same summary figures
    runs = compare.load_runs(["notebook", "notebook-b"], uri).runs
    assert {r.run_id for r in runs} == ids
    assert sorted(r.label for r in runs) == ["notebook-b/async-faults", "notebook/async-faults", "sync-nofaults"]
    table = compare.comparison_table(runs)
    for r in runs:
        logged = client.get_run(r.run_id).data.metrics
        assert table.loc[r.label, "goodput"] == pytest.approx(logged["goodput"])
        assert table.loc[r.label, "restarts in-job"] == logged["restarts_in_job"]
    assert table.loc["sync-nofaults", "ckpt mode"] == "sync" and table.loc["sync-nofaults", "restarts in-process"] == 0
    assert (
        table.loc["notebook/async-faults", "restarts in-process"] >= 1
        and table.loc["notebook/async-faults", "restarts in-job"] >= 1
    )
    assert set(compare.checkpoint_blocking(runs)["kind"]) == {
        "sync",
        "async",
        "local",
    }  # the tiny model's local tier: on by default
    agreement = compare.reference_agreement(compare.loss_vs_reference(runs))
    assert set(agreement.index) == {"notebook/async-faults", "notebook-b/async-faults"}
    assert set(agreement["reference"]) == {"sync-nofaults"} and agreement["exact"].all()  # exact resume

    figures = tmp_path / "figures"
    nb = papermill(
        tmp_path,
        tmp_path / "executed.ipynb",
        "experiments",
        "notebook,notebook-b",
        "tracking_uri",
        uri,
        "figures_dir",
        str(figures),
    )
    html = "".join(o.data.get("text/html", "") for o in outputs(nb) if "data" in o)
    for column in compare.comparison_table([]).columns:
        assert f">{column}<" in html
    for name in ("sync-nofaults", "notebook-b/async-faults", *compare.TIME_CATEGORIES, "max abs difference"):
        assert name in html
    assert len([o for o in outputs(nb) if "image/png" in o.get("data", {})]) == len(FIGURES)
    assert {p.stem for p in figures.glob("*.png")} == FIGURES

    # experiments without runs: a message, every cell runs, nothing is plotted
    nb = papermill(
        tmp_path, tmp_path / "empty.ipynb", "experiments", "notebook-empty,no-such-experiment", "tracking_uri", uri
    )
    text = "".join(o.get("text", "") for o in outputs(nb) if o.output_type == "stream")
    assert "0 run(s)" in text and "Nothing to compare" in text
    assert "'notebook-empty' holds no run" in text and "no MLflow experiment named 'no-such-experiment'" in text
    assert not [o for o in outputs(nb) if "data" in o]
