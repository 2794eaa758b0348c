"""The local tier: each rank's snapshots in node-local memory, with NVRx's local checkpointing.

NVRx 0.4.1's LocalCheckpointManager, adapted for CPU/gloo and for two snapshots per rank. What is
used of it: the per-rank folder and file names, the write to a ``.dirty`` file renamed when
complete, the save with the garbage collector off (``_save_fn``) and the load path (``_load_fn``).
What is not, and why (pinned by tests/unit/test_local_tier.py):
- ``save()`` / ``find_latest()``: their barrier and all-gather run on the default group (a
  ``GroupWrapper()`` without a group), the one FSDP uses; here every collective is on the
  checkpoint groups. ``save()`` also keeps only the newest snapshot (its ``_cleanup``), and
  ``find_latest()`` only finds the newest, so a corrupt newest one could not be skipped.
- ``_save`` / ``_load``: NVRx pickles the state dict object and loads it back with
  ``torch.load(weights_only=False)``; here the plain dict is saved with a SHA-256 sidecar written
  after it, and loaded only once its bytes match, with ``weights_only=True``. A pruned snapshot's
  file is kept as this owner's spare and overwritten by the next snapshot: its pages of node
  memory are reused, where a new file's are allocated and zeroed by the kernel (a third of a
  write's CPU, at every step). And the state is packed first (``trainer.rank.packing``): one byte buffer, one
  record for torch.save and one tensor in a replica's exchange, where NVRx's pays per tensor.
- ``BasicTensorAwareStateDict`` asserts that every tensor is on CUDA and moves them back there
  on load: ``_HostStateDict`` drops both (the caller copies loaded values into its live tensors).
Peer replicas (``--local-replicas``) use NVRx's ``CliqueReplicationStrategy`` as it is (its
``replicate`` all-gathers each clique member's snapshot, its ``retrieve_plan`` picks for each rank
its own copy if it holds one, else a peer's), on cliques built here rather than by
``from_replication_params``: NVRx's groups have the default backend and timeout (NCCL on a GPU
machine; here checkpoint collectives are gloo groups with our timeouts), and need nnodes to be a
multiple of replicas + 1 (``trainer.rank.config.replica_cliques`` takes any nnodes above it).
``GroupWrapper.isend_state_dict`` / ``irecv_state_dict`` move every tensor through CUDA
(``ten.cuda()``): ``_HostGroup`` sends and receives the host tensors over gloo as they are.
"""

import contextlib
import datetime
import errno
import hashlib
import io
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

from trainer.events import Checkpoint, CheckpointFailed, EventLog, RunWarning
from trainer.fsutil import atomic_write_text
from trainer.process import lower_priority
from trainer.rank import packing


class LocalSnapshotError(RuntimeError):
    """A local snapshot is incomplete, torn or corrupt."""


def _no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a file system with no room left."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _naming(error: BaseException, path: Path) -> BaseException:
    """``error``, naming ``path`` where it names no path of its own (an ``OSError`` of a write to
    an open file has none): an error of the local tier always says where it happened.
    """
    if isinstance(error, OSError):
        if error.filename is not None:
            return error
        named = OSError(error.errno, error.strerror or str(error), str(path))
    else:
        named = error if str(path) in str(error) else RuntimeError(f"{type(error).__name__}: {error} (in {path})")
    if named is not error:
        named.__cause__ = error
    return named


