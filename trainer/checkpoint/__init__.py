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

The names below are imported when first used (PEP 562): launching a job reads the layout and the
local tier's folders, and must not pay for torch and DCP, which the other modules import.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "checkpointer": ["Checkpointer"],
    "digests": ["StaleShardError"],
    "layout": [
        "CHECKPOINTS",
        "LATEST",
        "MANIFEST",
        "latest_checkpoint",
        "latest_is_corrupt",
        "published_checkpoints",
        "step_dir_name",
    ],
    "load": ["Audit", "audit_checkpoint", "load_tensors", "read_full_state", "read_rank_state"],
    "local_tier": [
        "LOCAL_TIER_ROOT",
        "LOCAL_TIER_ROOT_ENV",
        "local_tier_dir",
        "local_tier_root",
        "private_local_tier_root",
    ],
    "trust": [
        "SIGNING_KEY_ENV",
        "CheckpointError",
        "manifest_signature",
        "open_checkpoint",
        "rank_state_file",
        "verify_checkpoint",
    ],
    "writers": ["CheckpointWriteError", "CheckpointWriter", "SaveHooks", "SyncDcpWriter", "write_rank_checksums"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # found once
    return value
