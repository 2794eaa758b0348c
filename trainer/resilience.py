"""Everything that touches NVIDIA Resiliency Extension (NVRx): the only module importing it.

- :class:`AsyncCheckpointWriter`: DCP shards written by NVRx's persistent background worker.
- :class:`RankMonitor`: heartbeats to ft_launcher's rank monitor (in-job restart on hangs).
- :func:`run_restartable`: the training function inside ``inprocess.Wrapper`` (in-process restart).
"""

# No ``from __future__ import annotations`` here: inprocess.Wrapper finds the CallWrapper
# parameter by its (evaluated) annotation.
import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest, PersistentAsyncCaller
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync, _get_write_results_queue
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from trainer.checkpoint import CheckpointWriteError, write_rank_checksums
from trainer.config import Timeouts

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
PORT_BASE_ENV = "RFSDP_PORT_BASE"


# ------------------------------------------------------------------ async checkpoints
class _GlooPersistentCaller(PersistentAsyncCaller):
    """NVRx's persistent worker, agreeing on completion over a gloo group instead of CUDA."""

    group: dist.ProcessGroup | None = None

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank's write is still running (a collective on ``group``)."""
        flag = torch.tensor([int(is_alive)], dtype=torch.int32)
        dist.all_reduce(flag, group=self.group)
        return int(flag.item()) == 0


class _GlooAsyncCallsQueue(AsyncCallsQueue):
    """``AsyncCallsQueue`` for CPU ranks: NVRx's finalization validates call indices with a CUDA
    tensor, so here every rank finalizes the request that all ranks agreed is done.
    """

    def __init__(self) -> None:
        super().__init__(persistent=True)
        self.persistent_caller = _GlooPersistentCaller()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the globally finished requests (collective)."""
        done = []
        while self.async_calls and self.async_calls[0].async_caller.is_current_async_call_done(blocking, no_dist):
            _, _, request = self.async_calls.popleft()
            done.append(request.execute_finalize_fns(validate_matching_call_idx=False))
        return done


def _noop() -> None:
    """Warm-up request: makes the worker import and start before the first save."""


def _write_shard(save_fn: Callable, directory: str, rank: int, *args: object) -> None:
    """Runs in the background worker: write this rank's shard, then checksum its files."""
    save_fn(rank, *args)
    if any(Path(directory).glob(f"__{rank}_*.distcp")):
        write_rank_checksums(Path(directory), rank)


class AsyncCheckpointWriter:
    """The ``async`` checkpoint mode on NVRx's persistent ``AsyncCallsQueue``.

    CPU: the state is copied into reused shared-memory buffers (the worker never sees live
    tensors, which later optimizer steps would change) and completion is agreed over gloo.
    CUDA: NVRx's own device-to-host preload and cross-rank finalization.
    """

    mode = "async"

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self.queue: AsyncCallsQueue = AsyncCallsQueue(persistent=True) if cuda else _GlooAsyncCallsQueue()
        if self.queue.persistent_caller is None:
            self.queue.persistent_caller = PersistentAsyncCaller()
        self._staging: dict | None = None
        self._fs_writer: FileSystemWriterAsync | None = None
        # Start the worker (a spawned interpreter: seconds) and the results queue now, so the
        # first save does not stall the training loop for them.
        _get_write_results_queue()
        self.queue.persistent_caller.rank = int(os.environ.get("RANK", 0))
        self.queue.schedule_async_request(AsyncRequest(_noop, (), []))
        self._warming_up = True

    def start(self, state_dict: dict, directory: Path, group: dist.ProcessGroup) -> None:
        """Stage, plan (collective) and hand the write to the background worker."""
        if self._warming_up:  # local: waits only if the worker has not finished booting
            self.queue.async_calls[0].async_caller.is_current_async_call_done(blocking=True, no_dist=True)
            self.queue.async_calls.popleft()
            self._warming_up = False
        if not self.cuda:
            if self._staging is None:
                self._staging = _create_cpu_state_dict(state_dict, share_memory=True)
            state_dict = _copy_state_dict(state_dict, self._staging)
            self.queue.persistent_caller.group = group
        writer = FileSystemWriterAsync(directory, thread_count=1)
        _, metadata, dist_wrapper = save_state_dict_async_plan(state_dict, writer, process_group=group)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(_agree_and_finalize, writer, metadata, dist_wrapper, group)
        request = AsyncRequest(
            partial(_write_shard, save_fn, str(directory)),
            tuple(save_args),
            [finalize],
            preload_fn=preload_fn if self.cuda else None,  # NVRx's preload calls CUDA
        )
        self._fs_writer = writer
        self.queue.schedule_async_request(request)

    def poll(self, *, blocking: bool) -> bool:
        """Finalize if the write is done on every rank (collective)."""
        if not self.queue.get_num_unfinalized_calls():
            return True
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        return self.queue.get_num_unfinalized_calls() == 0

    def abandon(self) -> None:
        """Wait (locally) for the worker to go idle and drop the unfinalized write."""
        if not self.queue.async_calls:
            return
        while self.queue.async_calls:
            self.queue.async_calls[0].async_caller.is_current_async_call_done(blocking=True, no_dist=True)
            self.queue.async_calls.popleft()
        self._warming_up = False
        with contextlib.suppress(Exception):
            self._fs_writer.retrieve_write_results()  # consume its result: the queue is shared
        self._staging = None  # the next iteration's state has new tensors and a new mesh

    def close(self) -> None:
        """Stop the background worker."""
        caller = self.queue.persistent_caller
        if caller is not None:
            caller.close()


