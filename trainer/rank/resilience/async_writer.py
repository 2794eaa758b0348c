"""The ``async`` checkpoint mode: DCP shards written by NVRx's persistent background worker.

A compatibility layer over NVRx internals, checked against nvidia-resiliency-ext 0.4.1
(``nvrx_version.NVRX_CHECKED``). :func:`check_nvrx_internals` refuses an NVRx whose worker loop or shard
writer no longer takes what is passed here, as the writer is made (the worker would otherwise
die in the background, every save failing for want of an outcome); tests/integration/test_units_runs.py pins
the rest.

NVRx internals used here (nvidia-resiliency-ext 0.4.1), pinned by tests/integration/test_units_runs.py:
- ``PersistentAsyncCaller``'s ``process``, ``queue``, ``preload_q`` and ``comp_q`` attributes and its
  worker loop ``async_loop(rank, queue, preload_q, comp_q, log_level)``: to start the worker
  ourselves (NVRx always spawns it; on CPU it is forked here), to respawn a dead one, to stop it
  without NVRx's ``close()`` (which joins a queue a dead worker never answers), and to empty the
  completion queue we do not read (its feeder would block the worker's exit); and its fields, to
  make a forked worker's queues in a fork context (:class:`_ForkedCaller`).
- ``filesystem_async._results_queue``: NVRx's writer takes its results queue from this global,
  creating it with a multiprocessing Manager (a spawned server process: seconds, on the path of
  every in-job restart, or in the first save's stall). The worker here reports into a queue of
  its own (``_write_shard``) and NVRx's is never read, so a placeholder is put there instead.
torch internals (2.13): ``_create_cpu_state_dict`` makes the reused shared-memory staging
buffers, as ``dcp.async_save`` does.
"""

import contextlib
import errno
import inspect
import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest, PersistentAsyncCaller
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_plan,
)
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from trainer.checkpoint import CheckpointWriteError, SaveHooks, write_rank_checksums
from trainer.checkpoint.digests import write_digests
from trainer.errors import NonTransientError, non_transient_cause
from trainer.process import die_with_parent, lower_priority
from trainer.rank.resilience.nvrx_version import refuse_moved_internals

# What is passed to NVRx by position: the worker loop's arguments (:func:`_worker_main`) and the
# shard writer's (``save_fn`` in :func:`_write_shard`, NVRx binding the first two).
_NVRX_PARAMETERS = {
    (PersistentAsyncCaller, "async_loop"): ["rank", "queue", "preload_q", "comp_q", "log_level"],
    (FileSystemWriterAsync, "write_preloaded_data_multiproc"): [
        "transform_list",
        "use_msc",
        "rank",
        "write_buckets",
        "global_results_queue",
    ],
}


def check_nvrx_internals() -> None:
    """Raise :class:`NonTransientError`, naming both versions, where the installed NVRx lacks an
    internal this writer relies on in the form it was checked against (microseconds: the writer
    is made once per process).
    """
    changed = [
        f"{owner.__name__}.{name}({', '.join(parameters)})"
        for (owner, name), parameters in _NVRX_PARAMETERS.items()
        if not callable(function := getattr(owner, name, None))
        or list(inspect.signature(function).parameters) != parameters
    ]
    if not hasattr(filesystem_async, "_results_queue"):
        changed.append("filesystem_async._results_queue")
    refuse_moved_internals("the async checkpoint writer", changed, "trainer/rank/resilience/async_writer.py")


def _write_shard(
    done: torch.Tensor,
    request_id: int,
    copied: torch.Tensor | None,
    copy_number: int,
    save_fn: Callable | None,
    directory: str,
    rank: int,
    write_buckets: list,
) -> None:
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
        raise RuntimeError("copying (or digesting) the state into the staging buffers failed (see the rank's log)")


_Pairs = list[tuple[torch.Tensor, torch.Tensor]]
"""(staging buffer, live tensor) pairs of a save's copy."""


