"""How one checkpoint's tensor state is written: the :class:`CheckpointWriter` protocol, the hooks
a save lends it (:class:`SaveHooks`), the synchronous baseline :class:`SyncDcpWriter`, and each
rank's checksum file of its part. The NVRx background writer is ``trainer.rank.resilience``'s;
publication, retention and resume are ``trainer.checkpoint``'s.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer.checkpoint.digests import digests_file, write_digests
from trainer.checkpoint.trust import rank_state_file, sign_rank_checksums
from trainer.fsutil import atomic_write_text, file_sha256


class CheckpointWriteError(RuntimeError):
    """A background write failed on at least one rank (raised on every rank alike)."""


def write_rank_checksums(directory: Path, rank: int, *, heartbeat: Callable[[], None] = lambda: None) -> None:
    """Hash this rank's files of a checkpoint and record them durably (``checksums_rank<R>.json``).

    Runs right after the rank's shard is written: in the background worker for async saves, in
    the loop (``heartbeat`` called as it reads) for sync ones. The rank's digest record, when it
    has one (:mod:`trainer.checkpoint.digests`), is among them.
    """
    directory = Path(directory)
    names = [p.name for p in directory.glob(f"__{rank}_*.distcp")] + [rank_state_file(rank)]
    if (directory / digests_file(rank)).is_file():
        names.append(digests_file(rank))
    record = {
        name: {"size": (directory / name).stat().st_size, "sha256": file_sha256(directory / name, progress=heartbeat)}
        for name in names
    }
    atomic_write_text(
        directory / f"checksums_rank{rank}.json", json.dumps(sign_rank_checksums(record, directory.name, rank))
    )


def _no_phase_hook(phase: str) -> None:
    """Default ``on_phase``: nothing happens at a phase."""


@dataclass(frozen=True, slots=True)
class SaveHooks:
    """What the loop around a save lends the writer for that save."""

    on_phase: Callable[[str], None] = _no_phase_hook
    """Called as the save reaches each of ``SAVE_PHASES`` (fault injection fires here)."""
    atomic: Callable[[], AbstractContextManager] = nullcontext
    """A section that in-process restart must not interrupt (sending a write to a worker)."""
    heartbeat: Callable[[], None] = lambda: None
    """Called through work that may take seconds (buffers made, a sync save's writes), so that
    hang detection does not take it for a hang."""
    meet: Callable[[], None] = lambda: None
    """Waits for every rank, beating the heartbeat, where ranks may arrive seconds apart (after the
    buffers are made) and the next collective is on ``group``, whose timeout is a training
    collective's."""


class CheckpointWriter(Protocol):
    """Writes the tensor state of one checkpoint; collective over the checkpoint group."""

    mode: str

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        """Begin writing ``state_dict`` (DCP layout) into ``directory``; returns when the
        training loop may continue, which must call :meth:`wait_copied` before it changes the
        state. Call it only after :meth:`poll` returned True.
        """

    def wait_copied(self) -> tuple[float, float] | None:
        """Return once the state :meth:`start` was given may change (a writer may still be
        copying it in the background): (seconds that copy took, seconds waited here), or None
        if nothing was being copied.
        """

    def prepare(
        self,
        state_dict: dict,
        directory: Path,
        group: dist.ProcessGroup,
        hooks: SaveHooks,
        plan_group: dist.ProcessGroup,
    ) -> None:
        """Collective: do now, once the state is complete, what the first :meth:`start` on
        ``group`` would otherwise pay (buffers, plans), so that it stalls no longer than the
        saves after it; ``directory`` is scratch space, removed afterwards. May do nothing.
        Its collectives run on ``plan_group``, whose timeout allows uneven work: a large state's
        first plan takes seconds, longer on the coordinator than on the others. Uses
        ``hooks.heartbeat`` and ``hooks.meet``.
        """

    def poll(self, group: dist.ProcessGroup) -> bool:
        """Collective (same iteration on every rank), non-blocking: True once nothing is being
        written on any rank, the write started last on ``group`` then being durable and finalized.
        Raises CheckpointWriteError on every rank alike if that write failed. A write started on
        another group (an earlier attempt's, after a fault) is never finalized.
        """

    def abandon(self) -> None:
        """Stop a background write that counts as hung (:class:`trainer.checkpoint.CheckpointWriterHung`):
        end whatever runs it, so that :meth:`poll` finds nothing busy and the next write has a fresh one.
        """

    def close(self) -> None:
        """Release background resources."""


class _FileSystemHeartbeatingWrites(FileSystem):
    """DCP's local file system, calling ``heartbeat`` after each write into a file it creates."""

    def __init__(self, heartbeat: Callable[[], None]) -> None:
        super().__init__()
        self.heartbeat = heartbeat

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield _HeartbeatingStream(stream, self.heartbeat) if "w" in mode else stream


class _HeartbeatingStream:
    """A file whose writes call ``heartbeat`` (everything else is the file's)."""

    def __init__(self, stream: io.IOBase, heartbeat: Callable[[], None]) -> None:
        self._stream, self._heartbeat = stream, heartbeat

    def write(self, data: bytes) -> int:
        written = self._stream.write(data)
        self._heartbeat()
        return written

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


class SyncDcpWriter:
    """The synchronous baseline: ``torch.distributed.checkpoint.save`` inside the loop."""

    mode = "sync"

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        """Digest the state, then write, fsync and checksum the shard before returning, calling
        ``hooks.heartbeat`` as it writes and reads: a large state's save takes seconds in the loop,
        not a hang.
        """
        write_digests(state_dict, directory, dist.get_rank())
        hooks.heartbeat()
        storage = dcp.FileSystemWriter(directory, sync_files=True)
        storage.fs = _FileSystemHeartbeatingWrites(hooks.heartbeat)
        dcp.save(state_dict, storage_writer=storage, process_group=group)
        write_rank_checksums(directory, dist.get_rank(), heartbeat=hooks.heartbeat)

    def wait_copied(self) -> None:
        """Nothing: the state was written before :meth:`start` returned."""

    def prepare(
        self,
        state_dict: dict,
        directory: Path,
        group: dist.ProcessGroup,
        hooks: SaveHooks,
        plan_group: dist.ProcessGroup,
    ) -> None:
        """Nothing: a synchronous save plans and writes in the loop every time alike."""

    def poll(self, group: dist.ProcessGroup) -> bool:
        """Always done: the write happened inside :meth:`start`."""
        return True

    def abandon(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Nothing to release."""
