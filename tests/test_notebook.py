"""The comparison notebook runs headless (papermill) against a small real experiment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, MlflowServer, train
from trainer.results import compare
from trainer.results.tracking import log_run

pytestmark = pytest.mark.slow

NOTEBOOK = ROOT / "notebooks" / "compare_experiments.ipynb"


def test_notebook_is_stored_clean_with_parameters() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "experiment =" in params[0].source and "tracking_uri =" in params[0].source
    assert nb.metadata.kernelspec.name == "python3"


def test_notebook_compares_real_runs(data_dir: Path, faulty_run: Path, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    sync_run = tmp_path / "sync-nofaults"
    train(data_dir, sync_run, "--steps", "20", "--ckpt-mode", "sync", "--ckpt-every", "5")
    ids = {log_run(run, tracking_uri=mlflow_server.uri, experiment="notebook") for run in (faulty_run, sync_run)}

    # the notebook's module reads back what was logged: same runs, same summary figures
    runs = compare.load_runs("notebook", mlflow_server.uri)
    assert {r.run_id for r in runs} == ids
    client = MlflowClient(mlflow_server.uri)
    table = compare.comparison_table(runs)
    for r in runs:
        logged = client.get_run(r.run_id).data.metrics
        assert table.loc[r.label, "goodput"] == pytest.approx(logged["goodput"])
        assert table.loc[r.label, "restarts in-job"] == logged["restarts_in_job"]
    assert table.loc["sync-nofaults", "mode"] == "sync" and table.loc["sync-nofaults", "restarts in-process"] == 0
    assert table.loc["async-faults", "restarts in-process"] >= 1 and table.loc["async-faults", "restarts in-job"] >= 1
    assert set(compare.checkpoint_blocking(runs)["mode"]) == {"sync", "async"}

    # headless execution with a kernel of this venv's python
    kernels = tmp_path / "jupyter"
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--prefix", str(kernels), "--name", "python3"], check=True, capture_output=True
    )
    env = {**os.environ, "JUPYTER_PATH": str(kernels / "share" / "jupyter"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = tmp_path / "executed.ipynb"
    cmd = [
        sys.executable,
        "-m",
        "papermill",
        str(NOTEBOOK),
        str(out),
        "-p",
        "experiment",
        "notebook",
        "-p",
        "tracking_uri",
        mlflow_server.uri,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "".join(o.data.get("text/html", "") for o in outputs if "data" in o)
    for name in ("async-faults", "sync-nofaults", "goodput", "restarts in-job", "ckpt blocking p50 s"):
        assert name in html
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # timelines, checkpoint blocking by mode, goodput
