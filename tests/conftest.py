"""Shared fixtures: a prepared data set and helpers that run real `rfsdp train` jobs."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reaper import (
    reap_test_processes,  # noqa: F401 (autouse: a test's processes end with it)
    untagged_env,
)
from trainer.checkpoint import local_tier_dir
from trainer.data import BUILTIN_CORPUS
from trainer.data.shards import builtin_corpus_text, prepare_tokens
from trainer.events import Failure, final_losses, read_events, select
from trainer.rank.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# The folder is the tier: tests/unit starts no process (`make check`), tests/integration runs real
# processes (jobs, CLI subprocesses, servers), tests/e2e whole pipelines and emulated clusters.
TIER_MARKS = {"integration": ("slow",), "e2e": ("slow", "e2e")}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its folder (``-m "not slow"``, ``-m e2e`` select by tier)."""
    tests = ROOT / "tests"
    for item in items:
        if item.path.is_relative_to(tests):
            for mark in TIER_MARKS.get(item.path.relative_to(tests).parts[0], ()):
                item.add_marker(mark)


def as_unprivileged(command: list[str]) -> list[str]:
    """``command`` run as the unprivileged user nobody when this is root (as it is otherwise).

    Skips the test where that cannot be done here: no ``setpriv``, or a checkout nobody can read
    (a clone under a 0700 folder, such as ``mktemp -d``'s).
    """
    if os.geteuid() != 0:
        return command
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv: cannot drop privileges to check the refusal")
    probe = subprocess.run(
        [*NOBODY, sys.executable, "-m", "trainer.cli", "--help"], cwd=ROOT, capture_output=True, timeout=120
    )
    if probe.returncode:
        pytest.skip(f"an unprivileged user cannot read this checkout ({ROOT}, e.g. under a 0700 directory)")
    return [*NOBODY, *command]


def need_a_mount_namespace() -> None:
    """Skip the test unless this process can mount a tmpfs in a mount namespace of its own (root, ``unshare``)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    if not shutil.which("unshare"):
        pytest.skip("no unshare: cannot mount a tmpfs in a mount namespace of its own")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name`` that ``make`` fills once per test session, also when pytest-xdist splits
    the session across workers: the first worker to ask makes it under a file lock in the folder
    the workers share, the others wait for it and read it. Only for what tests read, never change.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # each worker's temp folder is one level under the session's
    path, made = base / name, base / f"{name}.made"
    with FileLock(base / f"{name}.lock"):
        if not made.exists():
            shutil.rmtree(path, ignore_errors=True)  # a worker that failed while making it
            path.mkdir(parents=True)
            make(path)
            made.touch()
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made_once(
        tmp_path_factory, "data", lambda out: prepare_tokens(builtin_corpus_text(), out, source=BUILTIN_CORPUS)
    )


def rfsdp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `rfsdp` CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def rfsdp_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """Run the `rfsdp` CLI in this process (for refusals, which start nothing): exit code, stderr.
    The CLI's SIGTERM handler, which it installs in the main thread, is put back afterwards.
    """
    import signal

    from trainer.cli import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, capsys.readouterr().err


def train(
    data: Path, run_dir: Path, *extra: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`rfsdp train` with the tiny model on 2 CPU workers."""
    proc = rfsdp("train", "--quiet", "--data", str(data), "--run-dir", str(run_dir), *extra, timeout=timeout)
    if check and proc.returncode != 0:
        logs = (
            "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
            if (run_dir / "logs").exists()
            else ""
        )
        raise AssertionError(f"rfsdp train failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs}")
    return proc


def assert_nothing_of_the_run_left(run_dir: Path, *, within_s: float = 10) -> None:
    """No process of the run (its command line names ``--run-dir``) outlives it by more than
    ``within_s``: NVRx's in-process monitor, double-forked in its own session with its rank's
    command line, notices its rank gone only at its next 1 s poll, after ``rfsdp train`` exits.
    """
    deadline = time.monotonic() + within_s
    while leftovers := subprocess.run(
        ["pgrep", "-f", f"--run-dir {run_dir}"], capture_output=True, text=True
    ).stdout.split():
        assert time.monotonic() < deadline, f"processes of {run_dir} left: {leftovers}"
        time.sleep(0.2)


