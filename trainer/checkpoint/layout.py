"""Where a run's checkpoints lie: ``checkpoints/step_NNNNNN/`` (published), ``latest`` (the
newest one's name), and what a directory's manifest says of its size and signature: the names
and the pointer only (:mod:`trainer.checkpoint.checkpointer` writes them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
_PUBLISHED = re.compile(r"^step_(\d{6})$")


def step_dir_name(step: int) -> str:
    """``step_000120`` for step 120."""
    return f"step_{step:06d}"


def published_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoint directories as ``(step, path)``, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m[1]), p) for p in Path(root).iterdir() if (m := _PUBLISHED.match(p.name)) and p.is_dir()]
    return sorted(found)


def checkpoint_bytes(path: Path) -> int:
    """Total size of a published checkpoint's files, from its manifest."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    return sum(f["size"] for f in manifest["files"].values())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The directory ``checkpoints/latest`` points at (None when there is none, or when it holds
    anything but a checkpoint's name: any bytes, never a path elsewhere; resume repairs it).
    """
    name = latest_text(Path(run_dir) / CHECKPOINTS)
    if name is None or not _PUBLISHED.match(name):
        return None
    return Path(run_dir) / CHECKPOINTS / name


def latest_text(root: Path) -> str | None:
    """What ``root/latest`` holds, any bytes made printable (None: no such file or unreadable)."""
    try:
        return (Path(root) / LATEST).read_bytes().decode("utf-8", errors="backslashreplace").strip()
    except OSError:
        return None


def latest_is_corrupt(run_dir: Path) -> bool:
    """``checkpoints/latest`` exists but names no checkpoint (garbage, not UTF-8, a path)."""
    text = latest_text(Path(run_dir) / CHECKPOINTS)
    return text is not None and not _PUBLISHED.match(text)


def is_signed(path: Path) -> bool:
    """Whether a checkpoint's manifest carries a signature (whatever its key)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "signature" in manifest
