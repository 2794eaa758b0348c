"""Shard digests: what each rank was asked to save, recorded beside what it wrote.

At every save each rank hashes its tensor state as it was handed to the writer (the async
writer's staged copy, after the copy into the staging buffers; the sync writer's live state,
before ``dcp.save``) and writes ``digests_rank<R>.json``: one record per local tensor shard, keyed
by its DCP name (FQN) and its offsets in the whole tensor, so that it does not depend on how DCP
laid the bytes out in files. The file is one of the rank's files that its checksum record, then
the manifest, covers.

A write that puts well-formed but other bytes under a tensor (stale weights from a reused plan
or buffer) passes every checksum, since the checksums are of the files as written; the digests
are not, and :func:`audit_full_state` (validation, ``rfsdp bench soak --audit``) and
:func:`audit_local_state` (each rank at resume) find it. A checkpoint without digests
(written before they existed) is read as before and reported as not audited.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from trainer.checkpoint.trust import CheckpointError
from trainer.fsutil import atomic_write_text

ALGORITHM = "sha256"
"""The digest of a shard: SHA-256 over its bytes, row-major, as they lie in memory (with the
CPU's SHA extensions, twice BLAKE2b's speed here: 0.7 against 0.37 GB/s on one core)."""


class StaleShardError(CheckpointError):
    """A checkpoint's written shard does not hold what its rank was asked to save (its digest
    differs): a corrupt checkpoint, whose checksums could not see it.
    """


def digests_file(rank: int) -> str:
    """Name of a rank's digest record inside a checkpoint."""
    return f"digests_rank{rank}.json"


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor's values: its bytes, row-major (a view is hashed as its values)."""
    local = tensor.detach()
    if local.device.type != "cpu":
        local = local.cpu()
    data = local.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def _local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    # A DTensor's shard on this rank and its offsets in the whole tensor, as DCP writes it; a
    # plain tensor is whole (DCP writes one rank's copy of it).
    if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        with torch.no_grad():
            return tensor.to_local(), list(offsets)
    return tensor, [0] * tensor.dim()


def shard_records(state_dict: dict) -> list[dict]:
    """One record per tensor of ``state_dict`` (a rank's DCP state: DTensors as their local
    shards): ``fqn`` (DCP's flattened name), ``offsets``, ``shape``, ``dtype``, ``digest``.
    """
    flat, _ = flatten_state_dict(state_dict)
    records = []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue  # a learning rate, a parameter's name: DCP's pickled items, not audited
        local, offsets = _local_shard(value)
        records.append(
            {
                "fqn": fqn,
                "offsets": offsets,
                "shape": list(local.shape),
                "dtype": str(local.dtype).removeprefix("torch."),
                "digest": tensor_digest(local),
            }
        )
    return records


def write_digests(state_dict: dict, directory: Path, rank: int) -> float:
    """Digest this rank's ``state_dict`` and record it durably in ``directory`` (before the rank's
    checksums are made, which then cover it); returns the seconds it took (``digest_s`` in the file).
    A ``directory`` that is gone (an abandoned save's, removed by the next attempt) gets nothing:
    that save's write fails on its own and is never published.
    """
    started = time.perf_counter()
    records = shard_records(state_dict)
    seconds = time.perf_counter() - started
    body = {"rank": rank, "algorithm": ALGORITHM, "digest_s": seconds, "shards": records}
    try:
        atomic_write_text(Path(directory) / digests_file(rank), json.dumps(body))
    except FileNotFoundError:
        if Path(directory).is_dir():
            raise
    return seconds


