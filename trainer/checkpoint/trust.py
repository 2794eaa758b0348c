"""What a checkpoint is trusted for, and the one way its bytes are read.

A published checkpoint's ``manifest.json`` lists every file with its size and SHA-256, the step,
the world size and the training config's fingerprint; with ``$RFSDP_CHECKPOINT_KEY`` set it is
signed (HMAC-SHA256 over all of that). :func:`open_checkpoint` is the only way in: it verifies
the manifest (its signature, that its step is the directory's, plain file names, sizes), and the
:class:`VerifiedCheckpoint` it returns hands out a file's bytes only once they match the
manifest's checksum, hashed in memory as they are read (no gap between the check and the use).
DCP's ``.metadata``, which DCP reads with pickle, is read by a restricted unpickler that knows
DCP's metadata classes and nothing else, and DCP's non-tensor items with ``weights_only``: a
manifest rewritten without the key cannot make a load run code either.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainer.checkpoint.layout import MANIFEST

METADATA = ".metadata"
SIGNING_KEY_ENV = "RFSDP_CHECKPOINT_KEY"
"""When set (from a secret), every manifest written is signed (HMAC-SHA256) with it, and every
checkpoint loaded must carry a valid signature: a checkpoint from object storage that someone
else wrote or altered, checksums included, is refused before anything in it is deserialized.
A run whose checkpoints are signed refuses to resume without it."""
_STEP_OF_DIR = re.compile(r"^step_(\d+)(?:\..*)?$")
"""A checkpoint directory's step: ``step_000010``, also ``step_000010.tmp<gen>`` / ``.tmp-download``."""
_RANK_SIGNATURE = "/signature"
"""The key of a rank's signature in its checksum file (never a file name: names are plain)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt or not trusted."""


class SignatureError(CheckpointError):
    """A checkpoint's manifest is not signed with the key this process holds."""


def rank_state_file(rank: int) -> str:
    """Name of a rank's non-tensor state file inside a checkpoint."""
    return f"rank{rank}.pt"


def signing_key() -> bytes | None:
    """The checkpoint signing key of this process (``$RFSDP_CHECKPOINT_KEY``), None when unset."""
    key = os.environ.get(SIGNING_KEY_ENV)
    return key.encode() if key else None


def manifest_signature(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 of the manifest's content: every field but the signature itself (step, world
    size, the config's fingerprint, every file's name, size and checksum).
    """
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def rank_checksums_signature(record: dict, directory_name: str, rank: int, key: bytes) -> str:
    """HMAC-SHA256 of one rank's checksum record for the checkpoint being written in ``directory_name``."""
    body = json.dumps({"dir": directory_name, "rank": rank, "files": record}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sign_rank_checksums(record: dict, directory_name: str, rank: int) -> dict:
    """``record`` as a rank writes it: signed with the key, if one is set."""
    key = signing_key()
    return (
        record
        if key is None
        else {**record, _RANK_SIGNATURE: rank_checksums_signature(record, directory_name, rank, key)}
    )


def read_rank_checksums(path: Path, directory_name: str, rank: int) -> dict:
    """A rank's checksum record (``checksums_rank<R>.json``), its signature checked when a key
    is set: rank 0 publishes only what each rank hashed itself, not whatever lies on the volume.
    """
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory_name}: rank {rank}'s checksums are unreadable ({e})") from e
    signature = record.pop(_RANK_SIGNATURE, None) if isinstance(record, dict) else None
    key = signing_key()
    if key is not None and not hmac.compare_digest(
        str(signature or ""), rank_checksums_signature(record, directory_name, rank, key)
    ):
        raise CheckpointError(
            f"{directory_name}: rank {rank}'s checksums are not signed with the key in ${SIGNING_KEY_ENV}"
        )
    return record


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint directory's name says (None for another name)."""
    m = _STEP_OF_DIR.match(Path(path).name)
    return int(m[1]) if m else None


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def verify_checkpoint(
    path: Path, *, fingerprint: str | None = None, world_size: int | None = None, checksums: bool = True
) -> dict:
    """Check a published checkpoint against its manifest; returns the manifest.

    Reads nothing but the manifest (JSON) and, with ``checksums``, hashes every file.

    Raises:
        CheckpointError: naming the first problem (missing or malformed manifest, with
            ``$RFSDP_CHECKPOINT_KEY`` set a missing or wrong signature, a step other than the
            directory's, other config or world size, a file name that is not plain, a missing
            file, wrong size, checksum mismatch).
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: unreadable manifest ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
        for r in files.values()
    ):
        raise CheckpointError(f"{path.name}: malformed manifest (no file list of sizes and checksums)")
    key = signing_key()
    if key is not None and not hmac.compare_digest(
        str(manifest.get("signature", "")), manifest_signature(manifest, key)
    ):
        problem = "is not signed" if "signature" not in manifest else "has a signature that does not match"
        raise SignatureError(f"{path.name}: its manifest {problem} the key in ${SIGNING_KEY_ENV}")
    if (step := checkpoint_step(path)) is not None and manifest.get("step") != step:
        raise CheckpointError(
            f"{path.name}: its manifest is of step {manifest.get('step')!r}, not {step} (copied or renamed)"
        )
    if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
        raise CheckpointError(f"{path.name}: written by another training config")
    if world_size is not None and manifest.get("world_size") != world_size:
        raise CheckpointError(f"{path.name}: written by world size {manifest.get('world_size')}, not {world_size}")
    for name, rec in files.items():
        if not _plain_name(name):
            raise CheckpointError(f"{path.name}: its manifest lists {name!r}, not a plain file name")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path.name}: missing {name}")
        if file.stat().st_size != rec["size"]:
            raise CheckpointError(f"{path.name}: {name} has {file.stat().st_size} bytes, expected {rec['size']}")
        if checksums and _file_sha256(file) != rec["sha256"]:
            raise CheckpointError(f"{path.name}: {name} fails its checksum")
    return manifest


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def open_checkpoint(
    path: Path, *, fingerprint: str | None = None, world_size: int | None = None, checksums: bool = False
) -> VerifiedCheckpoint:
    """The one way to read a checkpoint: :func:`verify_checkpoint` (every file's checksum too
    with ``checksums``), then a reader whose every file is checked again as it is read.
    """
    path = Path(path)
    return VerifiedCheckpoint(
        path, verify_checkpoint(path, fingerprint=fingerprint, world_size=world_size, checksums=checksums)
    )


class VerifiedCheckpoint:
    """A checkpoint whose manifest verified: hands out only bytes that match it."""

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path, self.manifest = Path(path), manifest
        self._metadata: Metadata | None = None

    def read_bytes(self, name: str) -> bytes:
        """File ``name``'s bytes, once their SHA-256 equals the manifest's (hashed as read)."""
        rec = self.manifest["files"].get(name)
        if rec is None:
            raise CheckpointError(f"{self.path.name}: {name} is not in its manifest")
        try:
            data = (self.path / name).read_bytes()
        except OSError as e:
            raise CheckpointError(f"{self.path.name}: {name} is unreadable ({e})") from e
        if len(data) != rec["size"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise CheckpointError(f"{self.path.name}: {name} fails its checksum")
        return data

    def rank_state(self, rank: int) -> dict:
        """A rank's small state (``rank<R>.pt``): verified bytes, loaded with ``weights_only``."""
        return torch.load(io.BytesIO(self.read_bytes(rank_state_file(rank))), weights_only=True)

    def metadata(self) -> Metadata:
        """DCP's ``.metadata``: verified bytes, read by an unpickler of DCP's metadata classes only."""
        if self._metadata is None:
            self._metadata = read_dcp_metadata(self.read_bytes(METADATA), self.path.name)
        return self._metadata

    def storage_reader(self) -> FileSystemReader:
        """A DCP storage reader (``dcp.load(..., storage_reader=)``) over the verified bytes."""
        return _VerifiedReader(self)


