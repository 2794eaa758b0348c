"""Small durable-filesystem helpers shared by data prep, checkpoints and events."""

from __future__ import annotations

import filecmp
import hashlib
import os
import shutil
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


def sync_tree(src: Path, dst: Path) -> int:
    """Copy what ``dst`` lacks of ``src``: each file whose copy is missing or differs (size and
    modification time, which the copy keeps) goes to a temporary name, then over the old one by
    rename. A reader of the old file (a worker that mapped a shard) keeps reading it whole, never
    a truncated one. Returns how many files were copied.
    """
    copied = 0
    for source in sorted(Path(src).rglob("*")):
        target = Path(dst) / source.relative_to(src)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        if target.exists() and filecmp.cmp(source, target, shallow=True):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        shutil.copy2(source, tmp)
        os.replace(tmp, target)
        copied += 1
    return copied
