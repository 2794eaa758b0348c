"""The shard format: token shards with a checksummed manifest, written as a stream; and the
rank-sharded loader.

The default tokenizer is byte-level UTF-8 (vocabulary 256): real, lossless and offline (a data
set may instead carry a Hugging Face tokenizer under ``tokenizer/``, see ``docs/data.md``). The
default corpus is the Python reference documentation that ships with every CPython
(``pydoc_data.topics``), so data prep needs no download.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainer.errors import NonTransientError
from trainer.fsutil import atomic_write_text, file_sha256

MANIFEST = "manifest.json"
TOKENIZER = "bytes-utf8"
TOKEN_DTYPE = "uint16"  # room for a larger vocabulary than bytes without a format change
TOKENIZER_DIR = "tokenizer"
"""Where a data set keeps the files of its tokenizer (none for byte-level)."""
MIN_TOKENS = 10_000


class DataError(NonTransientError, ValueError):
    """The data set is missing, malformed or corrupt (no restart fixes that)."""


def builtin_corpus_text() -> str:
    """The Python reference documentation shipped with CPython, in a stable order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def encode(text: str) -> np.ndarray:
    """Byte-level tokenization: one token per UTF-8 byte."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)


def decode(tokens: np.ndarray) -> str:
    """Inverse of :func:`encode` (invalid byte sequences are replaced)."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def prepare_tokens(
    text: str, out_dir: Path, *, shard_tokens: int = 1 << 20, val_fraction: float = 0.05, source: str = ""
) -> dict:
    """Tokenize ``text`` byte-level into train/val shards under ``out_dir`` and write the manifest.

    Args:
        text: the corpus.
        out_dir: directory that receives ``train_NNN.bin``, ``val_NNN.bin`` and the manifest.
        shard_tokens: tokens per shard file.
        val_fraction: share of the corpus (taken from its end) held out for evaluation.
        source: where the corpus came from, recorded in the manifest.

    Returns:
        The manifest.
    """
    writer = ShardWriter(out_dir, dtype=TOKEN_DTYPE, shard_tokens=shard_tokens, val_fraction=val_fraction)
    try:
        writer.write(encode(text))
        splits = writer.finish()
    except BaseException:
        writer.abort()
        raise
    manifest = {
        "tokenizer": TOKENIZER,
        "vocab_size": 256,
        "dtype": TOKEN_DTYPE,
        "source": source,
        "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "splits": splits,
        "max_token_id": writer.max_token_id,
        "tokenizer_files": {},
    }
    write_manifest(out_dir, manifest)
    return manifest


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Write ``manifest.json`` atomically (last, once every file it lists is in place)."""
    atomic_write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2))


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype for ids ``0 .. vocab_size - 1``: uint16 up to id 65,535, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _ShardFiles:
    """``{split}_NNN.bin`` files of ``shard_tokens`` tokens each, written (and hashed) as tokens come."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < len(tokens):
            if self._file is None:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                name = f"{self.split}_{len(self.shards):03d}.bin"
                self.shards.append({"file": name, "tokens": 0, "sha256": ""})
                self._file = open(self.out_dir / name, "wb")  # noqa: SIM115 (closed by _close)
                self._hash, self._count = hashlib.sha256(), 0
            n = min(self.shard_tokens - self._count, len(tokens) - pos)
            block = tokens[pos : pos + n].tobytes()
            self._file.write(block)
            self._hash.update(block)
            self._count += n
            pos += n
            if self._count == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())

    def close(self) -> None:
        if self._file is not None:
            self._close()

    def paths(self) -> list[Path]:
        return [self.out_dir / s["file"] for s in self.shards]