def _agree_and_finalize(writer: FileSystemWriterAsync, metadata: object, dist_wrapper: object, group: dist.ProcessGroup) -> None:
    """All ranks agree whether every shard was written; then rank 0 writes DCP's ``.metadata``."""
    error = None
    try:
        results = writer.retrieve_write_results()
    except Exception as e:  # the worker reports a failed write as an exception object
        error, results = e, []
    ok = torch.tensor([0 if error else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        raise CheckpointWriteError(f"background write failed: {error or 'on another rank'}")
    all_results = dist_wrapper.gather_object(results)
    if dist_wrapper.is_coordinator:
        writer.finish(metadata, all_results)


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
@dataclass(frozen=True, slots=True)
class Attempt:
    """Which incarnation of the training function this is, and its hooks into the wrapper."""

    in_process_iteration: int = 0
    in_job_restart: int = field(default_factory=lambda: int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    atomic: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ping: Callable[[], None] = lambda: None
    store_port: int | None = None
    """Port for this attempt's process-group store (None: use the launcher's environment)."""


def _port_base() -> int:
    # Every rank of a rendezvous round must agree: the round's MASTER_PORT does (a fresh random port
    # each round), the restart count does not (a replaced replica's launcher counts from 0 again).
    return int(os.environ.get(PORT_BASE_ENV, 29600)) + 100 * (int(os.environ.get("MASTER_PORT", 0)) % 16)


def make_store(attempt: Attempt, timeout_s: float) -> dist.Store | None:
    """A fresh TCP store for this attempt's process group (None when not in-process restartable)."""
    if attempt.store_port is None:
        return None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        attempt.store_port,
        int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=True,
    )


def run_restartable(train_fn: Callable[[Attempt], None], timeouts: Timeouts, *, cuda: bool) -> None:
    """Run ``train_fn`` inside NVRx's ``inprocess.Wrapper``: a Python exception or a stuck rank
    restarts it in the same processes with a fresh store and process group. Faults it cannot
    handle (a killed process, a rank stuck in C code past the hard timeout) end the processes
    and ft_launcher's in-job restart takes over.
    """
    base = _port_base()
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": base, "timeout": datetime.timedelta(seconds=timeouts.barrier)},
        health_check=inprocess.health_check.CudaHealthCheck() if cuda else None,
        soft_timeout=datetime.timedelta(seconds=timeouts.soft),
        hard_timeout=datetime.timedelta(seconds=timeouts.hard),
        barrier_timeout=datetime.timedelta(seconds=timeouts.barrier),
        completion_timeout=datetime.timedelta(seconds=timeouts.barrier),
    )

    def wrapped(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        iteration = call_wrapper.iteration
        train_fn(Attempt(iteration, atomic=call_wrapper.atomic, ping=call_wrapper.ping, store_port=base + 1 + iteration))

    wrapper(wrapped)()