class _BackgroundCopy:
    """Copies the live tensors of a save into the staging buffers on a thread of its own, so the
    copy overlaps the next step's forward and backward, which only read them; the optimizer's
    step, which changes them, waits for it first (:meth:`wait`). Then ``digest`` (the rank's shard
    digests of the staged state) runs on the same thread, which nothing in the loop waits for. It
    always ends by recording its number in ``copied`` (slot 0 if copy and digest succeeded, 1 if
    not), which the worker waits on before it writes.
    """

    def __init__(self, pairs: _Pairs, copied: torch.Tensor, number: int, digest: Callable = lambda: None) -> None:
        self.seconds: float | None = None
        """How long the copy took (set when it ends)."""
        self._copied = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(pairs, copied, number, digest), name="checkpoint-copy", daemon=True
        )
        self._thread.start()

    def _run(self, pairs: _Pairs, copied: torch.Tensor, number: int, digest: Callable) -> None:
        started, ok = time.perf_counter(), False
        try:
            with torch.no_grad():  # grad mode is per thread: a copy from a parameter would be recorded
                for buffer, live in pairs:
                    buffer.copy_(live)
            self.seconds = time.perf_counter() - started
            self._copied.set()
            digest()
            ok = True
        finally:
            self.seconds = time.perf_counter() - started if self.seconds is None else self.seconds
            self._copied.set()
            copied[0 if ok else 1] = number

    def wait(self) -> float:
        """Return once the copy has ended (its digest may go on); returns the seconds waited."""
        started = time.perf_counter()
        while not self._copied.wait(0.005):  # short waits: in-process restart's exception reaches it between them
            pass
        return time.perf_counter() - started

    def join(self) -> None:
        """Return once the thread has ended, digest included."""
        while self._thread.is_alive():
            self._thread.join(0.005)


def _staged_view(live: object, staging: object, pairs: _Pairs) -> object:
    """``live``'s structure with each tensor replaced by its staging buffer, and each other value
    (a learning rate, a step count) as it is now; each (buffer, live tensor) pair to copy is
    appended to ``pairs`` (DTensors as their local shards).
    """
    if isinstance(live, dict):
        if live.keys() != staging.keys():
            raise RuntimeError(
                "the state's structure changed since its staging buffers were made: "
                f"{sorted(live)} vs {sorted(staging)}"
            )
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
        "fqn": result.index.fqn,
        "offset": None if offset is None else list(offset),
        "index": result.index.index,
        "size": result.size_in_bytes,
        "path": info.relative_path,
        "at": info.offset,
        "length": info.length,
        "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
    }


