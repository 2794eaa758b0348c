"""A tracking server that goes down mid-run and comes back (issue 37): a real ``mlflow server``,
a real ``rfsdp train``, a real outage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from mlflow import MlflowClient

from tests.conftest import ROOT, MlflowServer
from trainer.events import RunEnd, Step, final_losses, read_events

OUTAGE_S = float(os.environ.get("RFSDP_TEST_OUTAGE_S", "6"))
"""How long the server stays down before it is started again (the issue's scenario says a minute;
``RFSDP_TEST_OUTAGE_S=60`` runs it as written). The server is down longer: its own start adds
seconds. 6 s is more than the live logger's 5 s interval, so at least one of its attempts fails
and the steps of the outage pile up in its buffer."""


def _steps(run: Path) -> list[Step]:
    return [e for e in read_events(run, [Step]) if isinstance(e, Step)]


def _loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


def test_an_outage_of_the_tracking_server_mid_run_loses_and_repeats_nothing(
    data_dir: Path, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """The server is stopped while ``rfsdp train --tracking-uri`` logs a run live, kept down for
    ``OUTAGE_S``, then started again on the same port and store. Training goes on throughout
    (steps are written during the outage, none waits on the server); once the server is back,
    the live logger catches up while training still runs: the run's ``loss`` in MLflow then holds
    every step up to at least the one reached when the server came back, each once. (That is
    checked before the run ends on purpose: the final ``log_run`` logs every point again, so the
    final history alone would hide a live logger that dropped or gave up on what it could not
    log.) Preempted, the run exits 0 and its single MLflow run is FINISHED with every step's
    final loss exactly once."""
    run, uri, experiment = tmp_path / "run", mlflow_server.uri, "outage"
    cmd = [
        "train",
        "--quiet",
        "--data",
        str(data_dir),
        "--run-dir",
        str(run),
        "--steps",
        "100000",
        "--ckpt-every",
        "100",
        "--nproc-per-node",
        "1",  # one rank: what is under test is the logging, and a second rank took the other core
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *cmd, "--tracking-uri", uri, "--experiment", experiment],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # it trains until the test preempts it: no race with its end, at any machine speed
    client = MlflowClient(uri)

    def running() -> None:
        assert proc.poll() is None, proc.communicate()

    deadline, run_id = time.monotonic() + 300, None
    while run_id is None:  # logged live: the run exists, RUNNING, with some steps
        running()
        assert time.monotonic() < deadline, "no step logged live"
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        if runs and _loss_steps(client, runs[0].info.run_id):
            assert runs[0].info.status == "RUNNING"
            run_id = runs[0].info.run_id
        time.sleep(0.5)

    mlflow_server.stop()
    try:
        down, at_down = time.time(), max(e.step for e in _steps(run))
        while time.time() < down + OUTAGE_S:
            running()
            time.sleep(1)
    finally:
        mlflow_server.start()  # the same port and backend store
    up = time.time()
    reached = max(e.step for e in _steps(run))
    assert reached > at_down, "no step trained while the server was down"

    deadline = time.monotonic() + 300
    while (logged := _loss_steps(client, run_id))[-1] < reached:  # caught up live
        running()
        assert time.monotonic() < deadline, (
            f"live logging did not catch up: step {logged[-1]} logged, {reached} trained"
        )
        time.sleep(1)
    running()  # still training: what the live logger logged, not the final log_run
    missing = sorted(set(range(1, logged[-1] + 1)) - set(logged))
    twice = sorted(step for step, n in Counter(logged).items() if n > 1)
    assert (missing, twice) == ([], []), f"logged live: steps {missing} missing, {twice} twice"

    proc.send_signal(signal.SIGTERM)  # preempted: it checkpoints the step it reached and logs the whole run
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and f"MLflow run {run_id}" in err, err

    steps = _steps(run)
    times = [e.time for e in steps]
    assert [e.step for e in steps] == list(range(1, len(steps) + 1))  # no fault: each step once, in order
    assert sum(down < t < up for t in times) > 0  # trained while the server was down ...
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # ... and never waited on it: a wait would last most of the outage, however slow the machine
    # (the server's restart, part of the outage, slows with it).
    assert max(gaps) < (up - down) / 2, f"a step waited {max(gaps):.1f} s of the {up - down:.1f} s outage"

    end = [e for e in read_events(run) if isinstance(e, RunEnd)][-1]
    assert end.step == steps[-1].step
    final = client.get_run(run_id)
    assert final.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, end.step + 1))  # every step, once
    assert {m.step: m.value for m in history} == final_losses(read_events(run))
    assert sorted((m.step, m.timestamp) for m in history) == [(e.step, int(e.time * 1000)) for e in steps]
    assert [r.info.run_id for r in client.search_runs([final.info.experiment_id])] == [
        run_id
    ]  # one MLflow run, not two
