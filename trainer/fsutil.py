"""Small durable-filesystem helpers shared by data prep, checkpoints and events."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path


def file_sha256(path: Path, chunk: int = 8 << 20, *, progress: Callable[[], None] = lambda: None) -> str:
    """SHA-256 of a file, read in chunks (``progress`` is called after each)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            progress()
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_temp(path: Path, text: str) -> Path:
    """``text`` written and synced to a temporary file beside ``path``; returns that file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old or the whole new file."""
    path = Path(path)
    os.replace(_durable_temp(path, text), path)
    fsync_dir(path.parent)


def create_text(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` durably unless ``path`` exists (atomic: of several writers, one
    file is made, whole); False when it existed.
    """
    path = Path(path)
    tmp = _durable_temp(path, text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_dir(path.parent)
    return True
