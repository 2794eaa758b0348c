"""Writing and reading ``events.jsonl``: whole appends under a lock, readers that take any bytes."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

from trainer.events.records import EVENTS_FILE, E, Event, Fatal, RunEnd, RunStart, from_record, to_record

RESERVE_FILE = ".events.reserve"
"""Beside ``events.jsonl``: room held for the last words of a run on a full volume (:class:`EventLog`)."""
RESERVE_BYTES = 64 * 1024
_RESERVE_CHUNK = 16 * 1024


class EventLog:
    """Appends events of one rank to a run directory's ``events.jsonl``.

    An append is whole or absent: a write cut short (a full volume, a quota, a file size limit)
    is undone under the lock and raises an ``OSError`` with the cause's errno, naming the file.
    Each append starts on a new line, so a line torn by a writer killed mid-write (which no
    reader can use) never takes the next event with it.

    The last words of a run, ``fatal`` and ``run_end``, must reach the file on a full volume
    too: the ranks restarted by ft_launcher, the launcher and ``rfsdp train`` learn from the
    ``fatal`` event that no restart can help. Every other append first makes sure that
    :data:`RESERVE_BYTES` past its end are allocated to ``events.jsonl`` itself (``fallocate``,
    keeping the size): when the volume has no room for that, the append is refused (ENOSPC), and
    the last words are written into that room, which no other file can take. Where the file
    system cannot preallocate (NFS before 4.2), ``RUN_DIR/.events.reserve`` holds the room
    instead (incompressible, so really allocated): a last word that meets a full volume shrinks
    it a chunk at a time, under the lock, and tries again.
    """

    LAST_WORDS: ClassVar[tuple[type[Event], ...]] = (Fatal, RunEnd)

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.reserve = Path(run_dir) / RESERVE_FILE
        self.rank = rank
        self.host = socket.gethostname()
        self._reserve_checked = False
        self._preallocates = True  # until the file system says it cannot

    def emit(self, event: E) -> E:
        """Append one event, stamped with the time, this log's rank and host; returns the stamped event.

        Raises:
            OSError: nothing was appended (the errno of the cause; the message names the file).
        """
        event = dataclasses.replace(event, time=time.time(), rank=self.rank, host=self.host)
        line = (json.dumps(to_record(event)) + "\n").encode()
        last_word = isinstance(event, self.LAST_WORDS)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            # O_APPEND alone is atomic on a local file system, not on NFS (a ReadWriteMany volume),
            # where the client appends at the end it last saw; taking a POSIX lock makes it
            # revalidate the file first. A writer that dies releases its lock with it.
            fcntl.lockf(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a writer died mid-line: end that line first
                line = b"\n" + line
            if not last_word and self._preallocates:
                self._preallocates = _keep_room(fd, size + len(line), self.path)
            while True:
                try:
                    _append_whole(fd, line, size, self.path)
                    break
                except OSError as e:
                    if not (last_word and e.errno in (errno.ENOSPC, errno.EDQUOT) and _release_reserve(self.reserve)):
                        raise
        finally:
            os.close(fd)
        if not self._reserve_checked and not last_word:  # (a last word may have just used it)
            self._reserve_checked = True
            _make_reserve(self.reserve)
        return event


def _append_whole(fd: int, data: bytes, size: int, path: Path) -> None:
    """Append ``data`` to ``fd`` (opened ``O_APPEND``, locked, ``size`` bytes long): all of it,
    or nothing (a short write is continued; an error truncates the file back to ``size``).
    """
    done = 0
    try:
        while done < len(data):
            written = os.write(fd, data[done:])
            if written <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += written
    except OSError as e:
        if done:  # (a truncate, even to the same size, would also drop the room kept past the end)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        code = e.errno if e.errno is not None else errno.EIO
        raise OSError(
            code, f"{e.strerror or e}: no event appended ({done} of {len(data)} bytes written, undone)", str(path)
        ) from e


_FALLOC_FL_KEEP_SIZE = 1  # <linux/falloc.h>
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _keep_room(fd: int, end: int, path: Path) -> bool:
    """Allocate :data:`RESERVE_BYTES` of ``fd``'s file past ``end`` (its size unchanged), for the
    last words; False when the file system cannot preallocate.

    Raises:
        OSError: ENOSPC or EDQUOT, naming ``path``: the volume has no room left but the reserve.
    """
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, end, RESERVE_BYTES) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(
            code, f"{os.strerror(code)}: no event appended (the room left is kept for the run's last words)", str(path)
        )
    return False


def _make_reserve(path: Path) -> None:
    """Make the reserve of last words whole (best effort: a full volume has no room for it)."""
    with contextlib.suppress(OSError):
        if path.stat().st_size >= RESERVE_BYTES:
            return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _append_whole(fd, os.urandom(RESERVE_BYTES), 0, tmp)  # random: a compressing file system must allocate it
        finally:
            os.close(fd)
        os.replace(tmp, path)  # atomic: of writers racing here, one reserve stays
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _release_reserve(path: Path) -> bool:
    """Give back a chunk of the reserve of last words to the volume; False when none is left.
    Called under the events lock, which every writer of the reserve's size holds.
    """
    try:
        size = path.stat().st_size
        if size > _RESERVE_CHUNK:
            os.truncate(path, size - _RESERVE_CHUNK)
        else:
            path.unlink()
    except OSError:
        return False
    return size > 0


def read_events(run_dir: Path, kinds: Iterable[type[Event]] | None = None) -> list[Event]:
    """All events of a run (of ``kinds`` only, when given), in file order; see :func:`iter_events`."""
    return list(iter_events(run_dir, kinds))


def iter_events(run_dir: Path, kinds: Iterable[type[Event]] | None = None) -> Iterator[Event]:
    """A run's events in file order, read line by line; lines that are not events (torn by
    killed writers, foreign bytes) are skipped. With ``kinds``, a line of another kind (the kind
    is written first) is skipped unparsed: a run of days writes millions of lines, mostly steps
    and checkpoints.
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    wanted = None if kinds is None else frozenset(cls.KIND for cls in kinds)
    with path.open("rb") as lines:
        for _, event, _ in _parse(lines, wanted):
            if event is not None:
                yield event