def losses(run_dir: Path) -> dict[int, float]:
    return final_losses(read_events(run_dir))


def why_it_restarted(run_dir: Path) -> str:
    """For an assertion's message: the run's failure events and what its launchers logged about
    timeouts, failed ranks and restarts (a restart that should not have happened, seen only in CI).
    """
    failures = [repr(failure) for failure in select(read_events(run_dir), Failure)]
    marks = ("timeout", "timed out", "heartbeat", "section", "failed", "restart", "error", "killed", "signal")
    logged = [
        f"{log.name}: {line[:300]}"
        for log in sorted((run_dir / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if any(mark in line.lower() for mark in marks) and "waitForInput" not in line
    ]
    return "\n".join(["failure events:", *failures, "launcher lines:", *logged[-60:]])


def tier_of(run: Path) -> Path:
    """The run's local tier folder on this machine (from the config the launcher recorded)."""
    cfg = TrainConfig.from_mapping({**json.loads((run / "config.json").read_text()), "data": "-", "run_dir": str(run)})
    return local_tier_dir(run, cfg.trajectory_hash())


@pytest.fixture(scope="session")
def baseline_60(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 60-step run (checkpoints every 10): the reference trajectory."""
    return made_once(tmp_path_factory, "baseline", lambda d: train(data_dir, d / "run", "--steps", "60")) / "run"


@pytest.fixture(scope="session")
def sync_resumed_60(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference trajectory with sync checkpoints, stopped at step 30 and resumed to 60."""

    def make(folder: Path) -> None:
        run = folder / "run"
        train(data_dir, run, "--steps", "60", "--stop-at-step", "30", "--ckpt-mode", "sync")
        assert max(losses(run)) == 30
        train(data_dir, run, "--steps", "60", "--ckpt-mode", "sync")

    return made_once(tmp_path_factory, "sync_resumed", make) / "run"


S3_SECRET = "rfsdp-test-secret-never-logged"
_BUCKETS = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3-compatible server (moto's server mode) on a free loopback port for the session;
    yields its endpoint URL. The process environment (inherited by `rfsdp` subprocesses) points
    boto3 at it with test credentials and no AWS config files.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    none = str(tmp_path_factory.mktemp("aws") / "none")
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "rfsdp-test-key",
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": none,
        "AWS_SHARED_CREDENTIALS_FILE": none,
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        yield endpoint
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket on the test S3 server, as ``s3://name``."""
    import re

    import boto3

    name = f"b{next(_BUCKETS)}-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


class MlflowServer:
    """A real ``mlflow server`` (sqlite backend, its own artifact root) on a free loopback port."""

    def __init__(self, root: Path) -> None:
        from trainer.launch.local import free_port

        # Below the ephemeral range: the outage test starts it again on this port, and a port the
        # kernel hands out for port 0 (another job's gloo listener) could have taken it meanwhile.
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240) -> None:  # ~10 s on an idle 2-core machine, minutes under load
        import time
        import urllib.request

        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
        ]
        with open(self.root / "server.log", "ab") as log:  # the child keeps its own copy of the descriptor
            # The session owns the server, also when a test restarts it: the test's reaper must spare it.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=untagged_env()
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server not healthy after {timeout} s")

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its workers
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real MLflow tracking server for the session (a test may stop and restart it)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def faulty_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 30-step run with an in-process (exception) and an in-job (SIGKILL) recovery."""
    return (
        made_once(
            tmp_path_factory,
            "faulty",
            lambda d: train(data_dir, d / "async-faults", "--steps", "30", "--fault", "exception@12:1,sigkill@22:0"),
        )
        / "async-faults"
    )