# DCP's metadata: its own dataclasses, sizes, dtypes, layouts and the path it was saved at.
_DCP_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(data: bytes, where: str = "checkpoint") -> Metadata:
    """DCP's ``.metadata`` from its bytes, with nothing but DCP's metadata classes allowed."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 (any unpickling error means the same: not DCP's metadata)
        raise CheckpointError(f"{where}: {METADATA} is not DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: {METADATA} is not DCP metadata (a {type(metadata).__name__})")
    return metadata


class _VerifiedFileSystem(FileSystem):
    """DCP's file system over a :class:`VerifiedCheckpoint`: reads only, each file's bytes verified."""

    def __init__(self, checkpoint: VerifiedCheckpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        path = Path(path)
        if "r" not in mode or any(c in mode for c in "wa+") or path.parent != self.checkpoint.path:
            raise CheckpointError(
                f"{self.checkpoint.path.name}: DCP asked for {path} ({mode!r}), not a file of the checkpoint to read"
            )
        yield io.BytesIO(self.checkpoint.read_bytes(path.name))


class _WeightsOnlyBytes:
    """A DCP load planner whose non-tensor items are checked with ``torch.load(weights_only=True)``
    before the planner (which loads them with ``weights_only=False``) sees them.
    """

    def __init__(self, planner: object) -> None:
        self._planner = planner

    def load_bytes(self, read_item: object, value: io.BytesIO) -> None:
        try:
            with warnings.catch_warnings():  # DCP pickles them with protocol 4, which the check reads well
                warnings.simplefilter("ignore", UserWarning)
                torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"a non-tensor item of the checkpoint is not plain data ({e})") from e
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> object:
        return getattr(self._planner, name)


class _VerifiedReader(FileSystemReader):
    """DCP's file system reader, reading through a :class:`VerifiedCheckpoint`."""

    def __init__(self, checkpoint: VerifiedCheckpoint) -> None:
        super().__init__(checkpoint.path)
        self.checkpoint = checkpoint
        self.fs = _VerifiedFileSystem(checkpoint)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != self.checkpoint.path:
            raise CheckpointError(f"a reader of {self.checkpoint.path} cannot read {checkpoint_id}")
        super().reset(None)

    def read_metadata(self) -> Metadata:  # no ``rank``: DCP must not fall back to per-rank metadata files
        metadata = self.checkpoint.metadata()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: object, planner: object) -> object:
        return super().read_data(plan, _WeightsOnlyBytes(planner))
