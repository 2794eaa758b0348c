"""The one place that chooses the device, backend and precision, and builds the FSDP model.

CPU: gloo, fp32, one intra-op thread per rank (bitwise determinism). CUDA: NCCL and bf16 mixed
precision with fp32 reduction.
"""

from __future__ import annotations

import datetime
import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.models import build_model
from trainer.models.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Runtime:
    """Where and how this rank computes."""

    device: torch.device
    backend: str
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_cuda(self) -> bool:
        """True on a GPU rank."""
        return self.device.type == "cuda"


def detect_runtime() -> Runtime:
    """Read the launcher's environment and pick CUDA+NCCL when a GPU is present, else CPU+gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        # One intra-op thread per rank: the thread count changes how CPU kernels split their
        # sums, so it must not depend on the topology (2 nodes x 1 vs 1 node x 2) or the machine.
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return Runtime(device, backend, int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]))


def init_process_group(rt: Runtime, store: dist.Store | None, timeout_s: float) -> None:
    """Create the default process group (on ``store`` when given, else from the environment)."""
    kwargs = {"store": store, "rank": rt.rank, "world_size": rt.world_size} if store is not None else {}
    dist.init_process_group(rt.backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def seed_everything(seed: int) -> None:
    """Seed every generator the trainer touches."""
    random.seed(seed)
    torch.manual_seed(seed)


def build_fsdp_model(
    name: str, rt: Runtime, seed: int, *, activation_checkpointing: bool = False, cache: Path | None = None
) -> ModelSpec:
    """The model ``name`` (see :func:`trainer.models.build_model`), identically initialized on
    every rank, sharded with FSDP2 per unit, then the root; a model built on the meta device gets
    its memory and weights once sharded (each rank reads only its own shards).
    """
    seed_everything(seed)
    return shard_model(build_model(name, cache=cache), rt, activation_checkpointing=activation_checkpointing)


def shard_model(spec: ModelSpec, rt: Runtime, *, activation_checkpointing: bool = False) -> ModelSpec:
    """Shard ``spec``'s module with FSDP2 (each unit, then the root) on ``rt``; returns ``spec``."""
    on_meta = any(p.is_meta for p in spec.module.parameters())
    if not on_meta:
        spec.module.to(rt.device)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if rt.is_cuda
        else MixedPrecisionPolicy()
    )
    for unit in spec.fsdp_units():
        if activation_checkpointing:
            recompute_in_backward(unit)
        fully_shard(unit, mp_policy=mp)
    fully_shard(spec.module, mp_policy=mp)
    if on_meta:
        spec.materialize(rt.device)
    return spec


def build_unsharded(name: str, seed: int, *, cache: Path | None = None) -> ModelSpec:
    """The model ``name`` at the run's initialization, whole, on the CPU, in one process (what
    :func:`build_fsdp_model` starts from, before sharding; an HF model's weights read whole).
    """
    seed_everything(seed)
    spec = build_model(name, cache=cache)
    if any(p.is_meta for p in spec.module.parameters()):
        spec.materialize(torch.device("cpu"))
    return spec


def recompute_in_backward(unit: torch.nn.Module) -> None:
    """Activation checkpointing of ``unit``: its forward keeps only its inputs, and backward runs
    it again. Its parameter names stay as they are (the checkpoint and the weights' names).
    """
    from torch.utils.checkpoint import checkpoint

    forward = unit.forward
    unit.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def rng_state() -> dict:
    """This rank's random generator states (for the checkpoint). Python's process-wide generator
    is not among them: training never draws from it, and libraries in the process do (botocore's
    retry jitter in the mirror's thread), so its state says nothing about the trajectory.
    """
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