def _write_result(record: dict) -> WriteResult:
    transforms = record["transforms"]
    return WriteResult(
        index=MetadataIndex(str(record["fqn"]), record["offset"], record["index"]),
        size_in_bytes=int(record["size"]),
        storage_data=_StorageInfo(
            str(record["path"]),
            int(record["at"]),
            int(record["length"]),
            None if transforms is None else list(transforms),
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


def _shared_buffers_like(tree: object, heartbeat: Callable[[], None]) -> object:
    """Shared-memory buffers shaped like the state ``tree`` (as ``_create_cpu_state_dict`` makes
    them), one tensor at a time with ``heartbeat`` after each: a large state's pages take seconds to
    make (1-2 s for the base model's on 2 CPUs), which must not pass for a hang.
    """
    if isinstance(tree, dict):
        return {key: _shared_buffers_like(value, heartbeat) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_shared_buffers_like(value, heartbeat) for value in tree)
    buffer = _create_cpu_state_dict({"": tree}, share_memory=True)[""]
    local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
    if isinstance(local, torch.Tensor) and not local.is_shared():
        # torch leaves 0-dim ones private (AdamW's step). Handing the write to the worker would
        # move it into shared memory then, while the copy beside the next step may be writing it:
        # a write in between was lost, and the checkpoint kept a step count of 0.
        local.share_memory_()
    heartbeat()
    return buffer


@dataclass(slots=True)
class _StartedWrite:
    directory: Path
    fs_writer: FileSystemWriterAsync
    metadata: object
    dist_wrapper: object
    hooks: SaveHooks


@dataclass(slots=True)
class _AttemptState:
    """The writer's state for one attempt of the training function (one checkpoint group)."""

    group: dist.ProcessGroup
    staging: dict | None = None
    started: _StartedWrite | None = None
    # DCP's save plan (and rank 0's metadata) of the last save: reused while the state's structure
    # is unchanged, which skips the planning collective. Every rank decides reuse from its own
    # plan, so the cache must start empty on every rank at once: a new attempt, a new cache.
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
    attempt: what the last one started is abandoned (never finalized, so never published) and
    its staging buffers dropped. An abandoned write runs to its end in the background; the next
    save starts only once every rank's worker is idle (:meth:`poll`).

    CPU: the state is copied into reused shared-memory buffers (the worker never sees live
    tensors, which later optimizer steps would change), in the background while the next step
    computes (:class:`_BackgroundCopy`; the optimizer's step waits for it, :meth:`wait_copied`).
    CUDA: NVRx's device-to-host preload. Completion is agreed over the checkpoint's gloo group on both.
    """

    mode = "async"

    def __init__(self, *, cuda: bool) -> None:
        check_nvrx_internals()  # here, not in a worker that dies in the background
        self.cuda = cuda
        self._done = torch.zeros(1, dtype=torch.int64).share_memory_()  # last request the worker finished
        self._sent = 0  # last request handed to the worker
        self._copied = torch.zeros(2, dtype=torch.int64).share_memory_()  # last copy to staging that ended well, badly
        self._copies = 0  # copies to staging started
        self._last_copy: _BackgroundCopy | None = None  # the copy (and digest) started last, of any attempt
        self._caller: PersistentAsyncCaller | None = None
        self._current: _AttemptState | None = None
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = _NEVER_READ_RESULTS_QUEUE
        # CPU: the worker is forked now, before the training state exists: milliseconds, with
        # nothing to import and no page of the state to copy on write. CUDA cannot be forked:
        # there it is a spawned interpreter, seconds of CPU, started by :meth:`prepare` (after
        # the attempt's first step, so that start-up and a recovery run without it) or by the
        # first write. The training loop never waits for a worker to start: a write queues behind it.
        if not cuda:
            self._ensure_worker()

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup, hooks: SaveHooks) -> None:
        """Start the copy into the staging buffers, plan (collective) and hand the write to the
        background worker, which waits for the copy. Call it only after :meth:`poll` returned
        True, and :meth:`wait_copied` before the state changes.
        """
        current = self._attempt_state(group)
        self._ensure_worker()  # a worker forked later would fork the copy's thread mid-copy
        copy = None
        if not self.cuda:  # (CUDA: NVRx's preload copies in the worker; no digests, the checkpoint is not audited)
            pairs: _Pairs = []
            state_dict = _staged_view(state_dict, self._staging(current, state_dict, hooks.heartbeat), pairs)
            if self._last_copy is not None:  # (an earlier attempt's too): no two copies end out of order
                self._last_copy.join()  # its digest ended before its write did: no wait in practice
            digest = partial(write_digests, state_dict, Path(directory), dist.get_rank())
            self._copies += 1
            copy = current.copy = self._last_copy = _BackgroundCopy(pairs, self._copied, self._copies, digest)
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

    def prepare(
        self,
        state_dict: dict,
        directory: Path,
        group: dist.ProcessGroup,
        hooks: SaveHooks,
        plan_group: dist.ProcessGroup,
    ) -> None:
        """Start the worker unless it runs; allocate this attempt's staging buffers and plan
        twice, writing nothing: NVRx's plan cache is used from the second equal plan on, so the
        first save then skips the planning collective like every later one (without this, the
        first two saves pay it). The plans' collectives run on ``plan_group``: on ``group``, with
        a training collective's timeout, the base model's first plan outlasted it (1.5 s at a
        5 s hang timeout) beside busy loops, and the job restarted. The cache holds no group.
        """
        self._ensure_worker()
        current = self._attempt_state(group)
        if not self.cuda:
            state_dict = self._staging(
                current, state_dict, hooks.heartbeat
            )  # what start() plans: the same structure, never the live tensors
        self._meet_once(current, hooks)
        for _ in range(2):  # plans name files relative to the directory: the same for every save
            plan_only = FileSystemWriterAsync(directory, thread_count=1)  # its directory is made, never written
            save_state_dict_async_plan(
                state_dict, plan_only, process_group=plan_group, enable_cache=True, metadata_cache=current.plans
            )

    def poll(self, group: dist.ProcessGroup) -> bool:
        """Collective: True once no rank's worker is busy; the write this attempt started (if
        any) is then finalized. Raises CheckpointWriteError on every rank alike if it failed.
        """
        current = self._attempt_state(group)
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
    def _staging(current: _AttemptState, state_dict: dict, heartbeat: Callable[[], None]) -> dict:
        """The attempt's shared-memory buffers shaped like ``state_dict``, made on first use."""
        if current.staging is None:
            try:
                current.staging = _shared_buffers_like(state_dict, heartbeat)
            except RuntimeError as e:  # torch says so in words only: no room in /dev/shm is no transient fault
                if "No space left on device" not in str(e):
                    raise
                raise OSError(
                    errno.ENOSPC, f"no room in /dev/shm for this rank's checkpoint staging buffers ({e})", "/dev/shm"
                ) from e
        return current.staging

    @staticmethod
    def _meet_once(current: _AttemptState, hooks: SaveHooks) -> None:
        """Before an attempt's first (uncached) plan: the buffers made just before take seconds
        for a large state, longer on one rank than another, and the planning collective would time
        out on the rank that waits (it has a training collective's timeout).
        """
        if not current.met:
            hooks.meet()
            current.met = True

    def _attempt_state(self, group: dist.ProcessGroup) -> _AttemptState:
        if self._current is None or self._current.group is not group:  # (a copy still running: start() joins it)
            self._current = _AttemptState(group)
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
            raise failure from (
                error if verdict < 0 else NonTransientError("another rank's write met an error no restart can fix")
            )
        raise failure
    all_results = started.dist_wrapper.gather_object(results)
    if started.dist_wrapper.is_coordinator:
        started.fs_writer.finish(started.metadata, all_results)
