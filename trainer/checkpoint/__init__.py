"""Sharded DCP checkpoints: how they are written, published, trusted, read and kept.

- ``checkpointer``: the :class:`Checkpointer` the training loop calls every step (atomic
  publication, retention, resume); ``layout``: where checkpoints lie (names, ``latest``).
- ``writers``: how a rank's shards are written (:class:`CheckpointWriter`; the synchronous DCP
  writer here, NVRx's background writer in ``trainer.rank.resilience``).
- ``trust``: what a checkpoint is trusted for, and :func:`open_checkpoint`, the one way its bytes
  are read.
- ``local_tier``: the local tier's folders in node memory (each user's own root).
- ``load``: the readers (model and optimizer tensors, a rank's state, the whole state), all
  through ``trust``, and the audit of a whole checkpoint against its shard digests.
- ``digests``: each rank's digests of what it was asked to save, recorded beside its shards.
"""

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.digests import StaleShardError
from trainer.checkpoint.layout import (
    CHECKPOINTS,
    LATEST,
    latest_checkpoint,
    latest_is_corrupt,
    published_checkpoints,
    step_dir_name,
)
from trainer.checkpoint.load import Audit, audit_checkpoint, load_tensors, read_full_state, read_rank_state
from trainer.checkpoint.local_tier import (
    LOCAL_TIER_ROOT,
    LOCAL_TIER_ROOT_ENV,
    local_tier_dir,
    local_tier_root,
    private_local_tier_root,
)
from trainer.checkpoint.trust import (
    MANIFEST,
    SIGNING_KEY_ENV,
    CheckpointError,
    manifest_signature,
    open_checkpoint,
    rank_state_file,
    verify_checkpoint,
)
from trainer.checkpoint.writers import (
    CheckpointWriteError,
    CheckpointWriter,
    SaveHooks,
    SyncDcpWriter,
    write_rank_checksums,
)

__all__ = [
    "Audit",
    "CHECKPOINTS",
    "LATEST",
    "LOCAL_TIER_ROOT",
    "LOCAL_TIER_ROOT_ENV",
    "MANIFEST",
    "SIGNING_KEY_ENV",
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointWriter",
    "Checkpointer",
    "audit_checkpoint",
    "SaveHooks",
    "StaleShardError",
    "SyncDcpWriter",
    "latest_checkpoint",
    "latest_is_corrupt",
    "load_tensors",
    "local_tier_dir",
    "local_tier_root",
    "manifest_signature",
    "open_checkpoint",
    "private_local_tier_root",
    "published_checkpoints",
    "rank_state_file",
    "read_full_state",
    "read_rank_state",
    "step_dir_name",
    "verify_checkpoint",
    "write_rank_checksums",
]
