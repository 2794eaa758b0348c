"""What a checkpoint holds of a rank (:class:`TrainState`), and how an attempt finds and
restores the newest state every rank can load (:func:`resume`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainer.checkpoint import Checkpointer, load_tensors, read_rank_state
from trainer.data.loader import TokenLoader
from trainer.models.spec import ModelSpec
from trainer.rank.resilience import LocalTier, RankMonitor
from trainer.rank.runtime import rng_state, set_rng_state


class TrainState:
    """What a checkpoint holds: sharded model + optimizer, and each rank's loader, RNG, counters."""

    def __init__(
        self,
        spec: ModelSpec,
        optimizer: torch.optim.Optimizer,
        loader: TokenLoader,
        monitor: RankMonitor,
        group: dist.ProcessGroup,
    ) -> None:
        self.spec, self.model = spec, spec.module
        self.optimizer, self.loader, self.monitor, self.group = optimizer, loader, monitor, group
        self._live_shards: dict | None = None
        """The local tier's tensor state: :meth:`snapshot`'s tree of the live tensors, each DTensor
        as this rank's shard; mapped once, mapped again after a restore (which may make new tensors)."""

    def snapshot(self, step: int) -> tuple[dict, dict]:
        """(tensor state for DCP, this rank's small state)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}, self.snapshot_rank_state(step)

    def snapshot_rank_state(self, step: int) -> dict:
        """This rank's small state: step, loader position, RNG, rank monitor."""
        return {
            "step": step,
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "rank_monitor": self.monitor.state_dict(),
        }

    def load(self, path: Path) -> None:
        """Restore everything from a published checkpoint directory."""
        load_tensors(self.model, self.optimizer, path, self.group)
        self._live_shards = None
        self._load_rank_state(read_rank_state(path, dist.get_rank()))  # verified against the manifest as read

    def local_snapshot(self, step: int) -> dict:
        """What :meth:`snapshot` holds, with this rank's shards as plain local tensors (the
        local tier's snapshot: it is only ever loaded back by the same rank of the same world).
        The tensors are the live ones, which the tier copies at once. Training updates them in
        place, so DCP maps the model and optimizer to them once (a fixed cost per call, most of a
        small model's snapshot); only the optimizer's hyperparameters (the learning rate changes
        every step) are read again.
        """
        if self._live_shards is None:
            tensors, rank_state = self.snapshot(step)  # (DCP makes the optimizer's state if it has none yet)
            self._live_shards = _local_shards(tensors)
        else:
            rank_state = self.snapshot_rank_state(step)
            for saved, live in zip(
                self._live_shards["optim"]["param_groups"], self.optimizer.param_groups, strict=True
            ):
                saved.update((k, v) for k, v in live.items() if k != "params")  # "params": the names DCP mapped them to
        return {"tensors": self._live_shards, "rank": rank_state}

    def restore(self, snapshot: dict) -> None:
        """Restore everything from what :meth:`local_snapshot` returned."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # the live shards, to copy into
        template = _copy_shards_into({"model": model_sd, "optim": optim_sd}, snapshot["tensors"])
        set_state_dict(
            self.model, self.optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"]
        )
        self._live_shards = None  # loading may give the optimizer new tensors
        self._load_rank_state(snapshot["rank"])

    def _load_rank_state(self, rank_state: dict) -> None:
        self.loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        self.monitor.load_state_dict(rank_state["rank_monitor"])


def _local_shards(tree: object) -> object:
    """``tree`` with every DTensor replaced by this rank's shard of it."""
    if isinstance(tree, dict):
        return {k: _local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local_shards(v) for v in tree]
    return tree.to_local() if isinstance(tree, DTensor) else tree


def _copy_shards_into(template: object, saved: object) -> object:
    """``template`` (a state dict of live shards) with the values of ``saved`` (its
    :func:`_local_shards` form) copied in, tensors in place; returns it.
    """
    if isinstance(template, dict):
        return {k: _copy_shards_into(v, saved[k]) for k, v in template.items()}
    if isinstance(template, list):
        return [_copy_shards_into(v, s) for v, s in zip(template, saved, strict=True)]
    if isinstance(template, torch.Tensor):
        (template.to_local() if isinstance(template, DTensor) else template).copy_(saved)
        return template
    return saved


def resume(checkpointer: Checkpointer, local: LocalTier | None, state: TrainState) -> tuple[int, str]:
    """Restore the newest complete state every rank can load: the local tier's (each rank's own
    snapshot, else a peer's replica of it) when it is newer than the durable checkpoint, else the
    durable one. Returns its step (0: none) and source (``local``, ``peer`` or ``durable``).
    """
    durable = checkpointer.find_latest()
    newest_local, source = local.find_latest() if local is not None else (0, "local")
    if newest_local > durable:
        state.restore(local.load(newest_local))
        return newest_local, source
    if durable:  # an older one when a shard of that one is found stale as it loads
        durable = checkpointer.load(durable, state.load)
    return durable, "durable"
