"""Every process a test starts ends with the test, however the test ends (a failure, a timeout).

A test's processes carry a tag in their environment, which every child inherits, also one that
starts its own session or outlives its parent (a launcher's ranks, a background writer, a server).
After the test, whatever still carries the tag is killed. Processes that fixtures of a wider scope
start (a session's MLflow server) are started before the tag is set and live on; a test that
restarts such a process starts it with ``untagged_env()``.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

TAG_ENV = "RFSDP_TEST_PROCESS_TAG"


def tagged_processes(tag: str, pending: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """Live processes whose environment carries ``tag``, and those that may be about to.

    The second list holds processes whose environment reads empty and that are children of this
    process or of a tagged one, or were pending in an earlier scan (``pending``: their parent may
    have been killed since): a process in the middle of ``exec`` (which ``Popen`` has already
    returned from) shows no environment for a moment, so one scan can miss it.
    """
    needle = f"{TAG_ENV}={tag}".encode()
    found, blank = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except FileNotFoundError:  # gone meanwhile
            continue
        except OSError:  # not ours to read, or in the middle of exec: looked at as blank
            environ = b""
        pid = int(entry.name)
        if not alive(pid):
            continue
        if needle in environ.split(b"\0"):
            found.append(pid)
        elif not environ:
            blank.append(pid)
    return found, [pid for pid in blank if pid in pending or parent(pid) in {os.getpid(), *found}]


def parent(pid: int) -> int | None:
    """The parent of ``pid``, or None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def untagged_env() -> dict[str, str]:
    """This environment without the test's tag, for a process a wider-scoped fixture owns."""
    return {key: value for key, value in os.environ.items() if key != TAG_ENV}


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its parent has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_tagged(tag: str, *, rounds: int = 20, pending_s: float = 30) -> list[int]:
    """SIGKILL every process carrying ``tag`` (again, while some fork as they die); returns them.

    Up to ``rounds`` scans while some are found; past them, scans go on (for ``pending_s`` in all)
    while a process may still be in its exec: on a loaded machine an exec can take seconds.
    """
    killed: list[int] = []
    exec_pending: list[int] = []
    deadline = time.monotonic() + pending_s
    for scan in itertools.count():
        pids, exec_pending = tagged_processes(tag, frozenset(exec_pending))
        if not pids and not exec_pending:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
        if (scan + 1 >= rounds and not exec_pending) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return killed


@pytest.fixture(autouse=True)
def reap_test_processes() -> Iterator[None]:
    """Tag the processes this test starts; kill whatever of them is left when it ends."""
    tag = uuid.uuid4().hex
    os.environ[TAG_ENV] = tag
    try:
        yield
    finally:
        del os.environ[TAG_ENV]
        kill_tagged(tag)