def parse_event_lines(text: str | bytes) -> Iterator[Event]:
    """The events in ``text``, skipping lines that are not events (see :func:`_parse`)."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    for _, event, _ in _parse(data.split(b"\n")):
        if event is not None:
            yield event


def corrupt_lines(run_dir: Path) -> list[int]:
    """Line numbers (from 1) of ``events.jsonl`` that are not (only) an event: torn or foreign
    lines, which every reader skips, and the torn start of a line glued to a complete event
    (reported once, by the run's summary).
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    with path.open("rb") as lines:
        return [n for n, _, whole in _parse(lines) if not whole]


_KIND_PREFIX = b'{"event": "'
"""How every line :class:`EventLog` writes begins (see :func:`to_record`). ``json.dumps`` escapes
every quote inside a value, so these bytes occur in a line only where an event begins."""


def _parse(lines: Iterable[bytes], wanted: frozenset[str] | None = None) -> Iterator[tuple[int, Event | None, bool]]:
    """Each line's number, its event (None: none) and whether the line is that event and
    nothing else. Any bytes are taken. A line that is not an event but holds a complete event
    after the start of another (what a writer killed mid-line left, glued to the next writer's
    line by an older writer) yields that complete event: the last place an event begins. Lines
    whose last event's written kind is not ``wanted`` are left out unparsed.
    """
    skip = len(_KIND_PREFIX)
    for n, line in enumerate(lines, start=1):
        line = line.rstrip(b"\n")
        if not line:
            continue
        at = line.rfind(_KIND_PREFIX)
        if wanted is not None and at >= 0:
            kind = line[at + skip : line.find(b'"', at + skip)]
            if kind.decode("utf-8", "replace") not in wanted:
                continue
        event = _event_of(line)
        if event is not None:
            yield n, event, True
        else:
            yield n, _event_of(line[at:]) if at > 0 else None, False


def _event_of(data: bytes) -> Event | None:
    """The event ``data`` holds, all of it (None: anything else)."""
    try:
        return from_record(json.loads(data.decode("utf-8")))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested beyond the parser
        return None


class EventTail:
    """Follows a run's ``events.jsonl`` as it grows: each :meth:`new` returns the events
    appended since the last call (complete lines only).

    Args:
        run_dir: the run directory.
        start: the byte offset to follow from (default: the file's size now).
    """

    def __init__(self, run_dir: Path, *, start: int | None = None) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self._seen = start if start is not None else self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[Event]:
        """Events completed since the last call (those present at construction are skipped)."""
        if not self.path.exists() or self.path.stat().st_size <= self._seen:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._seen)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._seen += len(complete)
        return list(parse_event_lines(complete))


def first_run_start_line(path: Path) -> bytes | None:
    """The raw line of the first ``run_start`` in an events file (a run dir's identity): from
    where that event begins, should a torn line precede it on the same line.
    """
    with open(path, "rb") as f:
        for line in f:
            for _, event, whole in _parse([line], frozenset({RunStart.KIND})):
                if isinstance(event, RunStart):
                    return line if whole else line[line.rfind(_KIND_PREFIX) :]
    return None


# --------------------------------------------------------------------------- the questions asked of a run
