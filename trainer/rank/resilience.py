"""Everything that touches NVIDIA Resiliency Extension (NVRx): the only module importing it.

- :class:`AsyncCheckpointWriter`: DCP shards written by NVRx's persistent background worker.
- :class:`RankMonitor`: heartbeats to ft_launcher's rank monitor (in-job restart on hangs).
- :func:`run_restartable`: the training function inside ``inprocess.Wrapper`` (in-process restart).
- :class:`LocalTier`: each rank's snapshots in node-local memory (NVRx local checkpointing).
"""

# No ``from __future__ import annotations`` here: inprocess.Wrapper finds the CallWrapper
# parameter by its (evaluated) annotation.
import contextlib
import datetime
import errno
import hashlib
import io
import json
import logging
import math
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest, PersistentAsyncCaller
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache, save_state_dict_async_plan
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from trainer.checkpoint import CheckpointWriteError, SaveHooks, write_rank_checksums
from trainer.errors import NonTransientError, non_transient_cause
from trainer.events import Checkpoint, CheckpointFailed, EventLog, RunWarning
from trainer.fsutil import atomic_write_text
from trainer.process import die_with_parent, lower_priority
from trainer.rank.config import Timeouts

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
PORT_BASE_ENV = "RFSDP_PORT_BASE"


# ------------------------------------------------------------------ async checkpoints
# NVRx internals used here (nvidia-resiliency-ext 0.4.1), pinned by tests/test_units.py:
# - ``PersistentAsyncCaller``'s ``process``, ``queue``, ``preload_q`` and ``comp_q`` attributes and its
#   worker loop ``async_loop(rank, queue, preload_q, comp_q, log_level)``: to start the worker
#   ourselves (NVRx always spawns it; on CPU it is forked here), to respawn a dead one, to stop it
#   without NVRx's ``close()`` (which joins a queue a dead worker never answers), and to empty the
#   completion queue we do not read (its feeder would block the worker's exit); and its fields, to
#   make a forked worker's queues in a fork context (:class:`_ForkedCaller`).
# - ``filesystem_async._results_queue``: NVRx's writer takes its results queue from this global,
#   creating it with a multiprocessing Manager (a spawned server process: seconds, on the path of
#   every in-job restart, or in the first save's stall). The worker here reports into a queue of
#   its own (``_write_shard``) and NVRx's is never read, so a placeholder is put there instead.
# torch internals (2.13): ``_create_cpu_state_dict`` makes the reused shared-memory staging
# buffers, as ``dcp.async_save`` does.


def _write_shard(
    done: torch.Tensor, request_id: int, copied: torch.Tensor | None, copy_number: int,
    save_fn: Callable | None, directory: str, rank: int, write_buckets: list,
) -> None:  # fmt: skip
    """Runs in the background worker: once the state is in the staging buffers (``copied``
    reaches ``copy_number``; CPU only), write this rank's shard and checksums, leave the outcome
    in ``directory``, then mark the request done (always: a failure is an outcome too).

    ``rank`` and ``write_buckets`` come last and in this order: NVRx's worker replaces the second
    argument with the preloaded buckets on CUDA.
    """
    try:
        outcome = {}
        if copied is not None:
            _wait_for_copy(copied, copy_number)
        if save_fn is not None:
            results: queue.SimpleQueue = queue.SimpleQueue()
            save_fn(rank, write_buckets, results)
            outcome = results.get_nowait()
        if isinstance(outcome, Exception):
            raise outcome
        write_rank_checksums(Path(directory), rank)
        results_json = {str(k): [_write_result_json(r) for r in v] for k, v in outcome.items()}
        record = {"results": results_json, "buckets": len(write_buckets), "error": None}
    except Exception as e:  # reported to the training process, which agrees on it with the others
        errno = e.errno if isinstance(e, OSError) else None  # a full disk is not retried
        record = {"results": {}, "buckets": len(write_buckets), "error": f"{type(e).__name__}: {e}", "errno": errno}
    with contextlib.suppress(OSError):  # the directory of an abandoned write may be gone already
        (Path(directory) / _outcome_name(rank)).write_text(json.dumps(record))
    done[0] = request_id


def _wait_for_copy(copied: torch.Tensor, number: int) -> None:
    """In the worker: wait until the rank's copy ``number`` into the staging buffers has ended
    (``copied``: the last copy that succeeded, the last that failed); raise if it failed.
    """
    while max(int(copied[0]), int(copied[1])) < number:
        time.sleep(0.001)
    if int(copied[1]) == number:
        raise RuntimeError("copying the state into the staging buffers failed (the rank's log has the error)")