def slowest_digest_s(directory: Path, world_size: int) -> float | None:
    """The slowest rank's ``digest_s`` in a checkpoint written by ``world_size`` ranks (its
    durable records, read back; None: not every rank recorded digests).
    """
    seconds = []
    for rank in range(world_size):
        try:
            seconds.append(float(json.loads((Path(directory) / digests_file(rank)).read_bytes())["digest_s"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return max(seconds, default=None)


def parse_digests(data: bytes, where: str, rank: int) -> dict:
    """A rank's digest record from its (verified) bytes.

    Raises:
        CheckpointError: not a digest record of ``rank`` in the known algorithm.
    """
    try:
        record = json.loads(data)
        shards = record["shards"]
        ok = record["rank"] == rank and record["algorithm"] == ALGORITHM and isinstance(shards, list)
        ok = ok and all(
            isinstance(s["fqn"], str) and isinstance(s["digest"], str) and len(s["offsets"]) == len(s["shape"])
            for s in shards
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: {digests_file(rank)} is not a digest record ({type(e).__name__}: {e})") from e
    if not ok:
        raise CheckpointError(f"{where}: {digests_file(rank)} is not rank {rank}'s digest record in {ALGORITHM}")
    return record


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A recorded shard whose written values differ from what its rank was asked to save."""

    rank: int
    fqn: str
    offsets: tuple[int, ...]
    problem: str

    def describe(self, step: int | None) -> str:
        """One line naming the tensor, the rank, the step and what is wrong."""
        at = f" at step {step}" if step is not None else ""
        return f"{self.fqn} (rank {self.rank}'s shard at offsets {list(self.offsets)}){at}: {self.problem}"


def shard_of(full: torch.Tensor, offsets: list[int], shape: list[int]) -> torch.Tensor:
    """The part of a whole tensor a shard at ``offsets`` of ``shape`` covers."""
    if len(offsets) != full.dim():
        raise ValueError(f"offsets {offsets} do not fit a tensor of {full.dim()} dimensions")
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))]


def _check(record: dict, written: torch.Tensor | None, rank: int) -> Mismatch | None:
    key = (rank, record["fqn"], tuple(record["offsets"]))
    if written is None:
        return Mismatch(*key, "not in the written checkpoint")
    if list(written.shape) != list(record["shape"]):
        return Mismatch(*key, f"written with shape {list(written.shape)}, recorded {record['shape']}")
    digest = tensor_digest(written)
    return Mismatch(*key, _differs(digest, record["digest"])) if digest != record["digest"] else None


def _differs(written: str, recorded: str) -> str:
    return f"the written values differ from those saved (digest {written[:12]}, recorded {recorded[:12]})"


def audit_full_state(state: dict, records: dict[int, dict]) -> list[Mismatch]:
    """Every recorded shard of every rank (``records``: rank -> its parsed digest record) against
    the written checkpoint's whole tensors (``state``, as ``read_full_state`` returns it), each
    sliced at the shard's offsets. Returns the mismatches (none: every shard holds what was saved).
    """
    flat, _ = flatten_state_dict(state)
    mismatches = []
    for rank, record in sorted(records.items()):
        for shard in record["shards"]:
            full = flat.get(shard["fqn"])
            try:
                written = shard_of(full, shard["offsets"], shard["shape"]) if isinstance(full, torch.Tensor) else None
            except (ValueError, IndexError):
                written = None
            if (found := _check(shard, written, rank)) is not None:
                mismatches.append(found)
    return mismatches


def audit_local_state(state_dict: dict, record: dict, rank: int) -> list[Mismatch]:
    """This rank's recorded shards against its state as loaded (the world size and sharding it
    was saved with: the same offsets), digested as at save time.
    """
    loaded = {(r["fqn"], tuple(r["offsets"])): r for r in shard_records(state_dict)}
    mismatches = []
    for shard in record["shards"]:
        key = (rank, shard["fqn"], tuple(shard["offsets"]))
        mine = loaded.get(key[1:])
        if mine is None:
            mismatches.append(Mismatch(*key, "not in this rank's loaded state"))
        elif mine["digest"] != shard["digest"]:
            mismatches.append(Mismatch(*key, _differs(mine["digest"], shard["digest"])))
    return mismatches
