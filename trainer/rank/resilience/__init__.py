"""Everything that touches NVIDIA Resiliency Extension (NVRx): the only package importing it, one
module per concern, none importing another.

- ``async_writer``: :class:`AsyncCheckpointWriter`, DCP shards written by NVRx's persistent
  background worker (a compatibility layer over NVRx internals, naming the version checked).
- ``monitor``: :class:`RankMonitor`, heartbeats to ft_launcher's rank monitor (in-job restart on hangs).
- ``inprocess``: :func:`run_restartable`, the training function inside ``inprocess.Wrapper``
  (in-process restart).
- ``local_tier``: :class:`LocalTier`, each rank's snapshots in node-local memory (NVRx local
  checkpointing).

``nvrx_version`` names the NVRx release the others were checked against and refuses another whose
internals moved.

An attempt's store and the cut of its gloo connections touch no NVRx: ``trainer.rank.connections``
(re-exported here, as the training loop imports them from here).
"""

from trainer.rank.connections import Attempt, CollectiveConnections, make_store, wait_until_listening
from trainer.rank.resilience.async_writer import (
    AsyncCheckpointWriter,
    _BackgroundCopy,
    _ForkedCaller,
    _outcome_name,
    _read_outcome,
    _shared_buffers_like,
    _wait_for_copy,
    _write_shard,
)
from trainer.rank.resilience.inprocess import PORT_BASE_ENV, run_restartable, wrapper_timeouts
from trainer.rank.resilience.local_tier import LocalSnapshotError, LocalTier, replication_groups
from trainer.rank.resilience.monitor import FT_SOCKET_ENV, RankMonitor

__all__ = [
    "FT_SOCKET_ENV",
    "PORT_BASE_ENV",
    "AsyncCheckpointWriter",
    "Attempt",
    "CollectiveConnections",
    "LocalSnapshotError",
    "LocalTier",
    "RankMonitor",
    "make_store",
    "replication_groups",
    "run_restartable",
    "wait_until_listening",
    "wrapper_timeouts",
    # Internals the tests reach, by the names they had when this package was one module.
    "_BackgroundCopy",
    "_ForkedCaller",
    "_outcome_name",
    "_read_outcome",
    "_shared_buffers_like",
    "_wait_for_copy",
    "_write_shard",
]