class _BackgroundCopy:
    """Copies the live tensors of a save into the staging buffers on a thread of its own, so the
    copy overlaps the next step's forward and backward, which only read them; the optimizer's
    step, which changes them, waits for it first (:meth:`wait`). It always ends by recording its
    number in ``copied`` (slot 0 if it succeeded, 1 if not), which the worker waits on.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], copied: torch.Tensor, number: int) -> None:
        self.seconds: float | None = None
        """How long the copy took (set when it ends)."""
        self._thread = threading.Thread(target=self._run, args=(pairs, copied, number), name="checkpoint-copy", daemon=True)
        self._thread.start()

    def _run(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], copied: torch.Tensor, number: int) -> None:
        started, ok = time.perf_counter(), False
        try:
            with torch.no_grad():  # grad mode is per thread: a copy from a parameter would be recorded
                for buffer, live in pairs:
                    buffer.copy_(live)
            ok = True
        finally:
            self.seconds = time.perf_counter() - started
            copied[0 if ok else 1] = number

    def wait(self) -> float:
        """Return once the copy has ended; returns the seconds waited."""
        started = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(0.005)  # short joins: in-process restart's exception reaches this thread between them
        return time.perf_counter() - started


def _staged_view(live: object, staging: object, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> object:
    """``live``'s structure with each tensor replaced by its staging buffer, and each other value
    (a learning rate, a step count) as it is now; each (buffer, live tensor) pair to copy is
    appended to ``pairs`` (DTensors as their local shards).
    """
    if isinstance(live, dict):
        if live.keys() != staging.keys():
            raise RuntimeError(f"the state's structure changed since its staging buffers were made: {sorted(live)} vs {sorted(staging)}")
        return {key: _staged_view(value, staging[key], pairs) for key, value in live.items()}
    if isinstance(live, list | tuple):
        return type(live)(_staged_view(value, buffer, pairs) for value, buffer in zip(live, staging, strict=True))
    if isinstance(live, torch.Tensor):
        pairs.append((_local_tensor(staging), _local_tensor(live)))
        return staging
    return live


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the shard itself, not a view that autograd tracks
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _worker_main(rank_pid: int, *loop_args: object) -> None:
    """The background worker: NVRx's worker loop, ended with its rank. A preemption's SIGTERM
    reaches the rank's whole process group: the worker ignores it, to finish the writes the rank's
    last checkpoint needs; it dies with its rank instead (and at once if the rank is gone
    already), so it never outlives it.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with(rank_pid)
    # NVRx forks a process for each write: it ignores SIGTERM as this one does, and would outlive a
    # worker killed with its rank (found stuck on a lock after a SIGKILL, holding the staged state).
    os.register_at_fork(after_in_child=partial(_die_with, os.getpid()))
    # Before any thread or process of its own, which inherit it: a write has until the next
    # checkpoint, and where the ranks keep every core busy it should not take their time.
    lower_priority()
    PersistentAsyncCaller.async_loop(*loop_args)


def _die_with(parent_pid: int) -> None:
    """In a child just forked by ``parent_pid``: end with it (at once if it is gone already)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)


_NEVER_READ_RESULTS_QUEUE = queue.SimpleQueue()
"""Stands in for NVRx's Manager-backed results queue, which this writer never reads."""


def _outcome_name(rank: int) -> str:
    return f".write_outcome_rank{rank}.json"


def _write_result_json(result: WriteResult) -> dict:
    """One DCP write result as plain JSON (the outcome record lies on the shared volume: never a pickle)."""
    info = result.storage_data
    if not isinstance(info, _StorageInfo):
        raise TypeError(f"unexpected DCP storage data {type(info).__name__}")
    offset = result.index.offset
    return {
        "fqn": result.index.fqn, "offset": None if offset is None else list(offset), "index": result.index.index,
        "size": result.size_in_bytes, "path": info.relative_path, "at": info.offset, "length": info.length,
        "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
    }  # fmt: skip


def _write_result(record: dict) -> WriteResult:
    transforms = record["transforms"]
    return WriteResult(
        index=MetadataIndex(str(record["fqn"]), record["offset"], record["index"]),
        size_in_bytes=int(record["size"]),
        storage_data=_StorageInfo(
            str(record["path"]), int(record["at"]), int(record["length"]), None if transforms is None else list(transforms)
        ),
    )


def _read_outcome(directory: Path, rank: int) -> list:
    """This rank's write results, left by :func:`_write_shard` (raises if the write failed)."""
    path = Path(directory) / _outcome_name(rank)
    if not path.is_file():
        raise RuntimeError("the background worker left no outcome (it died)")
    raw = path.read_bytes()
    path.unlink()
    try:
        record = json.loads(raw)
        if record["error"]:
            raise OSError(record["errno"], record["error"]) if record.get("errno") else RuntimeError(record["error"])
        if len(record["results"]) != record["buckets"]:
            raise RuntimeError(f"incomplete worker results ({len(record['results'])} of {record['buckets']} files)")
        return [_write_result(r) for r in chain.from_iterable(record["results"].values())]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RuntimeError(f"the background worker's outcome record is unreadable ({type(e).__name__}: {e})") from None


def _drain(q: object) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            q.get_nowait()


def _shared_buffers_like(tree: object, alive: Callable[[], None]) -> object:
    """Shared-memory buffers shaped like the state ``tree`` (as ``_create_cpu_state_dict`` makes
    them), one tensor at a time with ``alive`` after each: a large state's pages take seconds to
    make (1-2 s for the base model's on 2 CPUs), which must not pass for a hang.
    """
    if isinstance(tree, dict):
        return {key: _shared_buffers_like(value, alive) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_shared_buffers_like(value, alive) for value in tree)
    buffer = _create_cpu_state_dict({"": tree}, share_memory=True)[""]
    local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
    if isinstance(local, torch.Tensor) and not local.is_shared():
        # torch leaves 0-dim ones private (AdamW's step). Handing the write to the worker would
        # move it into shared memory then, while the copy beside the next step may be writing it:
        # a write in between was lost, and the checkpoint kept a step count of 0.
        local.share_memory_()
    alive()
    return buffer


@dataclass(slots=True)
class _StartedWrite:
    directory: Path
    fs_writer: FileSystemWriterAsync
    metadata: object
    dist_wrapper: object
    hooks: SaveHooks


