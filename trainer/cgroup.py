"""The memory cgroup a process runs in: its limit, and how many processes the kernel's OOM
killer has ended in it.

A container's memory limit is its cgroup's (a Kubernetes pod's ``resources.limits.memory``);
when the processes in it need more, the kernel's OOM killer ends the largest with SIGKILL and
counts it. That count is how a SIGKILL is told apart as an OOM kill (``trainer.launch.worker``
reads it before and after a rank). Both cgroup versions: v2's ``memory.max`` and
``memory.events``, v1's ``memory.limit_in_bytes`` and ``memory.oom_control``.

Only the standard library is imported here: the worker runs it before every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1: any figure above this is none."""


def memory_dir(pid: int | str = "self", root: Path = ROOT) -> Path | None:
    """The memory cgroup folder of ``pid`` (None: no memory controller is mounted where it can be read).

    A container with its own cgroup namespace sees its cgroup as ``/``; one without sees the
    host's path, which is mounted at the same place below ``root``.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            base = root
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        for folder in (base / path.lstrip("/"), base):
            if (folder / "memory.max").is_file() or (folder / "memory.limit_in_bytes").is_file():
                return folder
    return None


def memory_limit(folder: Path | None) -> int | None:
    """The cgroup's memory limit in bytes (None: none set, or no cgroup)."""
    if folder is None:
        return None
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (folder / name).read_text().strip()
        except OSError:
            continue
        if text == "max" or int(text) >= _UNLIMITED_V1:
            return None
        return int(text)
    return None


def oom_kills(folder: Path | None) -> int | None:
    """How many processes the OOM killer has ended in the cgroup (None: the kernel does not say)."""
    if folder is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            lines = (folder / name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def join(folder: Path, pid: int | None = None) -> None:
    """Move ``pid`` (default: this process) into the cgroup ``folder`` (root, or its owner)."""
    (folder / "cgroup.procs").write_text(str(pid or os.getpid()))
