"""A test that times out (or fails) leaves no process behind, whatever session it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.reaper import TAG_ENV, alive, kill_tagged, untagged_env

TESTS = Path(__file__).resolve().parents[1]

# Starts a process in its own session (as rfsdp train starts each launcher), then hangs past its timeout.
HANGING_TEST = """
import subprocess, sys, time
from pathlib import Path
import pytest

@pytest.mark.timeout(2)
def test_hangs(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    Path({pid_file!r}).write_text(str(proc.pid))
    time.sleep(60)
"""


def run_hanging_test(tmp_path: Path, *, reaper: bool) -> int:
    """Run HANGING_TEST in its own pytest (with or without the reaper); returns the pid it left."""
    pid_file = tmp_path / "pid"
    (tmp_path / "test_hang.py").write_text(HANGING_TEST.format(pid_file=str(pid_file)))
    conftest = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom reaper import reap_test_processes  # noqa: F401\n"
    (tmp_path / "conftest.py").write_text(conftest if reaper else "")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_hang.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Timeout" in proc.stdout, proc.stdout[-2000:]
    return int(pid_file.read_text())


def test_a_timed_out_test_leaves_no_process(tmp_path: Path) -> None:
    (tmp_path / "with").mkdir()
    assert not alive(run_hanging_test(tmp_path / "with", reaper=True))


def test_without_the_reaper_the_process_would_outlive_the_test(tmp_path: Path) -> None:
    (tmp_path / "without").mkdir()
    pid = run_hanging_test(tmp_path / "without", reaper=False)
    try:
        assert alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_process_caught_in_exec_is_still_reaped() -> None:
    """Right after Popen returns, the child may still be in exec, showing no environment yet.

    On a busy machine a scan can pass it there (CI saw one survive its test); busy loops on
    every core make that likely: without the reaper's second look, several of 100 survive here.
    """
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], env=untagged_env()) for _ in range(3)]
    test_tag, survivors = os.environ[TAG_ENV], []
    try:
        for _ in range(100):
            os.environ[TAG_ENV] = tag = uuid.uuid4().hex
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            os.environ[TAG_ENV] = test_tag
            kill_tagged(tag)
            if alive(proc.pid):
                survivors.append(proc.pid)
            proc.kill()
            proc.wait()
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    assert not survivors


@pytest.fixture(scope="module")
def module_process() -> subprocess.Popen:
    """A process of a fixture wider than one test (like a session's server)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc
    proc.kill()
    proc.wait()


def test_processes_of_wider_fixtures_live_on_1(module_process: subprocess.Popen) -> None:
    assert module_process.poll() is None


def test_processes_of_wider_fixtures_live_on_2(module_process: subprocess.Popen) -> None:
    assert module_process.poll() is None


@pytest.fixture(scope="module")
def restartable() -> list[subprocess.Popen]:
    """A wider fixture's process that a test may restart (as the MLflow outage test restarts the server)."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_wider_process_restarted_untagged_1(restartable: list[subprocess.Popen]) -> None:
    restartable.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=untagged_env()))
    restartable.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))


def test_a_wider_process_restarted_untagged_2(restartable: list[subprocess.Popen]) -> None:
    untagged, tagged = restartable
    assert untagged.poll() is None  # spared by the first test's reaper
    assert tagged.poll() is not None  # what a test starts with its tag ends with the test
