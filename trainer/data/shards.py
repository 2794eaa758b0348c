"""Corpus -> token shards with a checksummed manifest, and the rank-sharded loader.

The tokenizer is byte-level UTF-8 (vocabulary 256): real, lossless and offline. The default
corpus is the Python reference documentation that ships with every CPython
(``pydoc_data.topics``), so data prep needs no download.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.errors import NonTransientError
from trainer.fsutil import atomic_write_text, file_sha256

MANIFEST = "manifest.json"
TOKENIZER = "bytes-utf8"
TOKEN_DTYPE = "uint16"  # room for a larger vocabulary than bytes without a format change


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


def prepare_tokens(text: str, out_dir: Path, *, shard_tokens: int = 1 << 20, val_fraction: float = 0.05, source: str = "") -> dict:
    """Tokenize ``text`` into train/val shards under ``out_dir`` and write the manifest.

    Args:
        text: the corpus.
        out_dir: directory that receives ``train_NNN.bin``, ``val_NNN.bin`` and the manifest.
        shard_tokens: tokens per shard file.
        val_fraction: share of the corpus (taken from its end) held out for evaluation.
        source: where the corpus came from, recorded in the manifest.

    Returns:
        The manifest.
    """
    if not 0 < val_fraction < 0.5:
        raise DataError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    tokens = encode(text)
    if len(tokens) < 10_000:
        raise DataError(f"corpus too small: {len(tokens)} tokens (need at least 10000)")
    out_dir.mkdir(parents=True, exist_ok=True)
    n_val = int(len(tokens) * val_fraction)
    splits = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val :]}
    manifest: dict = {
        "tokenizer": TOKENIZER,
        "vocab_size": 256,
        "dtype": TOKEN_DTYPE,
        "source": source,
        "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "splits": {},
    }
    for split, data in splits.items():
        shards = []
        for i, start in enumerate(range(0, len(data), shard_tokens)):
            name = f"{split}_{i:03d}.bin"
            chunk = data[start : start + shard_tokens]
            path = out_dir / name
            with open(path, "wb") as f:
                f.write(chunk.tobytes())
                f.flush()
                os.fsync(f.fileno())
            shards.append({"file": name, "tokens": int(len(chunk)), "sha256": file_sha256(path)})
        manifest["splits"][split] = {"tokens": int(len(data)), "shards": shards}
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


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


def load_split(data_dir: Path, split: str) -> np.ndarray:
    """The tokens of one split as one array (shards are memory-mapped, then joined)."""
    manifest = load_manifest(data_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{data_dir} has no {split!r} split")
    parts = [np.memmap(Path(data_dir) / s["file"], dtype=manifest["dtype"], mode="r") for s in manifest["splits"][split]["shards"]]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(slots=True)
class TokenLoader:
    """Deterministic rank-sharded batches of (input, target) windows.

    Sample ``i`` of the global stream starts at ``(i * stride) mod (N - seq_len - 1)`` with a
    stride coprime to the modulus, so windows are spread over the corpus. Each step consumes
    ``world_size * batch_size`` samples; rank ``r`` takes its contiguous slice. ``position`` (the
    next global sample index) is the loader's whole state and goes into every checkpoint.
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    rank: int
    world_size: int
    position: int = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) batch of this rank; advances the position."""
        span = len(self.tokens) - self.seq_len - 1
        stride = _coprime_stride(span, self.seq_len)
        first = self.position + self.rank * self.batch_size
        starts = [((first + b) * stride) % span for b in range(self.batch_size)]
        window = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        self.position += self.world_size * self.batch_size
        batch = torch.from_numpy(window)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        """The loader's position."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by :meth:`state_dict`."""
        self.position = int(state["position"])


def _coprime_stride(span: int, seq_len: int) -> int:
    stride = seq_len * 7 + 1
    while np.gcd(stride, span) != 1:
        stride += 1
    return stride
