"""Loading a published checkpoint, each through :func:`trainer.checkpoint.trust.open_checkpoint`:
its tensors into an FSDP model (resharded to any world size; audited against the ranks' shard
digests when the world is the one that saved it), a rank's small state, or the whole state
unsharded in one process; and the audit of a whole checkpoint (:func:`audit_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.digests import (
    StaleShardError,
    audit_full_state,
    audit_local_state,
    digests_file,
    parse_digests,
)
from trainer.checkpoint.trust import CheckpointError, VerifiedCheckpoint, open_checkpoint


def load_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, group: dist.ProcessGroup | None = None
) -> None:
    """Load a checkpoint's model and optimizer tensors into an FSDP model (DCP reshards to any
    world size), through :func:`open_checkpoint`: each rank verifies the manifest and every
    file it reads. In the world size that saved it (a resume), each rank then checks its shards
    as loaded against its digest record, and the ranks agree (collective on ``group``).

    Raises:
        StaleShardError: on every rank alike, when some rank's loaded shards are not what it
            saved; the model and optimizer hold the checkpoint's values by then, and are to be
            loaded again (an older checkpoint) or built afresh.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = {"model": model_sd, "optim": optim_sd}
    checkpoint = open_checkpoint(path)
    checkpoint.metadata()  # verified and read here, so that a bad one raises as itself (DCP would wrap it)
    dcp.load(tensors, storage_reader=checkpoint.storage_reader(), process_group=group)
    distributed = dist.is_initialized()  # (DCP loads in one process without a process group too)
    world = dist.get_world_size(group) if distributed else 1
    if checkpoint.manifest.get("world_size") == world and (records := read_digests(checkpoint)):
        rank, step = dist.get_rank() if distributed else 0, checkpoint.manifest.get("step")  # (by global rank)
        found = [m.describe(step) for m in audit_local_state(tensors, records[rank], rank)]
        every: list = [found[0] if found else None] * world
        if distributed:
            dist.all_gather_object(every, every[0], group=group)  # each rank's first
        if bad := [m for m in every if m is not None]:
            more = f" (and mismatches on {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
            raise StaleShardError(f"{checkpoint.path.name}: stale or wrong shard written: {bad[0]}{more}")
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"])


def read_digests(checkpoint: VerifiedCheckpoint) -> dict[int, dict]:
    """Every rank's digest record of a checkpoint (verified bytes), rank -> record; empty when it
    has none (written before digests were recorded, or by the CUDA async writer): not audited.

    Raises:
        CheckpointError: some ranks' records are there and others not, or one is malformed.
    """
    world = checkpoint.manifest.get("world_size")
    names = {r: digests_file(r) for r in range(world if isinstance(world, int) else 0)}
    present = {r for r, name in names.items() if name in checkpoint.manifest["files"]}
    if not present:
        return {}
    if len(present) != len(names):
        missing = sorted(set(names) - present)
        raise CheckpointError(f"{checkpoint.path.name}: ranks {missing} have no digest record, the others have")
    return {r: parse_digests(checkpoint.read_bytes(name), checkpoint.path.name, r) for r, name in names.items()}


def read_rank_state(path: Path, rank: int) -> dict:
    """A rank's small state (``rank<R>.pt``) of a published checkpoint, through :func:`open_checkpoint`."""
    return open_checkpoint(path).rank_state(rank)


def read_full_state(path: Path, *, keys: set[str] | None = None) -> dict:
    """A published checkpoint's tensors as one unsharded state dict, in a single process with
    no process group (DCP reshards on load), through :func:`open_checkpoint`. ``keys``: only
    these top-level parts (``{"model"}``: not the optimizer's two moments, twice its size).
    """
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = open_checkpoint(path)
    checkpoint.metadata()  # verified and read here, so that a bad one raises as itself (DCP would wrap it)
    state: dict = {}
    try:
        planner = _EmptyStateDictLoadPlanner(keys=keys)
        _load_state_dict(state, storage_reader=checkpoint.storage_reader(), planner=planner, no_dist=True)
    except dcp.CheckpointException as e:  # one process: its own error, as itself
        cause = next((f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()), None)
        if isinstance(cause, CheckpointError):
            raise cause from e
        raise
    return state


@dataclass(frozen=True, slots=True)
class Audit:
    """What :func:`audit_checkpoint` found in one checkpoint."""

    step: int | None
    ranks: int
    """Ranks whose digest records were checked (0: the checkpoint has none, not audited)."""
    shards: int
    """Recorded shards checked against the written tensors."""
    mismatches: tuple[str, ...]
    """Each shard whose written values are not what its rank saved: the tensor, the rank, the step."""
    digest_s: float | None
    """The slowest rank's recorded seconds digesting its state at the save (None: not audited)."""
    digest_total_s: float | None
    """All ranks' recorded seconds digesting, together (the save's CPU cost of its digests)."""

    @property
    def audited(self) -> bool:
        """Whether the checkpoint has digests to audit (one written before them has none)."""
        return self.ranks > 0


def audit_checkpoint(path: Path, read: Callable[[Path], dict] = read_full_state) -> Audit:
    """Audit a whole published checkpoint in one process: every rank's recorded shard digests
    against the written tensors (``read``: its whole state, :func:`read_full_state`; called
    only when there are digests). A checkpoint without digests is not audited: no mismatches.

    Raises:
        CheckpointError: it does not verify, or its digest records are malformed.
    """
    checkpoint = open_checkpoint(path)
    step = checkpoint.manifest.get("step")
    records = read_digests(checkpoint)
    if not records:
        return Audit(step, 0, 0, (), None, None)
    found = audit_full_state(read(Path(path)), records)
    seconds = [float(r.get("digest_s", 0.0)) for r in records.values()]
    shards = sum(len(r["shards"]) for r in records.values())
    return Audit(step, len(records), shards, tuple(m.describe(step) for m in found), max(seconds), sum(seconds))