class ShardWriter:
    """Stream tokens into shards; the last ``val_fraction`` of the tokens becomes the val split.

    Tokens go to ``train_NNN.bin`` files as they come (memory stays bounded). :meth:`finish`
    knows the total, so it copies the tail into ``val_NNN.bin`` files and cuts the train files
    there: the same shards as splitting the whole token array. ``out_dir`` is created only when
    the first token arrives; :meth:`abort` removes every file written.
    """

    def __init__(self, out_dir: Path, *, dtype: str, shard_tokens: int, val_fraction: float = 0.05) -> None:
        if not 0 < val_fraction < 0.5:
            raise DataError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
        if shard_tokens < 1:
            raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.out_dir = Path(out_dir)
        self._existed = self.out_dir.exists()
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.val_fraction = val_fraction
        self.total = 0
        self.max_token_id = -1
        self._train = _ShardFiles(self.out_dir, "train", self.dtype, shard_tokens)
        self._val = _ShardFiles(self.out_dir, "val", self.dtype, shard_tokens)

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens (ids must fit the dtype)."""
        if not len(tokens):
            return
        self.max_token_id = max(self.max_token_id, int(tokens.max()))
        if self.max_token_id > np.iinfo(self.dtype).max:
            raise DataError(f"token id {self.max_token_id} does not fit the shard dtype {self.dtype}")
        self._train.write(np.asarray(tokens).astype(self.dtype, copy=False))
        self.total += len(tokens)

    def finish(self) -> dict:
        """Close the files, carve the val split off the end; returns the manifest's ``splits``."""
        self._train.close()
        if self.total < MIN_TOKENS:
            raise DataError(f"corpus too small: {self.total} tokens (need at least {MIN_TOKENS})")
        n_val = int(self.total * self.val_fraction)
        cut = self.total - n_val
        itemsize, block = self.dtype.itemsize, 1 << 20
        keep = []
        for k, shard in enumerate(self._train.shards):
            start, path = k * self.shard_tokens, self.out_dir / shard["file"]
            if start + shard["tokens"] <= cut:
                keep.append(shard)
                continue
            with open(path, "rb") as f:
                f.seek(max(cut - start, 0) * itemsize)
                while data := f.read(block * itemsize):
                    self._val.write(np.frombuffer(data, dtype=self.dtype))
            if start < cut:  # the shard the cut falls in keeps its head
                os.truncate(path, (cut - start) * itemsize)
                keep.append({**shard, "tokens": cut - start, "sha256": file_sha256(path)})
            else:
                path.unlink()
        self._val.close()
        self._train.shards = keep
        return {
            "train": {"tokens": cut, "shards": keep},
            "val": {"tokens": n_val, "shards": self._val.shards},
        }

    def abort(self) -> None:
        """Remove every file written (and ``out_dir`` when this writer created it)."""
        for files in (self._train, self._val):
            if files._file is not None:
                files._file.close()
                files._file = None
            for path in files.paths():
                path.unlink(missing_ok=True)
        if not self._existed:
            with contextlib.suppress(OSError):
                self.out_dir.rmdir()


def load_manifest(data_dir: Path) -> dict:
    """Read the manifest of a prepared data set, with a clear error when it is absent."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in {data_dir}: run `rfsdp prepare-data` first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from e


def verify_shards(data_dir: Path, manifest: dict) -> None:
    """Check every shard's presence, size and checksum against the manifest."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = Path(data_dir) / shard["file"]
            if not path.is_file():
                raise DataError(f"missing data shard {path}")
            if path.stat().st_size != shard["tokens"] * itemsize:
                raise DataError(f"data shard {path} has the wrong size (truncated?)")
            if file_sha256(path) != shard["sha256"]:
                raise DataError(f"data shard {path} fails its checksum (corrupt)")
    for name, digest in manifest.get("tokenizer_files", {}).items():
        path = Path(data_dir) / TOKENIZER_DIR / name
        if not path.is_file():
            raise DataError(f"missing tokenizer file {path}")
        if file_sha256(path) != digest:
            raise DataError(f"tokenizer file {path} fails its checksum (corrupt)")


def tokenizer_dir(data_dir: Path) -> Path | None:
    """The data set's tokenizer directory (``DATA/tokenizer``, loadable by Hugging Face
    ``AutoTokenizer``), or None for a byte-level data set.
    """
    path = Path(data_dir) / TOKENIZER_DIR
    if not load_manifest(data_dir).get("tokenizer_files") or not (path / "tokenizer.json").is_file():
        return None  # byte-level (a tokenizer/ left by an earlier run into the same directory is stale)
    return path


def data_vocab(manifest: dict) -> tuple[int, int]:
    """``(vocab_size, max_token_id)`` of a data set: a model needs ``vocab_size > max_token_id``.

    Manifests written before ``max_token_id`` existed are byte-level: ``(256, 255)``.
    """
    vocab = int(manifest.get("vocab_size", 256))
    return vocab, int(manifest.get("max_token_id", vocab - 1))


def load_split(data_dir: Path, split: str) -> np.ndarray:
    """The tokens of one split as one array (shards are memory-mapped, then joined)."""
    manifest = load_manifest(data_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{data_dir} has no {split!r} split")
    parts = [
        np.memmap(Path(data_dir) / s["file"], dtype=manifest["dtype"], mode="r")
        for s in manifest["splits"][split]["shards"]
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
