"""Sharded DCP checkpoints: layout, atomic publication, verification, retention and resume.

A save goes to ``checkpoints/step_NNNNNN.tmp<gen>/``. Each rank writes its DCP shard and its
``rank<R>.pt`` (data position, RNG, counters), then a checksum file of its own files. Only when
every rank's part is durable does rank 0 write ``manifest.json`` (sizes + SHA-256 of every file),
rename the directory to ``step_NNNNNN`` and move the ``latest`` pointer. Resume walks published
checkpoints newest first and takes the first whose manifest verifies.

How the shards are written is a :class:`CheckpointWriter` (``trainer.checkpoint.writers``:
``SyncDcpWriter`` there, the NVRx background writer in ``trainer.rank.resilience``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.digests import StaleShardError, slowest_digest_s
from trainer.checkpoint.layout import (
    CHECKPOINTS,
    LATEST,
    checkpoint_bytes,
    is_signed,
    latest_checkpoint,
    latest_text,
    published_checkpoints,
    step_dir_name,
)
from trainer.checkpoint.load import read_digests
from trainer.checkpoint.trust import (
    MANIFEST,
    SIGNING_KEY_ENV,
    CheckpointError,
    SignatureError,
    manifest_signature,
    open_checkpoint,
    rank_state_file,
    read_rank_checksums,
    signing_key,
)
from trainer.checkpoint.writers import (
    CheckpointWriteError,
    CheckpointWriter,
    SaveHooks,
)
from trainer.errors import NonTransientError, non_transient_cause
from trainer.events import Checkpoint, CheckpointFailed, EventLog, RunWarning
from trainer.fsutil import atomic_write_text, file_sha256, fsync_dir

PREPARE_DIR = "prepare.tmp"
"""Scratch directory (+ the attempt tag) of a writer's :meth:`Checkpointer.prepare`."""
WRITE_FLOOR_BYTES_PER_S = 20e6
"""The slowest a healthy background write of a rank's shard is taken to be (20 MB/s): below any
shared volume's write and a SHA-256 pass on one core (hundreds of MB/s), with room for a slow NFS
mount. While the loop waits for a write, the ranks sleep, so the low-priority writer has the CPUs."""


class CheckpointWriterHung(RuntimeError):
    """A background write did not end within its bound (:meth:`Checkpointer.write_bound`): the
    writer counts as hung, is stopped, and the session fails (a restart starts a fresh writer).
    """


class UnsignedResumeError(CheckpointError, NonTransientError):
    """The run's checkpoints are signed, and this process has no key, or another key, to verify them with."""


def _read_error(error: CheckpointError) -> bool:
    """True when ``error`` came from reading a checkpoint (it may pass), not from its content."""
    return isinstance(error.__cause__, OSError) and not isinstance(error.__cause__, FileNotFoundError)


# The writer's phase hooks, as the timed phases that end there ("write": the hand-off returns).
_TIMED_WRITER_PHASES = {"stage": "stage", "plan": "plan", "finalize": "background"}


@dataclass(slots=True)
class _Pending:
    step: int
    tmp_dir: Path
    started: float
    blocking_s: float
    marks: list[tuple[str, float]]
    """(phase, perf_counter when it ended), in order: the save's timeline."""
    prepare_s: float | None = None
    """The writer's warm-up before this save (the attempt's first), done earlier: not its stall."""
    copied: dict[str, float] = field(default_factory=dict)
    """``copy`` (the background copy into staging buffers) and ``copy_wait`` (the training
    loop's wait for it before the next update: stall), once waited for."""
    digest_s: float | None = None
    """The slowest rank's seconds digesting its shards (after the copy, beside the step; a sync
    save's inside ``write``); None: not recorded."""

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.perf_counter()))

    def phases(self) -> dict[str, float]:
        """Seconds each phase took, in order (the copy's and the digest's, which overlap the next
        step, after ``handoff``; a sync save's digest after ``write``).
        """
        timeline = {name: t - before for (_, before), (name, t) in zip(self.marks, self.marks[1:], strict=False)}
        beside = self.copied | ({"digest": self.digest_s} if self.digest_s is not None else {})
        names = list(timeline)
        end = next((n for n in ("handoff", "write") if n in names), None)
        cut = names.index(end) + 1 if end is not None else len(names)
        return {n: timeline[n] for n in names[:cut]} | beside | {n: timeline[n] for n in names[cut:]}


