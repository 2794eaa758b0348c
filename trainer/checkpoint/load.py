"""Loading a published checkpoint, each through :func:`trainer.checkpoint.trust.open_checkpoint`:
its tensors into an FSDP model (resharded to any world size), a rank's small state, or the whole
state unsharded in one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.trust import CheckpointError, open_checkpoint


def load_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, group: dist.ProcessGroup | None = None
) -> None:
    """Load a checkpoint's model and optimizer tensors into an FSDP model (DCP reshards to any
    world size), through :func:`open_checkpoint`: each rank verifies the manifest and every
    file it reads.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = {"model": model_sd, "optim": optim_sd}
    checkpoint = open_checkpoint(path)
    checkpoint.metadata()  # verified and read here, so that a bad one raises as itself (DCP would wrap it)
    dcp.load(tensors, storage_reader=checkpoint.storage_reader(), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"])


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