class _HostStateDict(BasicTensorAwareStateDict):
    """NVRx's tensor-aware state dict for tensors in host memory (NVRx's asserts CUDA)."""

    def __init__(self, state_dict: dict) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Nothing to move: values are copied into the live tensors, wherever they are."""


class _HostGroup(GroupWrapper):
    """NVRx's group wrapper, sending a state dict's host tensors as they are (NVRx's goes through CUDA)."""

    def isend_state_dict(self, state_dict: _HostStateDict, dst: int) -> dict[str, float]:
        """Send ``state_dict`` to global rank ``dst``: its hollow form, then each tensor."""
        tensors = state_dict.pop_tensors()
        self.send_object(state_dict, dst)
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst, group=self.group)
        state_dict.insert_tensors(tensors)
        return {"data_sent": sum(t.nbytes for t in tensors)}

    def irecv_state_dict(self, src: int) -> tuple[_HostStateDict, dict[str, float]]:
        """Receive what :meth:`isend_state_dict` sent from global rank ``src``."""
        hollow: _HostStateDict = self.recv_object(src)
        hollow.init_tensors()
        for tensor in hollow.tensors:
            dist.recv(tensor, src, group=self.group)
        return hollow, {"data_recv": sum(t.nbytes for t in hollow.tensors)}