class Checkpointer:
    """Owns the checkpoint policy of a run: when to save, publish, retain and resume."""

    def __init__(
        self,
        run_dir: Path,
        *,
        writer: CheckpointWriter,
        group: dist.ProcessGroup,
        events: EventLog,
        every: int,
        keep_last: int,
        fingerprint: str,
        save_group: dist.ProcessGroup | None = None,
        heartbeat: Callable[[], None] = lambda: None,
        hang_timeout: float | None = None,
        on_published: Callable[[Path], None] | None = None,
        on_phase: Callable[[int, str], None] | None = None,
        atomic: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """Set up on every rank (collective on ``group``).

        Args:
            run_dir: the run directory (checkpoints go to its ``checkpoints/``).
            writer: how the tensor state is written.
            events: where ``checkpoint`` / ``checkpoint_failed`` / ``warning`` events go.
            every: checkpoint interval in steps (the last step is always saved).
            keep_last: published checkpoints kept by retention.
            fingerprint: the training config's identity; resume skips checkpoints of another.
            group: resume and set-up collectives (rank 0 verifies checksums meanwhile: slow).
            save_group: the collectives of saves inside the training loop (default ``group``); its
                timeout bounds how long a rank waits there for a peer that has faulted.
            heartbeat: called while waiting for a write and through a writer's long work
                (``SaveHooks.heartbeat``), so neither is taken for a hang.
            hang_timeout: the run's hang timeout (seconds): the least a wait for a background write
                is bounded by (:meth:`write_bound`); None: no bound.
            on_published: receives each published checkpoint directory (rank 0).
            on_phase: called with ``(step, phase)`` as a save reaches each of ``SAVE_PHASES``.
            atomic: see ``SaveHooks.atomic``.
        """
        self.root = Path(run_dir) / CHECKPOINTS
        self.writer = writer
        self.group = group
        self.save_group = save_group or group
        self.on_phase = on_phase
        self.atomic = atomic
        self.events = events
        self.every = every
        self.keep_last = keep_last
        self.fingerprint = fingerprint
        self.heartbeat = heartbeat
        self.hang_timeout = hang_timeout
        self._write_bytes = 0  # this rank's tensor bytes in the last write started
        self.on_published = on_published
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.pending: _Pending | None = None
        self.saved_step: int | None = None
        """The newest checkpoint this session resumed from or published (rank 0; every rank after the last save)."""
        self._warm = False  # the writer has planned (prepared or saved) for this attempt's state
        self.prepare_s: float | None = None  # how long :meth:`prepare` took, until the first save reports it
        # An attempt tag keeps this attempt's temp dirs apart from a dead one's.
        tag = [f"{time.time_ns():x}" if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=0, group=group)
        self.attempt_tag = tag[0]
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=group)

    # ---------------------------------------------------------------- resume
    def load_latest(self, load: Callable[[Path], None]) -> int:
        """Resume from the newest checkpoint that verifies; returns its step (0: none).

        ``load`` receives the chosen directory and restores model, optimizer and rank state
        (:meth:`find_latest`, then :meth:`load`).
        """
        step = self.find_latest()
        return self.load(step, load) if step else 0

    def find_latest(self) -> int:
        """The step of the newest published checkpoint that verifies, on every rank (0: none).

        Invalid checkpoints are skipped with a ``warning`` event and set aside
        (``step_N.rejected``: kept, never loaded or counted by retention): verified as
        :func:`open_checkpoint` does, every checksum, and DCP's ``.metadata`` read (restricted).
        ``latest`` is pointed at the chosen one if it names another (rank 0 died between
        publishing and moving it) or is corrupt. A run whose checkpoints are signed does not
        resume without the key: :class:`UnsignedResumeError` on every rank (the job ends).
        """
        chosen: list[int | str | None] = [None]
        if self.rank == 0:
            self._remove_stale_temp_dirs()
            chosen = [self._newest_verified()]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        if isinstance(chosen[0], str):
            raise UnsignedResumeError(chosen[0])
        return chosen[0] or 0

    def _newest_verified(self) -> int | str | None:
        # Rank 0: the step to resume from, or why the run must not resume.
        published = published_checkpoints(self.root)
        if signing_key() is None and (signed := [s for s, p in published if is_signed(p)]):
            return (
                f"{step_dir_name(signed[-1])} and {len(signed) - 1} more checkpoint(s) of this run are signed, but "
                f"${SIGNING_KEY_ENV} is not set: the run does not resume without its key (give it the secret)"
            )
        chosen, refused = None, []
        for step, path in reversed(published):
            try:
                checkpoint = open_checkpoint(
                    path, fingerprint=self.fingerprint, world_size=self.world_size, checksums=True
                )
                checkpoint.metadata()
                read_digests(checkpoint)  # well-formed (each rank checks its shards against them as it loads)
            except CheckpointError as e:
                refused.append((step, path, e))
                continue
            chosen = step
            break
        if chosen is None and (kept := [e for _, _, e in refused if isinstance(e, SignatureError) or _read_error(e)]):
            # A rotated or wrong key, or a read error, would start the run over on top of its
            # progress (and the mirror's): refused, nothing set aside.
            return (
                f"no checkpoint of this run could be verified ({kept[0]}): the run does not start over on top of them. "
                "Give it the key they were signed with (or let the storage recover), "
                f"or move {self.root} aside to start over"
            )
        for step, path, e in refused:
            if _read_error(e):  # it may pass (a stale NFS handle, EIO): skipped now, kept in place
                self.events.emit(RunWarning(kind="checkpoint_skipped", step=step, reason=f"{e} (left in place)"))
                continue
            aside = self._set_aside(path)
            self.events.emit(
                RunWarning(kind="checkpoint_skipped", step=step, reason=f"{e} (set aside as {aside.name})")
            )
        latest = latest_checkpoint(self.root.parent)
        if chosen is not None and (latest is None or latest.name != step_dir_name(chosen)):
            was = latest.name if latest else latest_text(self.root)
            atomic_write_text(self.root / LATEST, step_dir_name(chosen) + "\n")
            self.events.emit(RunWarning(kind="latest_repaired", step=chosen, was=was))
        return chosen

    def load(self, step: int, load: Callable[[Path], None]) -> int:
        """Restore the published checkpoint of ``step`` (one :meth:`find_latest` chose) with
        ``load``; it is handed to ``on_published`` again (rank 0 may have died before its upload).
        Returns the step restored: an older one when the ranks found a shard of ``step`` that is
        not what its rank saved (:class:`StaleShardError`, raised by ``load`` on every rank alike):
        that checkpoint is skipped and set aside as a corrupt one is.

        Raises:
            StaleShardError: no older checkpoint verifies; the state holds the stale one's values,
                so the attempt fails and its restart starts afresh.
        """
        path = self.root / step_dir_name(step)
        try:
            load(path)
        except StaleShardError as e:
            if self.rank == 0:
                aside = self._set_aside(path)
                self.events.emit(
                    RunWarning(kind="checkpoint_skipped", step=step, reason=f"{e} (set aside as {aside.name})")
                )
            older = self.find_latest()  # collective: every rank is past its load
            if not older or older == step:  # (== step: it could not be set aside)
                raise StaleShardError(f"{e}; no older checkpoint to resume from: the attempt starts afresh") from e
            return self.load(older, load)
        self.saved_step = step
        if (
            self.rank == 0 and self.on_published is not None
        ):  # its upload may have been cut (the mirror skips what it has)
            self.on_published(path)
        return step

    # ------------------------------------------------------------------ save
    def step(self, step: int, state: Callable[[], tuple[dict, dict]], *, last: bool) -> None:
        """Called once per training step on every rank: finishes in-flight saves, starts due ones.

        ``state`` returns ``(tensor_state, rank_state)``; it is only called when a save starts
        and once to :meth:`prepare` the writer.
        """
        self._poll(blocking=last)
        if step % self.every == 0 or last:
            self.save(step, state)
            if last:
                self._poll(blocking=True)
                self._require_saved(step)
        elif not self._warm:
            self.prepare(state)

    def _require_saved(self, step: int) -> None:
        # The last save of a session (its end, a preemption's) is the one a run ends with: every
        # rank learns from rank 0 whether it was published, and a lost one fails the session (the
        # job restarts from the newest checkpoint and saves again, or ends failed) instead of
        # reporting an end without it.
        saved = [self.saved_step if self.rank == 0 else None]
        dist.broadcast_object_list(saved, src=0, group=self.save_group)
        self.saved_step = saved[0]
        if self.saved_step != step:
            newest = f"step {self.saved_step}" if self.saved_step else "none"
            raise CheckpointWriteError(
                f"the last checkpoint, of step {step}, was not saved (the newest published: {newest})"
            )

    def prepare(self, state: Callable[[], tuple[dict, dict]]) -> None:
        """Warm the writer up for this attempt's saves (collective): :meth:`step` calls it
        after the attempt's first step that is not a save, when the state is complete (a
        fresh optimizer's moments exist only after its first step). Its time is the first saved
        checkpoint's ``prepare`` phase, apart from that save's stall.
        """
        t0 = time.perf_counter()
        scratch = self.root / f"{PREPARE_DIR}{self.attempt_tag}"
        hooks = SaveHooks(heartbeat=self.heartbeat, meet=self._meet)
        # collective: every rank is done with it after; its plans on the checkpoint group, whose
        # timeout allows for uneven work
        self.writer.prepare(state()[0], scratch, self.save_group, hooks, plan_group=self.group)
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        self.prepare_s, self._warm = time.perf_counter() - t0, True

    def save(self, step: int, state: Callable[[], tuple[dict, dict]]) -> None:
        """Start a checkpoint of ``step`` now (waiting first until nothing is being written).

        Its phases are timed (the ``checkpoint`` event's ``phases``): ``wait`` (for the previous
        write), ``collect`` (the state dicts), ``rank_state`` (this rank's small state, written
        durably), then for an async save ``stage``, ``plan`` and ``handoff`` (the training loop
        goes on after it), ``background`` (until every rank's write is done); for a sync save
        ``write``; then ``agree`` (every rank's part on disk) and ``publish``. The first save of
        an attempt also reports ``prepare`` first: the writer's warm-up (:meth:`prepare`),
        done steps earlier, so neither in this save's stall nor in its time to durable.
        """
        pending = _Pending(step, self.root / f"{step_dir_name(step)}.tmp{self.attempt_tag}", time.time(), 0.0, [])
        pending.prepare_s, self.prepare_s, self._warm = self.prepare_s, None, True
        pending.mark("start")
        self._poll(blocking=True)
        pending.mark("wait")
        tensors, rank_state = state()
        self._write_bytes = _state_bytes(tensors)
        pending.mark("collect")
        pending.tmp_dir.mkdir(parents=True, exist_ok=True)
        _save_durably(rank_state, pending.tmp_dir / rank_state_file(self.rank))
        pending.mark("rank_state")

        def on_phase(phase: str) -> None:
            if phase in _TIMED_WRITER_PHASES:
                pending.mark(_TIMED_WRITER_PHASES[phase])
            if self.on_phase is not None:
                self.on_phase(step, phase)

        hooks = SaveHooks(on_phase=on_phase, atomic=self.atomic, heartbeat=self.heartbeat, meet=self._meet)
        self.writer.start(tensors, pending.tmp_dir, self.save_group, hooks)
        pending.mark("handoff" if self.writer.mode == "async" else "write")
        pending.blocking_s = pending.marks[-1][1] - pending.marks[0][1]
        self.pending = pending
        if self.writer.mode == "sync":
            self._poll(blocking=True)

    def finish(self) -> None:
        """Block until the in-flight save (if any) is published."""
        self._poll(blocking=True)

    def before_update(self) -> float:
        """Call before anything changes the training state (the optimizer's step): waits until
        the save just started has copied it, which an async save does while the next step's
        forward and backward run. The wait counts in that save's stall; returns it (seconds).
        """
        copied = self.writer.wait_copied()
        if copied is None:
            return 0.0
        copy_s, waited = copied
        if self.pending is not None:
            self.pending.copied = {"copy": copy_s, "copy_wait": waited}
            self.pending.blocking_s += waited
        return waited

    def _meet(self) -> None:
        # On the checkpoint group, whose timeout allows for uneven work (a save's collectives in
        # the loop have a training collective's): a barrier polled so this rank keeps its heartbeat.
        arrived = dist.barrier(group=self.group, async_op=True)
        while not arrived.is_completed():
            self.heartbeat()
            time.sleep(0.05)
        arrived.wait()  # raises what ended it, if not every rank arriving

    def _poll(self, *, blocking: bool) -> None:
        # Non-blocking with nothing pending: no collective. Blocking: also waits for a write
        # abandoned by an earlier attempt to end on every rank.
        pending = self.pending
        if pending is None and not blocking:
            return
        bound, waited_since = self.write_bound(), time.monotonic()
        try:
            # A blocking wait is a loop of non-blocking polls (collectives that end on the same
            # iteration everywhere) so the rank keeps its heartbeat while the write finishes.
            while not self.writer.poll(self.save_group):
                if not blocking:
                    return
                if bound is not None and self._agree(time.monotonic() - waited_since > bound):
                    self._hung(pending, bound)
                self.heartbeat()
                time.sleep(0.05)
        except CheckpointWriteError as e:
            if non_transient_cause(e) is not None:
                raise  # retrying at the next interval cannot help: the job ends
            self._fail(pending, e)
            return
        if pending is None:
            return
        self.before_update()  # no wait: the write waited for its copy; recorded also where no update came between
        self.pending = None
        dist.barrier(group=self.save_group)  # every rank's checksums and rank 0's .metadata are on disk
        pending.mark("agree")
        if self.rank == 0:
            with self.atomic():  # local and short: another rank's fault must not cut a publication in half
                self._publish_and_report(pending)
        # The others wait here, not in the next step: a step is timed and watched at the run's pace
        # (trainer.rank.pace), and rank 0's publication is no part of it.
        dist.barrier(group=self.group)

    def write_bound(self) -> float | None:
        """How long the loop waits for a background write before the writer counts as hung:
        ``max(hang_timeout, bytes / WRITE_FLOOR_BYTES_PER_S)`` for this rank's bytes of the last
        write started (None without a hang timeout). A write has run in the background since its
        hand-off already; the bound starts when the loop begins to wait for it.
        """
        if self.hang_timeout is None:
            return None
        return max(self.hang_timeout, self._write_bytes / WRITE_FLOOR_BYTES_PER_S)

    def _agree(self, mine: bool) -> bool:
        # True on every rank if it is on any (each rank's clock and bound are its own).
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.save_group)
        return bool(flag.item())

    def _hung(self, pending: _Pending | None, bound: float) -> None:
        # Every rank alike: stop the writer (what it holds is never published) and fail the session.
        self.writer.abandon()
        self.pending = None
        what = f"the write of step {pending.step}" if pending is not None else "an earlier write"
        error = (
            f"checkpoint writer hung: {what} did not end within {bound:.0f} s of waiting "
            "(max(hang timeout, size / 20 MB/s))"
        )
        if self.rank == 0:
            if pending is not None:
                self.events.emit(CheckpointFailed(step=pending.step, mode=self.writer.mode, error=error))
                shutil.rmtree(pending.tmp_dir, ignore_errors=True)
            else:
                self.events.emit(RunWarning(kind="checkpoint_writer_hung", step=self.saved_step or 0, reason=error))
        raise CheckpointWriterHung(error)

    def _publish_and_report(self, pending: _Pending) -> None:
        try:
            final = self._publish(pending)
        except (CheckpointError, OSError) as e:
            if non_transient_cause(e) is not None:
                raise
            self._fail(pending, e)
            return
        pending.mark("publish")
        pending.digest_s = slowest_digest_s(final, self.world_size)
        self.saved_step = pending.step
        self.events.emit(
            Checkpoint(
                step=pending.step,
                mode=self.writer.mode,
                blocking_s=pending.blocking_s,
                total_s=time.time() - pending.started,
                bytes=checkpoint_bytes(final),
                phases=({"prepare": pending.prepare_s} if pending.prepare_s is not None else {}) | pending.phases(),
            )
        )
        if self.on_published is not None:
            self.on_published(final)

    def _fail(self, pending: _Pending, error: Exception) -> None:
        # Not fatal: the save is retried at the next interval; nothing is published.
        self.pending = None
        if self.rank == 0:
            self.events.emit(CheckpointFailed(step=pending.step, mode=self.writer.mode, error=str(error)))
            shutil.rmtree(pending.tmp_dir, ignore_errors=True)

    def _publish(self, pending: _Pending) -> Path:
        tmp = pending.tmp_dir
        files: dict[str, dict] = {}
        for rank in range(self.world_size):
            path = tmp / f"checksums_rank{rank}.json"
            if not path.is_file():
                raise CheckpointError(f"rank {rank} did not finish its part of {tmp}")
            files.update(read_rank_checksums(path, tmp.name, rank))
        files[".metadata"] = {"size": (tmp / ".metadata").stat().st_size, "sha256": file_sha256(tmp / ".metadata")}
        manifest = {
            "step": pending.step,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "files": files,
        }
        if (key := signing_key()) is not None:
            manifest["signature"] = manifest_signature(manifest, key)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
        final = self.root / step_dir_name(pending.step)
        if final.exists():  # a published one that failed verification at resume: keep it aside
            final.rename(final.with_name(f"{final.name}.invalid{self.attempt_tag}"))
        tmp.rename(final)
        fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, final.name + "\n")
        self._retain(pending.step)
        return final

    def _retain(self, newest: int) -> None:
        # Keeps the newest ``keep_last`` up to ``newest`` (just published: the newest loadable
        # one), never what ``latest`` names, nor anything newer than ``newest``, which this run
        # did not check. Checkpoints resume rejected were set aside (``.rejected``) and count not.
        latest = latest_checkpoint(self.root.parent)
        counted = [path for step, path in published_checkpoints(self.root) if step <= newest]
        for path in counted[: -self.keep_last]:
            if latest is None or path.name != latest.name:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob("step_*.invalid*"):
            shutil.rmtree(path, ignore_errors=True)

    def _set_aside(self, path: Path) -> Path:
        # A checkpoint resume rejected (damaged, another config, signed with another key) is kept
        # for whoever looks into it, under a name no reader or retention counts: ``step_N.rejected``.
        aside = path.with_name(f"{path.name}.rejected")
        if aside.exists():
            aside = path.with_name(f"{path.name}.rejected{self.attempt_tag}")
        try:
            path.rename(aside)
        except OSError:  # left where it is (and counted), rather than ending the resume
            return path
        fsync_dir(self.root)
        return aside

    def _remove_stale_temp_dirs(self) -> None:
        # Unpublished saves of dead attempts can never be completed.
        for path in chain(self.root.glob("step_*.tmp*"), self.root.glob(f"{PREPARE_DIR}*")):
            shutil.rmtree(path, ignore_errors=True)


def _state_bytes(tree: object) -> int:
    """The bytes of a nested state's tensors this rank holds (a DTensor's local shard)."""
    if isinstance(tree, dict):
        return sum(_state_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_state_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return 0


def _save_durably(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