@dataclass(slots=True)
class _Incarnation:
    """The writer's state for one incarnation of the training function (one checkpoint group)."""

    group: dist.ProcessGroup
    staging: dict | None = None
    started: _StartedWrite | None = None
    # DCP's save plan (and rank 0's metadata) of the last save: reused while the state's structure
    # is unchanged, which skips the planning collective. Every rank decides reuse from its own
    # plan, so the cache must start empty on every rank at once: a new incarnation, a new cache.
    plans: CheckpointMetadataCache = field(default_factory=CheckpointMetadataCache)
    copy: _BackgroundCopy | None = None
    """The last save's copy into the staging buffers, until the training loop has waited for it."""
    met: bool = False
    """Whether the ranks have met since their buffers were made (:meth:`AsyncCheckpointWriter._meet_once`)."""


class AsyncCheckpointWriter:
    """The ``async`` checkpoint mode: DCP shards written by NVRx's persistent background worker.

    In-process restart interrupts the training thread wherever it is (another rank's fault is
    raised in it asynchronously, even inside an ``except`` block), so nothing here depends on
    cleanup running, and the training thread never reads an interprocess queue: the worker reports
    completion in a shared-memory counter and each write's outcome in a file next to the shard.
    Handing a request to the worker is the one atomic section. A new checkpoint group means a new
    incarnation: what the last one started is abandoned (never finalized, so never published) and
    its staging buffers dropped. An abandoned write runs to its end in the background; the next
    save starts only once every rank's worker is idle (:meth:`poll`).

    CPU: the state is copied into reused shared-memory buffers (the worker never sees live
    tensors, which later optimizer steps would change), in the background while the next step
    computes (:class:`_BackgroundCopy`; the optimizer's step waits for it, :meth:`wait_copied`).
    CUDA: NVRx's device-to-host preload. Completion is agreed over the checkpoint's gloo group on both.
    """

    mode = "async"

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self._done = torch.zeros(1, dtype=torch.int64).share_memory_()  # last request the worker finished
        self._sent = 0  # last request handed to the worker
        self._copied = torch.zeros(2, dtype=torch.int64).share_memory_()  # last copy to staging that ended well, badly
        self._copies = 0  # copies to staging started
        self._caller: PersistentAsyncCaller | None = None
        self._current: _Incarnation | None = None
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = _NEVER_READ_RESULTS_QUEUE
        # CPU: the worker is forked now, before the training state exists: milliseconds, with
        # nothing to import and no page of the state to copy on write. CUDA cannot be forked:
        # there it is a spawned interpreter, seconds of CPU, started by :meth:`prepare` (after
        # the incarnation's first step, so that start-up and a recovery run without it) or by the
        # first write. The training loop never waits for a worker to start: a write queues behind it.
        if not cuda:
            self._ensure_worker()

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        """Start the copy into the staging buffers, plan (collective) and hand the write to the
        background worker, which waits for the copy. Call it only after :meth:`poll` returned
        True, and :meth:`wait_copied` before the state changes.
        """
        current = self._incarnation(group)
        self._ensure_worker()  # a worker forked later would fork the copy's thread mid-copy
        copy = None
        if not self.cuda:
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            state_dict = _staged_view(state_dict, self._staging(current, state_dict, hooks.alive), pairs)
            self._copies += 1
            copy = current.copy = _BackgroundCopy(pairs, self._copied, self._copies)
        self._meet_once(current, hooks)
        hooks.on_phase("stage")
        fs_writer = FileSystemWriterAsync(directory, thread_count=1)
        _, metadata, dist_wrapper = save_state_dict_async_plan(
            state_dict, fs_writer, process_group=group, enable_cache=True, metadata_cache=current.plans
        )
        hooks.on_phase("plan")
        save_fn, preload_fn, save_args = fs_writer.get_save_function_and_args()
        buckets = save_args[1] if save_fn is not None else []
        copied = None if copy is None else self._copied  # CUDA: NVRx's preload copies before the write
        task = partial(_write_shard, self._done, self._sent + 1, copied, self._copies, save_fn, str(directory))
        with hooks.atomic():  # a request is sent and recorded whole, or not at all
            self._send(task, (dist.get_rank(), buckets), preload_fn if self.cuda else None)  # NVRx's preload calls CUDA
            self._sent += 1
            current.started = _StartedWrite(Path(directory), fs_writer, metadata, dist_wrapper, hooks)
        hooks.on_phase("write")

    def prepare(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        """Start the worker unless it runs; allocate this incarnation's staging buffers and plan
        twice, writing nothing: NVRx's plan cache is used from the second equal plan on, so the
        first save then skips the planning collective like every later one (without this, the
        first two saves pay it).
        """
        self._ensure_worker()
        current = self._incarnation(group)
        if not self.cuda:
            state_dict = self._staging(current, state_dict, hooks.alive)  # what start() plans: the same structure, never the live tensors
        self._meet_once(current, hooks)
        for _ in range(2):  # plans name files relative to the directory: the same for every save
            plan_only = FileSystemWriterAsync(directory, thread_count=1)  # its directory is made, never written
            save_state_dict_async_plan(state_dict, plan_only, process_group=group, enable_cache=True, metadata_cache=current.plans)

    def poll(self, group: dist.ProcessGroup) -> bool:
        """Collective: True once no rank's worker is busy; the write this incarnation started (if
        any) is then finalized. Raises CheckpointWriteError on every rank alike if it failed.
        """
        current = self._incarnation(group)
        busy = torch.tensor([int(self._busy())], dtype=torch.int32)
        dist.all_reduce(busy, group=group)
        if busy.item():
            return False
        started, current.started = current.started, None
        if started is not None:
            started.hooks.on_phase("finalize")
            _agree_and_finalize(started, group)
        return True

    def wait_copied(self) -> tuple[float, float] | None:
        """Return once the last save's copy into the staging buffers has ended: (seconds the copy
        took, seconds waited here), or None if there was none to wait for.
        """
        current = self._current
        copy = current.copy if current is not None else None
        if copy is None:
            return None
        waited = copy.wait()
        current.copy = None
        return copy.seconds, waited

    def abandon(self) -> None:
        """Kill the background worker (stopped or stuck in a write: SIGKILL ends it either way; the
        processes it forked die with it). What it was writing is never finalized; the next write
        starts a new worker.
        """
        caller = self._caller
        if caller is None or caller.process is None:
            return
        with contextlib.suppress(OSError):
            caller.process.kill()
        caller.process.join(5)

    def close(self) -> None:
        """Stop the background worker once it has finished what it was given."""
        caller, self._caller = self._caller, None
        if caller is None or caller.process is None:
            return
        caller.queue.put("DONE")
        while caller.process.is_alive():
            _drain(caller.comp_q)
            caller.process.join(0.1)
        caller.process = None  # so NVRx's own close() (from __del__) has nothing left to join

    @staticmethod
    def _staging(current: _Incarnation, state_dict: dict, alive: Callable[[], None]) -> dict:
        """The incarnation's shared-memory buffers shaped like ``state_dict``, made on first use."""
        if current.staging is None:
            try:
                current.staging = _shared_buffers_like(state_dict, alive)
            except RuntimeError as e:  # torch says so in words only: no room in /dev/shm is no transient fault
                if "No space left on device" not in str(e):
                    raise
                raise OSError(errno.ENOSPC, f"no room in /dev/shm for this rank's checkpoint staging buffers ({e})", "/dev/shm") from e
        return current.staging

    @staticmethod
    def _meet_once(current: _Incarnation, hooks: SaveHooks) -> None:
        """Before an incarnation's first (uncached) plan: the buffers made just before take seconds
        for a large state, longer on one rank than another, and the planning collective would time
        out on the rank that waits (it has a training collective's timeout).
        """
        if not current.met:
            hooks.meet()
            current.met = True

    def _incarnation(self, group: dist.ProcessGroup) -> _Incarnation:
        if self._current is None or self._current.group is not group:
            if self._current is not None and self._current.copy is not None:
                self._current.copy.wait()  # milliseconds; then no copy of an earlier incarnation ends after a new one
            self._current = _Incarnation(group)
        return self._current

    def _busy(self) -> bool:
        # A dead worker is not busy: its write has no outcome and fails the save.
        worker = self._caller.process if self._caller is not None else None
        return int(self._done[0]) < self._sent and worker is not None and worker.is_alive()

    def _send(self, task: Callable, args: tuple, preload_fn: Callable | None = None) -> None:
        self._ensure_worker()
        self._caller.schedule_async_call(AsyncRequest(task, args, [], preload_fn=preload_fn))
        _drain(self._caller.comp_q)  # NVRx's completion queue: unread, emptied here inside the atomic section

    def _ensure_worker(self) -> None:
        """A live worker: a new one is started (also after a dead one), forked on CPU, spawned on CUDA."""
        if self._caller is None or (self._caller.process is not None and not self._caller.process.is_alive()):
            if self._caller is not None:
                self._caller.process = None  # dead: nothing to join
            context = multiprocessing.get_context("spawn" if self.cuda else "fork")
            caller = PersistentAsyncCaller() if self.cuda else _ForkedCaller(context)
            caller.rank = int(os.environ.get("RANK", 0))
            log_level = logging.getLogger(PersistentAsyncCaller.__module__).getEffectiveLevel()  # as NVRx passes it
            loop_args = (caller.rank, caller.queue, caller.preload_q, caller.comp_q, log_level)
            caller.process = context.Process(target=_worker_main, args=(os.getpid(), *loop_args))
            caller.process.start()  # NVRx's schedule_async_call starts none once it has one
            self._caller = caller


class _ForkedCaller(PersistentAsyncCaller):
    """NVRx's caller with its queues made for a forked worker.

    NVRx makes them in a spawn context, whose semaphores are named files in /dev/shm until their
    owner's resource tracker removes them. The launcher kills a rank's whole process group, tracker
    included, so every SIGKILL of a rank left its 19 behind; a fork context's have no name at all.
    A spawned worker (CUDA) opens them by name, so it keeps NVRx's own.
    """

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self.process = None
        self.start_time = None
        self.queue = context.JoinableQueue()
        self.preload_q = context.JoinableQueue()
        self.comp_q = context.Queue()
        self.cur_item = None
        self.cur_idx = -1
        self.rank = None


def _agree_and_finalize(started: _StartedWrite, group: dist.ProcessGroup) -> None:
    """All ranks agree whether every shard was written, and whether a failure is one no restart
    can fix (then every rank ends the job alike); then rank 0 writes DCP's ``.metadata``.
    """
    error = None
    try:
        results = _read_outcome(started.directory, dist.get_rank())
    except (OSError, RuntimeError) as e:
        error, results = e, []
    verdict = 1 if error is None else -1 if non_transient_cause(error) else 0
    agreed = torch.tensor([verdict], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed.item() < 1:
        failure = CheckpointWriteError(f"background write failed: {error or 'on another rank'}")
        if agreed.item() < 0:
            raise failure from (error if verdict < 0 else NonTransientError("another rank's write met an error no restart can fix"))
        raise failure
    all_results = started.dist_wrapper.gather_object(results)
    if started.dist_wrapper.is_coordinator:
        started.fs_writer.finish(started.metadata, all_results)


# ------------------------------------------------------------------ in-job restart (ft_launcher)
class RankMonitor:
    """Heartbeats to ft_launcher's rank monitor; inert when not running under ft_launcher."""

    _client: RankMonitorClient | None = None  # one connection per process, across in-process restarts

    def __init__(self) -> None:
        if RankMonitor._client is None and os.environ.get(FT_SOCKET_ENV):
            RankMonitor._client = RankMonitorClient()
            RankMonitor._client.init_workload_monitoring()

    def stop(self) -> None:
        """Stop being monitored: training is over, and closing down (final uploads, interpreter
        exit) must not count as a hang.
        """
        if RankMonitor._client is not None:
            RankMonitor._client.shutdown_workload_monitoring()
            RankMonitor._client = None

    def heartbeat(self) -> None:
        """Tell the monitor this rank is alive."""
        if self._client is not None:
            self._client.send_heartbeat()

    def state_dict(self) -> dict:
        """The monitor client's state (kept in every checkpoint)."""
        return dict(self._client.state_dict()) if self._client is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        if self._client is not None and state:
            self._client.load_state_dict(state)


# ------------------------------------------------------------------ in-process restart
def _open_sockets() -> dict[int, int]:
    """This process's open socket file descriptors, each with its socket's inode (its identity)."""
    sockets = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")  # socket:[inode]
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            sockets[int(name)] = int(target[len("socket:[") : -1])
    return sockets


class CollectiveConnections:
    """The TCP connections of one attempt's gloo process groups, so that an abort can cut them.

    gloo's ``abort()`` and ``shutdown()`` do nothing in torch 2.13, and destroying a group closes
    nothing while the model's mesh still holds it: a rank blocked in a collective with a peer that
    failed waited out the group's whole timeout before the in-process restart could begin.
    Shutting the connections down fails that collective at once, here and on every peer (gloo's
    "Connection closed by peer"), as NCCL's abort does. Listening sockets are left open (gloo ends
    the process when its listener fails). What is recorded is every internet socket the process
    opened while :meth:`recording` ran: a connection another thread opened in those milliseconds
    (rank 0's checkpoint mirror, uploading) is cut too, and that upload is retried.
    """

    def __init__(self) -> None:
        self._made: dict[int, int] = {}
        self._lock = threading.Lock()  # the abort runs on the wrapper's monitor thread
        self.aborted = False
        """The wrapper's abort has cut the current attempt's connections (reset as the next one
        starts): what fails on this rank from then on is the abort's doing (for some rank's
        fault), no failure of its own."""

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Remember the sockets opened while the block runs (the groups it creates connect at once)."""
        before = _open_sockets()
        try:
            yield
        finally:
            made = {fd: inode for fd, inode in _open_sockets().items() if before.get(fd) != inode}
            with self._lock:
                self._made.update(made)

    def cut(self) -> int:
        """Shut down every remembered internet connection that is still the socket it was, and
        forget them all.

        Returns:
            How many connections were shut down.
        """
        with self._lock:
            made, self._made = self._made, {}
            self.aborted = True
        cut = 0
        for fd, inode in made.items():
            try:
                # A duplicate: the descriptor stays gloo's to close; shutdown acts on the socket itself.
                duplicate = os.dup(fd)
            except OSError:  # closed since
                continue
            if os.fstat(duplicate).st_ino != inode:  # closed, and its number reused
                os.close(duplicate)
                continue
            with socket.socket(fileno=duplicate) as sock:
                try:
                    if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
                        cut += 1
                except OSError:  # never connected, or already shut
                    continue
        return cut


class _AbortAttempt(inprocess.abort.Abort):
    """NVRx's abort for an in-process restart, preceded by cutting the attempt's gloo connections."""

    def __init__(self, connections: CollectiveConnections) -> None:
        self._connections = connections
        self._torch = inprocess.abort.AbortTorchDistributed()

    def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
        try:
            cut = self._connections.cut()
            print(f"rank {state.rank}: in-process restart: cut {cut} connections of the attempt's groups", file=sys.stderr, flush=True)
        finally:  # the groups go whatever happened above: the next attempt makes its own
            self._torch(state)
        return state


@dataclass(frozen=True, slots=True)
class Attempt:
    """Which incarnation of the training function this is, and its hooks into the wrapper."""

    in_process_iteration: int = 0
    in_job_restart: int = field(default_factory=lambda: int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    atomic: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ping: Callable[[], None] = lambda: None
    store_port: int | None = None
    """Port for this attempt's process-group store (None: use the launcher's environment)."""
    connections: CollectiveConnections = field(default_factory=CollectiveConnections)
    """Where the attempt's process groups record their connections, for the wrapper's abort."""


def _port_base() -> int:
    # Every rank of a rendezvous round must agree: the round's MASTER_PORT does (a fresh random port
    # each round), the restart count does not (a replaced replica's launcher counts from 0 again).
    return int(os.environ.get(PORT_BASE_ENV, 29600)) + 100 * (int(os.environ.get("MASTER_PORT", 0)) % 16)


def make_store(attempt: Attempt, timeout_s: float) -> dist.Store | None:
    """A fresh TCP store for this attempt's process group (None when not in-process restartable)."""
    if attempt.store_port is None:
        return None
    host, master = os.environ["MASTER_ADDR"], int(os.environ["RANK"]) == 0
    if not master:
        wait_until_listening(host, attempt.store_port, timeout_s)
    return dist.TCPStore(
        host,
        attempt.store_port,
        int(os.environ["WORLD_SIZE"]),
        is_master=master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=True,
    )


def wait_until_listening(host: str, port: int, timeout_s: float, *, every_s: float = 0.01) -> None:
    """Return once ``host:port`` accepts connections, or after ``timeout_s`` (the caller's own
    connection then fails as it would have). c10d's store client that comes before the server
    listens retries only about half a second later, and a restart's ranks all reach this at
    once: a recovery often paid that (0.45-0.54 s measured, against 0.01 s once listening).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=every_s * 10).close()
            return
        except OSError:
            time.sleep(every_s)


class _WrapperStore(inprocess.store.TCPStore):
    """NVRx's store for the wrapper, made as a rank starts: its clients first wait for the host
    rank's server to listen (:func:`wait_until_listening`), where a start or an in-job restart
    often waited half a second for c10d's retry.
    """

    def __init__(self, *, port: int, timeout: datetime.timedelta) -> None:
        if int(os.environ["RANK"]) != self.TCP_STORE_HOST_RANK:
            wait_until_listening(os.environ["MASTER_ADDR"], port, timeout.total_seconds())
        super().__init__(port=port, timeout=timeout)


def wrapper_timeouts(timeouts: Timeouts) -> dict[str, datetime.timedelta]:
    """NVRx ``inprocess.Wrapper``'s timeouts, from the run's one hang timeout."""
    return {
        "soft_timeout": datetime.timedelta(seconds=timeouts.soft),
        "hard_timeout": datetime.timedelta(seconds=timeouts.hard),
        "heartbeat_timeout": datetime.timedelta(seconds=timeouts.wrapper_heartbeat),
        "barrier_timeout": datetime.timedelta(seconds=timeouts.barrier),
        "completion_timeout": datetime.timedelta(seconds=timeouts.barrier),
        # How long a rank waits after the first fault before it aborts: failures reported within it
        # are named together in the restart's message, later ones only in their ranks' logs.
        # NVRx's 1 s was most of a restart once a blocked collective fails at the abort.
        "last_call_wait": datetime.timedelta(seconds=0.1),
    }


def run_restartable(train_fn: Callable[[Attempt], None], timeouts: Timeouts, *, cuda: bool, max_restarts: int) -> None:
    """Run ``train_fn`` inside NVRx's ``inprocess.Wrapper``: a Python exception or a stuck rank
    restarts it in the same processes with a fresh store and process group, at most
    ``max_restarts`` times. Faults it cannot handle (a killed process, a rank stuck in C code past
    the hard timeout, one restart too many) end the processes and ft_launcher's in-job restart
    takes over.
    """
    base = _port_base()
    connections = CollectiveConnections()
    wrapper = inprocess.Wrapper(
        # A rank that is gone (killed, or ended by a fatal error) is never trained without: the
        # wrapper would shrink the world; in-job restart brings the whole job back instead.
        initialize=inprocess.initialize.RetryController(max_iterations=max_restarts + 1, min_world_size=int(os.environ["WORLD_SIZE"])),
        store_factory=_WrapperStore,
        store_kwargs={"port": base, "timeout": datetime.timedelta(seconds=timeouts.barrier)},
        health_check=inprocess.health_check.CudaHealthCheck() if cuda else None,
        abort=_AbortAttempt(connections),
        **wrapper_timeouts(timeouts),
    )

    def wrapped(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        iteration = call_wrapper.iteration
        hooks = {"atomic": call_wrapper.atomic, "ping": call_wrapper.ping, "connections": connections}
        connections.aborted = False  # a new attempt: the last one's abort is over
        train_fn(Attempt(iteration, store_port=base + 1 + iteration, **hooks))

    wrapper(wrapped)()


# ------------------------------------------------------------------ local tier (NVRx local checkpointing)
# NVRx 0.4.1's LocalCheckpointManager, adapted for CPU/gloo and for two snapshots per rank. What is
# used of it: the per-rank folder and file names, the write to a ``.dirty`` file renamed when
# complete, the save with the garbage collector off (``_save_fn``) and the load path (``_load_fn``).
# What is not, and why (pinned by tests/test_local_tier.py):
# - ``save()`` / ``find_latest()``: their barrier and all-gather run on the default group (a
#   ``GroupWrapper()`` without a group), the one FSDP uses; here every collective is on the
#   checkpoint groups. ``save()`` also keeps only the newest snapshot (its ``_cleanup``), and
#   ``find_latest()`` only finds the newest, so a corrupt newest one could not be skipped.
# - ``_save`` / ``_load``: NVRx pickles the state dict object and loads it back with
#   ``torch.load(weights_only=False)``; here the plain dict is saved with a SHA-256 sidecar written
#   after it, and loaded only once its bytes match, with ``weights_only=True``. A pruned snapshot's
#   file is kept as this owner's spare and overwritten by the next snapshot: its pages of node
#   memory are reused, where a new file's are allocated and zeroed by the kernel (a third of a
#   write's CPU, at every step). And the state is packed first (``_pack``): one byte buffer, one
#   record for torch.save and one tensor in a replica's exchange, where NVRx's pays per tensor.
# - ``BasicTensorAwareStateDict`` asserts that every tensor is on CUDA and moves them back there
#   on load: ``_HostStateDict`` drops both (the caller copies loaded values into its live tensors).
# Peer replicas (``--local-replicas``) use NVRx's ``CliqueReplicationStrategy`` as it is (its
# ``replicate`` all-gathers each clique member's snapshot, its ``retrieve_plan`` picks for each rank
# its own copy if it holds one, else a peer's), on cliques built here rather than by
# ``from_replication_params``: NVRx's groups have the default backend and timeout (NCCL on a GPU
# machine; here checkpoint collectives are gloo groups with our timeouts), and need nnodes to be a
# multiple of replicas + 1 (``trainer.rank.config.replica_cliques`` takes any nnodes above it).
# ``GroupWrapper.isend_state_dict`` / ``irecv_state_dict`` move every tensor through CUDA
# (``ten.cuda()``): ``_HostGroup`` sends and receives the host tensors over gloo as they are.
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
        for path in sorted(stale, key=lambda p: p.suffix != ".sha256"):  # a sidecar first: its snapshot no longer counts
            spare = self._spare(self._filename_to_id(path.name)[1])
            if path.suffix != ".sha256" and not spare.exists():
                path.rename(spare)
            else:
                path.unlink(missing_ok=True)


_ALIGN = 64
"""Byte alignment of each tensor in a packed snapshot (any dtype's view of it is aligned)."""


def _pack(tree: object, buffers: dict) -> dict:
    """``tree`` (nested dicts and lists of tensors and plain values) as one snapshot of three
    parts: ``skeleton`` (``tree`` with None for each tensor), ``layout`` (each tensor's place,
    dtype, shape and byte offset) and ``data``, every tensor copied into one byte buffer reused
    from save to save (``buffers``: it and its views, made again when the layout changes). One
    tensor instead of a hundred is what makes a small model's snapshot cheap: ``torch.save`` pays
    per tensor (a record each), and so does a replica's exchange (a send each).
    """
    tensors: list[torch.Tensor] = []
    layout: list[tuple] = []
    offset = 0

    def hollow(node: object, path: tuple) -> object:
        nonlocal offset
        if isinstance(node, dict):
            return {k: hollow(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [hollow(v, (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, torch.Tensor):
            return node  # plain values: immutable leaves (the dicts and lists around them are made here)
        tensors.append(node)
        layout.append((path, node.dtype, tuple(node.shape), offset))
        offset += -(-node.numel() * node.dtype.itemsize // _ALIGN) * _ALIGN  # rounded up
        return None

    skeleton = hollow(tree, ())
    if buffers.get("layout") != layout:  # the views are made with the buffer, not at every snapshot
        data = torch.zeros(offset, dtype=torch.uint8)  # the alignment gaps too: a snapshot's bytes are its state's alone
        buffers.update(layout=layout, data=data, views=_views(data, layout))
    for tensor, view in zip(tensors, buffers["views"], strict=True):
        view.copy_(tensor)
    return {"skeleton": skeleton, "layout": layout, "data": buffers["data"]}


def _views(data: torch.Tensor, layout: list[tuple]) -> list[torch.Tensor]:
    """Each tensor of a packed snapshot, as a view of its bytes in ``data``."""
    views = []
    for _, dtype, shape, offset in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(data[offset : offset + nbytes].view(dtype).view(shape))
    return views


def _unpack(snapshot: dict) -> dict:
    """The tree that :func:`_pack` packed, each tensor a copy of its bytes in the snapshot's
    ``data`` (not a view: ``torch.set_rng_state`` reads a tensor's storage from its start).
    """
    tree = snapshot["skeleton"]
    for (path, *_), view in zip(snapshot["layout"], _views(snapshot["data"], snapshot["layout"]), strict=True):
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = view.clone()
    return tree


@dataclass(slots=True)
class _LocalWrite:
    """A snapshot handed to the background thread, and how its write ended."""

    step: int
    started: float
    """``time.perf_counter()`` when its save began."""
    blocking_s: float
    """The training thread's stall handing it over (staging, the replicas' exchange)."""
    phases: dict[str, float]
    thread: threading.Thread | None = None
    error: BaseException | None = None


class LocalTier:
    """The local tier: every ``every`` steps each rank's state goes to node-local memory, at most
    two snapshots per rank and per clique member it holds replicas of (the newest complete one and
    the one being written); recovery takes the newest step every rank can load, from its own
    snapshot or else from a peer's replica.

    The training thread copies the state into one reused host buffer (and, with replicas, exchanges
    it within its clique, a collective) and hands it to a background thread, which writes it to
    ``/dev/shm`` (hashed as it is written, the checksum sidecar last). The next save first waits
    for that write and agrees with every rank that all of theirs succeeded (one small collective,
    in the training thread, so never beside training's own): only then does it count (its
    ``checkpoint`` event, the pruning that keeps it) and the buffers are reused. At resume a
    snapshot counts only if every rank verifies it, whoever wrote it. A write runs on when the
    training thread is interrupted (in-process restart): the next incarnation waits for it before
    it looks at the snapshots, as the async writer's next save waits for an abandoned write. Every
    collective is on checkpoint groups, never on the default group.

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
        self, root: Path, *, every: int, group: dist.ProcessGroup, save_group: dist.ProcessGroup, events: EventLog,
        replication: tuple | None = None,
    ) -> None:  # fmt: skip
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
            (CliqueReplicationStrategy(_HostGroup(replication[0])), CliqueReplicationStrategy(_HostGroup(replication[1])))
            if replication
            else (None, None)
        )
        self.newest = 0
        """This rank's newest complete snapshot step (0: none); kept by the next save's pruning."""
        self._available: list = []
        """Per rank, the snapshots (ids) it holds and verified, as :meth:`find_latest` found them."""
        self._buffers: dict = {}
        self._pending: _LocalWrite | None = None
        """The write this incarnation handed over and has not agreed on yet."""
        if (abandoned := LocalTier._in_flight) is not None and abandoned.thread is not None and abandoned.thread.ident is not None:
            abandoned.thread.join()  # a memory copy: short. What it wrote counts if every rank verifies it.
        LocalTier._in_flight = None
        self.off: str | None = None
        """Why the tier stepped aside for the rest of this incarnation (None: it is on)."""

    _in_flight: _LocalWrite | None = None
    """The write last handed over in this process, whichever incarnation did (one thread at a time)."""

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
        (:meth:`finish`). Its phases are timed (the ``checkpoint`` event's): ``collect`` (the copy
        into the buffers), ``replicate`` (with replicas: the clique's exchange), ``write`` (in the
        background: this rank's snapshot and the replicas it holds, with their checksums),
        ``agree``. A failed write is not fatal: ``checkpoint_failed`` (tier ``local``), retried at
        the next one; a write that found no room (a full ``/dev/shm``) turns the tier off on every
        rank (:meth:`finish`).
        """
        self.finish()
        if self.off is not None:  # the previous write found no room
            return
        started = time.perf_counter()
        ckpt_id = self.manager._ckpt_id(step)
        snapshots = {ckpt_id: _HostStateDict(_pack(state(), self._buffers))}
        collected = time.perf_counter()
        if self.replication is not None:  # every clique member's snapshot of this step, its own included
            states, ids = self.replication.replicate(snapshots[ckpt_id], ckpt_id)
            snapshots = dict(zip(ids, states, strict=True))
        replicated = time.perf_counter()
        phases = {"collect": collected - started} | ({"replicate": replicated - collected} if self.replication is not None else {})
        write = _LocalWrite(step, started, blocking_s=0.0, phases=phases)
        write.thread = threading.Thread(target=self._write, args=(write, snapshots), name="local-tier-write", daemon=True)
        self._pending = LocalTier._in_flight = write
        write.thread.start()
        write.blocking_s = time.perf_counter() - started

    def _write(self, write: _LocalWrite, snapshots: dict) -> None:
        """The background thread: prune to the newest complete step, then write ``snapshots``."""
        lower_priority()  # the write has until the next snapshot
        began = time.perf_counter()
        try:
            self.manager.prune(keep=self.newest)  # at most two steps: the newest complete one and this one
            self.manager._save_fn(snapshots)
        except Exception as e:  # reported to every rank by the next agreement
            write.error = _naming(e, self.directory)
        write.phases["write"] = time.perf_counter() - began

    def finish(self) -> None:
        """Collective on ``save_group`` (every rank, also with nothing handed over): wait for the
        write handed over last and agree whether every rank's succeeded; it then counts. Call it
        once training is done too, before the snapshots are kept or removed.

        When some rank's write found no room, the tier steps aside on every rank for the rest of
        this incarnation (:attr:`off`): each rank removes its snapshots, so that the node's memory
        is left to training and to the durable tier's staging, and the rank that found no room
        says so (a ``warning`` ``local_tier_off`` naming the path). Training goes on with the
        durable tier.
        """
        write, self._pending = self._pending, None
        if write is None:
            return
        entered = time.perf_counter()
        write.thread.join()  # a write slower than the steps between two saves stalls the loop here
        joined = time.perf_counter()
        full = write.error is not None and _no_space(write.error)
        ok = torch.tensor([-1 if full else int(write.error is None)], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.save_group)
        agreed = time.perf_counter()
        if ok.item() < 0:
            self.off = f"no room for the local tier's snapshot of step {write.step} on some rank"
            if full:
                self.off = f"{write.error}"
                reason = f"{write.error}; the local tier is off, training goes on with the durable tier"
                self.events.emit(RunWarning(kind="local_tier_off", step=write.step, reason=reason))
            self.remove()
            return
        if ok.item():
            self.newest = write.step
        if self.rank != 0:
            return
        if not ok.item():
            self.events.emit(
                CheckpointFailed(step=write.step, mode="async", tier="local", error=f"{write.error or 'failed on another rank'}")
            )
            return
        path = self.manager._local_ckpt_path_from_id(self.manager._ckpt_id(write.step))
        phases = {**write.phases, "wait": joined - entered, "agree": agreed - joined}
        self.events.emit(
            Checkpoint(
                step=write.step, mode="async", tier="local", blocking_s=write.blocking_s + (agreed - entered),
                total_s=agreed - write.started, bytes=path.stat().st_size, phases=phases,
            )
        )  # fmt: skip

    def newest_own(self) -> Path:
        """This rank's own newest snapshot file, once the write in flight is done (what
        ``corrupt-local`` hits).
        """
        if self._pending is not None:
            self._pending.thread.join()
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
            return _unpack(self.manager._load_fn(ckpt_id).state_dict)
        plan = self.retrieval.retrieve_plan(self._available, [ckpt_id])  # its own copy where it holds one
        mine = {i: self.manager._load_fn(i) for i in plan.required_ids()}  # what it sends (and keeps)
        return _unpack(self.retrieval.retrieve_execute(plan, mine)[ckpt_id].state_dict)

    def remove(self) -> None:
        """Remove this rank's snapshots, and the run's folder once no rank has any left (after :meth:`finish`)."""
        shutil.rmtree(self.manager.local_ckpt_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # another rank of this node still has its folder there
            self.root.rmdir()
