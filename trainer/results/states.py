"""Checkpoint states, for validation: a nested state's tensors, where two states differ bit for
bit, and a checkpoint loaded into a real multi-rank FSDP job (DCP resharding to its world size).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from trainer.rank.config import TrainConfig

RESHARD_TIMEOUT_S = 300.0
"""The most a resharded load (:func:`load_resharded`) may take."""


def tensors(state: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state dict with its dotted name."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def differences(a: object, b: object, name: str = "") -> list[str]:
    """Dotted names where two nested states differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{name}{k}" for k in sorted(a.keys() ^ b.keys(), key=str)]
        for k in sorted(a.keys() & b.keys(), key=str):
            out += differences(a[k], b[k], f"{name}{k}.")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{name}{i}.")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # Raw bytes, not torch.equal: a NaN loaded on another world size is still the same NaN.
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b))
    else:
        same = type(a) is type(b) and a == b
    return [] if same else [name.rstrip(".")]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def load_resharded(path: Path, cfg: TrainConfig, world_size: int) -> dict:
    """Load a checkpoint into a real ``world_size``-rank gloo job that shards the model with
    FSDP2, and return the full state it ends up with (gathered on rank 0).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="rfsdp-reshard-") as tmp:
        out = Path(tmp) / "full.pt"
        args = (world_size, str(Path(tmp) / "rdzv"), str(path), cfg, str(out))
        # fork, not spawn: a spawned rank re-imports torch (seconds of CPU each on a small
        # machine); the ranks use one intra-op thread, as DataLoader workers do after a fork.
        ctx = mp.start_processes(_reshard_worker, args=args, nprocs=world_size, join=False, start_method="fork")
        deadline = time.monotonic() + RESHARD_TIMEOUT_S
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size}-rank load did not finish in {RESHARD_TIMEOUT_S:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            # The first rank that wrote down its error says why (the others mostly lost a peer).
            errors = sorted(Path(tmp).glob("rank*.error"))
            if not errors:
                raise
            raise RuntimeError(f"{errors[0].stem} of {world_size}: {errors[0].read_text()}") from None
        finally:  # a rank that failed, timed out or was interrupted leaves no process behind
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return torch.load(out, weights_only=True)


def _reshard_worker(rank: int, world_size: int, rdzv_file: str, path: str, cfg: TrainConfig, out: str) -> None:
    """One rank of the resharded load (runs in a forked process)."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from trainer.checkpoint import load_tensors
    from trainer.rank.runtime import Runtime, build_fsdp_model

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=RESHARD_TIMEOUT_S / 2)
    dist.init_process_group(
        "gloo", init_method=f"file://{rdzv_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        rt = Runtime(torch.device("cpu"), "gloo", rank, rank, world_size)
        model = build_fsdp_model(cfg.model, rt, cfg.seed, cache=Path(cfg.run_dir) / "model_cache").module
        optimizer = torch.optim.AdamW(model.parameters())
        load_tensors(model, optimizer, Path(path))
        full_model, full_optim = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save({"model": full_model, "optim": full_optim}, out)
        dist.barrier()
    except (Exception, dcp.CheckpointException) as e:  # DCP's own error is no Exception
        Path(out).with_name(f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()