def replication_groups(cliques: list[list[int]], *, resume_timeout_s: float, save_timeout_s: float) -> tuple | None:
    """Collective on every rank: gloo groups of this rank's replication clique (``cliques``, from
    ``trainer.rank.config.replica_cliques``), one with each timeout (for a resume's retrieval, for
    a save's exchange in the loop). None without replicas (every clique one rank).
    """
    if all(len(clique) == 1 for clique in cliques):
        return None
    mine = []
    for timeout in (resume_timeout_s, save_timeout_s):
        for clique in cliques:  # every rank makes every group, in the same order
            group = dist.new_group(clique, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in clique:
                mine.append(group)
    return mine[0], mine[1]


class _HashingWriter:
    """A file that hashes what is written through it (no second read of the snapshot)."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _sidecar(path: Path) -> Path:
    # ``iter_..._local.pt.sha256``: NVRx's id pattern (a full match on ``..._local.pt``) ignores it.
    return path.with_name(path.name + ".sha256")


class _ChecksummedLocalManager(LocalCheckpointManager):
    """NVRx's local manager with checksummed, weights-only snapshots (see above)."""

    def _my_ckpt_ids(self) -> list:
        """This rank's complete snapshots: their checksum sidecar is written last."""
        return [i for i in super()._my_ckpt_ids() if _sidecar(self._local_ckpt_path_from_id(i)).is_file()]

    def _save(self, state_dict: _HostStateDict, ckpt_id: tuple) -> None:
        self._ensure_dir()
        dirty, final = self._local_ckpt_path_from_id(ckpt_id, True), self._local_ckpt_path_from_id(ckpt_id)
        mode = "xb"  # without a spare: a new file, exclusive as NVRx's (a stale one was pruned)
        with contextlib.suppress(FileNotFoundError):
            self._spare(ckpt_id[1]).rename(dirty)
            mode = "r+b"
        with open(dirty, mode) as file:
            writer = _HashingWriter(file)
            torch.save(state_dict.state_dict, writer)
            file.truncate()  # a spare may have been longer
        dirty.rename(final)
        atomic_write_text(_sidecar(final), writer.digest.hexdigest())

    def _spare(self, owner: int) -> Path:
        # Not NVRx's snapshot name pattern, nor ``iter_*``: never taken for a snapshot.
        return Path(self.local_ckpt_dir) / f"spare_{owner}.pt"

    def _load(self, ckpt_id: tuple) -> _HostStateDict:
        path = self._local_ckpt_path_from_id(ckpt_id)
        data = self.verified_bytes(path)
        return _HostStateDict(torch.load(io.BytesIO(data), weights_only=True))

    @staticmethod
    def verified_bytes(path: Path) -> bytes:
        """The snapshot's bytes, once they match its sidecar (nothing is unpickled before)."""
        try:
            data, expected = path.read_bytes(), _sidecar(path).read_text().strip()
        except OSError as e:
            raise LocalSnapshotError(f"{path.name}: unreadable ({e})") from e
        if hashlib.sha256(data).hexdigest() != expected:
            raise LocalSnapshotError(f"{path.name} fails its checksum")
        return data

    def prune(self, keep: int | None) -> None:
        """Remove this rank's snapshot files (torn ones and sidecars too) but those of ``keep``;
        one file per owner becomes that owner's spare (see above).
        """
        self._ensure_dir()
        stale = [p for p in self.local_ckpt_dir.glob("iter_*") if self._filename_to_id(p.name)[0] != keep]
        for path in sorted(
            stale, key=lambda p: p.suffix != ".sha256"
        ):  # a sidecar first: its snapshot no longer counts
            spare = self._spare(self._filename_to_id(path.name)[1])
            if path.suffix != ".sha256" and not spare.exists():
                path.rename(spare)
            else:
                path.unlink(missing_ok=True)


@dataclass(slots=True)
class _LocalWrite:
    """A snapshot handed to the background threads, and how its write ended."""

    step: int
    started: float
    """``time.perf_counter()`` when its save began."""
    phases: dict[str, float]
    blocking_s: float = 0.0
    """The training thread's stall: handing it over, the next update's wait for its copy, an agreement of its own."""
    copied: threading.Event = field(default_factory=threading.Event)
    """Set once the live state is copied (or the copy failed): the next update may change it."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set once the write ended, well or not (:attr:`error`): this rank's vote in the step's all-reduce."""
    error: BaseException | None = None
    votes: tuple[int, int] | None = None
    """Once every rank's write ended, as the step's all-reduce summed them: (failed, found no room)."""
    agreed: float = 0.0
    """``time.perf_counter()`` when every rank knew how every write ended."""
    pid: int = field(default_factory=os.getpid)
    """The process whose threads write it (a forked child has none of them)."""


class _Jobs:
    """A thread of this process that runs the jobs it is given, one at a time, in order."""

    def __init__(self, name: str, *, lowest: bool = False) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lowest, self.pid = lowest, os.getpid()  # a forked child has no such thread
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        if self.lowest:
            lower_priority()  # a write has until the next snapshot
        while True:
            self.jobs.get()()  # each job catches what it raises: the thread serves the next attempt too


class LocalTier:
    """The local tier: every ``every`` steps each rank's state goes to node-local memory, at most
    two snapshots per rank and per clique member it holds replicas of (the newest complete one and
    the one being written); recovery takes the newest step every rank can load, from its own
    snapshot or else from a peer's replica.

    The training thread walks the state and hands it to the process's copy thread, which copies it
    into one reused host buffer beside the next step (whose update waits for the copy); the write
    thread, at the lowest priority, writes it to ``/dev/shm`` (hashed as it is written, the checksum
    sidecar last). Each rank votes on its write in the steps' own all-reduce; the next save counts
    it (its ``checkpoint`` event, the pruning that keeps it) once every rank's ended and succeeded,
    else first waits and agrees in a collective of its own. With replicas the copy and the clique's
    exchange stay in the training thread. At resume a snapshot counts only if every rank verifies
    it, whoever wrote it. A write runs on when the training thread is interrupted (in-process
    restart): the next attempt waits for it before it looks at the snapshots. Every collective of
    the tier is on checkpoint groups.

    Args:
        root: this run's folder on this node (``trainer.checkpoint.local_tier_dir``).
        every: snapshot interval in steps.
        group: resume collectives (their timeout covers verifying snapshots); every rank of the world.
        save_group: the collective of a save inside the training loop.
        events: where ``checkpoint`` / ``checkpoint_failed`` (tier ``local``, rank 0) and
            ``warning`` (``local_snapshot_skipped``, the rank that skipped; ``local_tier_off``,
            the rank whose write found no room) go.
        replication: this rank's clique groups (resume, save) from :func:`replication_groups`;
            None: no replicas.
    """

    def __init__(
        self,
        root: Path,
        *,
        every: int,
        group: dist.ProcessGroup,
        save_group: dist.ProcessGroup,
        events: EventLog,
        replication: tuple | None = None,
    ) -> None:
        self.root = Path(root)
        self.every = every
        self.group, self.save_group = group, save_group
        self.events = events
        self.rank = dist.get_rank()
        self.manager = _ChecksummedLocalManager(self.root.parent, session_id=self.root.name)
        # torch.save's own CRC-32 of every record is a quarter of a snapshot's CPU, and the
        # snapshot's SHA-256 covers it. Process-wide: every other file a rank saves with torch.save
        # is under its checkpoint's SHA-256 too, checked before it is loaded.
        torch.serialization.set_crc32_options(False)
        self.retrieval, self.replication = (
            (
                CliqueReplicationStrategy(_HostGroup(replication[0])),
                CliqueReplicationStrategy(_HostGroup(replication[1])),
            )
            if replication
            else (None, None)
        )
        self.newest = 0
        """This rank's newest complete snapshot step (0: none); kept by the next save's pruning."""
        self._available: list = []
        """Per rank, the snapshots (ids) it holds and verified, as :meth:`find_latest` found them."""
        self._buffers: dict = {}
        self._pending: _LocalWrite | None = None
        """The write this attempt handed over and has not agreed on yet."""
        if (abandoned := LocalTier._in_flight) is not None and abandoned.pid == os.getpid():
            abandoned.ended.wait()  # a memory copy: short. What it wrote counts if every rank verifies it.
        LocalTier._in_flight = None
        self.off: str | None = None
        """Why the tier stepped aside for the rest of this attempt (None: it is on)."""

    _in_flight: _LocalWrite | None = None
    """The write last handed over in this process, whichever attempt did (one at a time)."""
    _copier: _Jobs | None = None
    _writer: _Jobs | None = None
    """This process's threads (they outlive an attempt): the copy at the training's priority, the
    write at the lowest. Started once, not at each snapshot: starting a thread waits until it runs."""

    @property
    def directory(self) -> Path:
        """This rank's folder of snapshots."""
        return Path(self.manager.local_ckpt_dir)

    def step(self, step: int, state: Callable[[], dict]) -> None:
        """Called once per training step on every rank: snapshot when due (never once it is :attr:`off`)."""
        if step % self.every == 0 and self.off is None:
            self.save(step, state)

    def save(self, step: int, state: Callable[[], dict]) -> None:
        """Hand this rank's ``state()`` (a nested dict of tensors and plain values) to the
        background write as the snapshot of ``step``, after completing the previous one
        (:meth:`finish`). Its phases are timed (the ``checkpoint`` event's): ``plan`` (a walk over
        the state), ``copy`` (into the reused buffer: beside the next step, whose update waits
        for it, ``copy_wait``; with replicas, here, before ``replicate``, the clique's exchange),
        ``write`` (this rank's snapshot and the replicas it holds, with their checksums) and, when
        the steps' own all-reduce did not settle it, ``wait`` and ``agree``. A failed write is
        not fatal: ``checkpoint_failed`` (tier ``local``), retried at the next one; a write that
        found no room (a full ``/dev/shm``) turns the tier off on every rank (:meth:`finish`).
        """
        self.finish()
        if self.off is not None:  # the previous write found no room
            return
        started = time.perf_counter()
        ckpt_id = self.manager._ckpt_id(step)
        planned = packing.plan(state())
        write = _LocalWrite(step, started, phases={"plan": time.perf_counter() - started})
        snapshots = None
        if self.replication is not None:  # the exchange needs the copy, and is a collective of the training thread
            snapshots = {ckpt_id: _HostStateDict(self._copy(planned, write))}
            replicated = time.perf_counter()
            states, ids = self.replication.replicate(snapshots[ckpt_id], ckpt_id)
            snapshots = dict(zip(ids, states, strict=True))
            write.phases["replicate"] = time.perf_counter() - replicated
        if LocalTier._copier is None or LocalTier._copier.pid != os.getpid():
            LocalTier._copier, LocalTier._writer = _Jobs("local-tier-copy"), _Jobs("local-tier-write", lowest=True)
        self._pending = LocalTier._in_flight = write
        if snapshots is None:
            LocalTier._copier.submit(partial(self._copy_then_write, write, ckpt_id, planned))
        else:
            LocalTier._writer.submit(partial(self._write, write, snapshots))
        write.blocking_s = time.perf_counter() - started

    def _copy(self, planned: packing.Plan, write: _LocalWrite) -> dict:
        began = time.perf_counter()
        try:
            return packing.fill(planned, self._buffers)
        finally:
            write.phases["copy"] = time.perf_counter() - began
            write.copied.set()

    def _copy_then_write(self, write: _LocalWrite, ckpt_id: tuple, planned: packing.Plan) -> None:
        """On the copy thread: the copy, then the write handed to the write thread."""
        try:
            snapshots = {ckpt_id: _HostStateDict(self._copy(planned, write))}
        except Exception as e:  # reported to every rank by the agreement
            write.error = _naming(e, self.directory)
            write.ended.set()
            return
        LocalTier._writer.submit(partial(self._write, write, snapshots))

    def _write(self, write: _LocalWrite, snapshots: dict) -> None:
        """On the write thread: prune to the newest complete step, then write the snapshots."""
        began = time.perf_counter()
        try:
            self.manager.prune(keep=self.newest)  # at most two steps: the newest complete one and this one
            self.manager._save_fn(snapshots)
            write.phases["write"] = time.perf_counter() - began
        except Exception as e:  # reported to every rank by the agreement
            write.error = _naming(e, self.directory)
        finally:
            write.ended.set()

    def before_update(self) -> None:
        """Call before the optimizer's step changes the state: waits until the snapshot handed
        over last has copied it. Its wait counts in that snapshot's stall (``copy_wait``).
        """
        write = self._pending
        if write is None or "copy_wait" in write.phases:
            return
        began = time.perf_counter()
        write.copied.wait()
        write.phases["copy_wait"] = waited = time.perf_counter() - began
        write.blocking_s += waited

    def ballot(self) -> list[float]:
        """This rank's vote on the write in flight, summed by the step's own all-reduce (no
        collective of its own): whether it ended, failed, found no room.
        """
        write = self._pending
        if write is None or not write.ended.is_set():
            return [0.0, 0.0, 0.0]
        failed = write.error is not None
        return [1.0, float(failed), float(failed and _no_space(write.error))]

    def tally(self, sums: list[float]) -> None:
        """The step's all-reduce of every rank's :meth:`ballot`: once every rank's write ended,
        :meth:`finish` needs no wait and no collective of its own.
        """
        write = self._pending
        if write is not None and int(sums[0]) == dist.get_world_size():
            write.votes, write.agreed = (int(sums[1]), int(sums[2])), time.perf_counter()

    def finish(self) -> None:
        """Collective on ``save_group`` (every rank, also with nothing handed over), unless the
        steps' all-reduce settled it (:meth:`tally`): wait for the write handed over last and
        agree whether every rank's succeeded; it then counts. Call it once training is done too,
        before the snapshots are kept or removed.

        When some rank's write found no room, the tier steps aside on every rank for the rest of
        this attempt (:attr:`off`): each rank removes its snapshots, so that the node's memory
        is left to training and to the durable tier's staging, and the rank that found no room
        says so (a ``warning`` ``local_tier_off`` naming the path). Training goes on with the
        durable tier.
        """
        write, self._pending = self._pending, None
        if write is None:
            return
        if write.votes is not None:
            outcome = -1 if write.votes[1] else int(not write.votes[0])
            full = write.error is not None and _no_space(write.error)
        else:
            entered = time.perf_counter()
            write.ended.wait()  # a write slower than the steps between two saves stalls the loop here
            joined = time.perf_counter()
            full = write.error is not None and _no_space(write.error)
            ok = torch.tensor([-1 if full else int(write.error is None)], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.save_group)
            outcome, write.agreed = int(ok.item()), time.perf_counter()
            write.phases |= {"wait": joined - entered, "agree": write.agreed - joined}
            write.blocking_s += write.agreed - entered
        if outcome < 0:
            self.off = f"no room for the local tier's snapshot of step {write.step} on some rank"
            if full:
                self.off = f"{write.error}"
                reason = f"{write.error}; the local tier is off, training goes on with the durable tier"
                self.events.emit(RunWarning(kind="local_tier_off", step=write.step, reason=reason))
            self.remove()
            return
        if outcome:
            self.newest = write.step
        if self.rank != 0:
            return
        if not outcome:
            self.events.emit(
                CheckpointFailed(
                    step=write.step, mode="async", tier="local", error=f"{write.error or 'failed on another rank'}"
                )
            )
            return
        path = self.manager._local_ckpt_path_from_id(self.manager._ckpt_id(write.step))
        self.events.emit(
            Checkpoint(
                step=write.step,
                mode="async",
                tier="local",
                blocking_s=write.blocking_s,
                total_s=write.agreed - write.started,
                bytes=path.stat().st_size,
                phases=write.phases,
            )
        )

    def newest_own(self) -> Path:
        """This rank's own newest snapshot file, once the write in flight is done (what
        ``corrupt-local`` hits).
        """
        if self._pending is not None:
            self._pending.ended.wait()
        return max(self.directory.glob(f"iter_*_{self.rank}_local.pt"))  # zero-padded steps: the newest sorts last

    def find_latest(self) -> tuple[int, str]:
        """Collective on ``group``: the newest step of which every rank's snapshot is held and
        verified by some rank (0: none), and where it comes from: ``local`` (every rank holds its
        own) or ``peer`` (some rank's comes from a peer's replica). A torn or corrupt snapshot is
        skipped with a ``warning`` event by the rank that holds it.
        """
        verified = []
        for ckpt_id in sorted(self.manager._my_ckpt_ids(), reverse=True):
            try:
                self.manager.verified_bytes(self.manager._local_ckpt_path_from_id(ckpt_id))
            except LocalSnapshotError as e:
                self.events.emit(RunWarning(kind="local_snapshot_skipped", step=ckpt_id[0], reason=str(e)))
                continue
            verified.append(ckpt_id)
        self._available = [None] * dist.get_world_size(self.group)  # the whole world: index = global rank
        dist.all_gather_object(self._available, verified, group=self.group)
        owners: dict[int, set[int]] = {}
        for step, owner, _ in chain.from_iterable(self._available):
            owners.setdefault(step, set()).add(owner)
        world = set(range(len(self._available)))
        self.newest = max((step for step, held in owners.items() if held == world), default=0)
        own = all(self.newest in {i[0] for i in ids if i[1] == rank} for rank, ids in enumerate(self._available))
        return self.newest, "local" if own else "peer"

    def load(self, step: int) -> dict:
        """Collective with replicas: this rank's snapshot of ``step`` (one :meth:`find_latest`
        agreed on), its own or a peer's replica sent by the peer, verified again where it is read
        before it is unpickled.
        """
        ckpt_id = self.manager._ckpt_id(step)
        if self.retrieval is None:
            return packing.unpack(self.manager._load_fn(ckpt_id).state_dict)
        plan = self.retrieval.retrieve_plan(self._available, [ckpt_id])  # its own copy where it holds one
        mine = {i: self.manager._load_fn(i) for i in plan.required_ids()}  # what it sends (and keeps)
        return packing.unpack(self.retrieval.retrieve_execute(plan, mine)[ckpt_id].state_dict)

    def remove(self) -> None:
        """Remove this rank's snapshots, and the run's folder once no rank has any left (after :meth:`finish`)."""
        shutil.rmtree(self.manager.local_ckpt_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank of this node still has its folder there
            self.root.rmdir()
