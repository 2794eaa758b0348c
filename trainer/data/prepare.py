"""Data prep: a corpus (text, JSON lines or Parquet; a file, a directory, an ``s3://`` prefix or
the built-in one) becomes checksummed token shards at a local or ``s3://`` location (``rfsdp
prepare-data`` and the pipeline's ``prepare_data`` step); and a prepared data set's verified
local copy for a run. See ``docs/data.md``.

The corpus is streamed: read, tokenized and written in bounded batches, hashed as it goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.corpus import Corpus
from trainer.data.shards import MANIFEST, TOKENIZER_DIR, ShardWriter, verify_shards, write_manifest
from trainer.data.tokenize import Tokenizer, byte_tokenizer, check_train_vocab, copy_files, load_tokenizer, train_bpe
from trainer.errors import ParameterError
from trainer.fsutil import file_sha256
from trainer.storage.store import StorageError, check_key, is_remote, open_storage, upload_tree

DEFAULT_SHARD_TOKENS = 1 << 20
BATCH_CHARS = 1 << 20
"""Text is tokenized (and written) in batches of about this many characters."""


def prepare_dataset(
    source: str,
    out: str,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    tokenizer: str | None = None,
    text_field: str = "text",
    train_tokenizer: int = 0,
) -> dict:
    """Tokenize ``source`` into shards + ``manifest.json`` at ``out``; returns the manifest.

    Args:
        source: corpus file, directory, ``s3://`` object or prefix, or ``builtin:python-docs``.
        out: output directory or ``s3://bucket/prefix``.
        shard_tokens: tokens per shard file.
        tokenizer: a Hugging Face tokenizer directory or ``tokenizer.json`` (local or ``s3://``);
            None: byte-level UTF-8.
        text_field: the JSON field / Parquet column holding a record's text.
        train_tokenizer: > 0: train a byte-level BPE of this vocabulary size on the corpus first.

    Bad parameters are refused (:class:`ParameterError`) before anything is written to ``out``.
    A remote ``out`` is checked before any work (a missing bucket or bad credentials fail first)
    and gets the shards first, the manifest last: readers never see a partial data set.
    """
    if tokenizer and train_tokenizer:
        raise ParameterError("train_tokenizer", "cannot be combined with --tokenizer (train one or give one)")
    if train_tokenizer:
        check_train_vocab(train_tokenizer)
    if shard_tokens < 1:
        raise ParameterError("shard_tokens", f"must be at least 1, got {shard_tokens}")
    if is_remote(out):
        open_storage(out).check()
    with tempfile.TemporaryDirectory(prefix="rfsdp-prepare-") as tmp:
        work = Path(tmp)
        tok = load_tokenizer(tokenizer, work) if tokenizer else byte_tokenizer()
        corpus = Corpus(source, text_field=text_field)
        if train_tokenizer:
            tok = train_bpe(corpus.texts(), train_tokenizer, work / "trained")
            corpus.check_not_empty()
        if not is_remote(out):
            return _write(corpus, tok, Path(out.removeprefix("file://")), shard_tokens)
        manifest = _write(corpus, tok, work / "out", shard_tokens)
        upload_tree(work / "out", out, last=MANIFEST)
    return manifest


def _write(corpus: Corpus, tok: Tokenizer, out_dir: Path, shard_tokens: int) -> dict:
    """Stream the corpus through the tokenizer into shards, then the tokenizer files and the manifest."""
    writer = ShardWriter(out_dir, dtype=tok.dtype, shard_tokens=shard_tokens)
    digest = hashlib.sha256()
    try:
        for tokens in _token_batches(corpus, tok, digest):
            writer.write(tokens)
        corpus.check_not_empty()
        splits = writer.finish()
        copy_files(tok, out_dir / TOKENIZER_DIR)
    except BaseException:
        if tok.files:
            shutil.rmtree(out_dir / TOKENIZER_DIR, ignore_errors=True)
        writer.abort()
        raise
    manifest = {
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": tok.dtype,
        "source": corpus.source,
        "corpus_sha256": digest.hexdigest(),
        "splits": splits,
        "max_token_id": writer.max_token_id,
        "tokenizer_files": {name: file_sha256(out_dir / TOKENIZER_DIR / name) for name in sorted(tok.files)},
        "text_field": corpus.text_field,
        "documents": corpus.documents,
        "skipped_records": corpus.skipped,
    }
    write_manifest(out_dir, manifest)
    return manifest


def _token_batches(corpus: Corpus, tok: Tokenizer, digest: Any) -> Iterator[np.ndarray]:
    """Token arrays of about ``BATCH_CHARS`` of text each; documents joined by the tokenizer's
    separator (its EOS token, else a blank line). ``digest`` receives the documents' text joined
    by blank lines (the corpus checksum, the same whatever the tokenizer).
    """
    separator = tok.separator()
    batch: list[tuple[bool, str]] = []  # (a separator goes before it, text)
    size, seen = 0, False
    for first, text in corpus.blocks():
        if first and seen:
            digest.update(b"\n\n")
        digest.update(text.encode("utf-8"))
        batch.append((first and seen, text))
        seen = True
        size += len(text)
        if size >= BATCH_CHARS:
            yield _encode(tok, batch, separator)
            batch, size = [], 0
    if batch:
        yield _encode(tok, batch, separator)


def _encode(tok: Tokenizer, batch: list[tuple[bool, str]], separator: np.ndarray) -> np.ndarray:
    parts = []
    for (sep, _), ids in zip(batch, tok.encode_batch([text for _, text in batch]), strict=True):
        if sep:
            parts.append(separator)
        parts.append(ids)
    return np.concatenate(parts).astype(tok.dtype, copy=False)


def local_data(uri: str, run_dir: Path) -> Path:
    """A local directory holding the prepared data set at ``uri``.

    A local path (or ``file://`` URI) is returned as is. An ``s3://`` data set is downloaded once
    into ``RUN_DIR/data_cache/<manifest sha256>/``: every shard (and the tokenizer's files under
    ``tokenizer/``) verified against the manifest's checksum, the directory renamed into place
    only when complete. Later calls (every rank, every restart) reuse it.
    """
    if not is_remote(uri):
        return Path(str(uri).removeprefix("file://"))
    store = open_storage(uri)
    manifest_bytes = store.read_bytes(MANIFEST)
    try:
        manifest = json.loads(manifest_bytes)
        files = {s["file"]: s["sha256"] for split in manifest["splits"].values() for s in split["shards"]}
        files |= {f"{TOKENIZER_DIR}/{name}": digest for name, digest in manifest.get("tokenizer_files", {}).items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise StorageError(f"{store.url(MANIFEST)} is not a data manifest ({e})") from None
    dest = Path(run_dir) / "data_cache" / hashlib.sha256(manifest_bytes).hexdigest()[:16]
    if (dest / MANIFEST).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        for name, digest in files.items():  # the shards and the tokenizer's files
            store.download(name, tmp / check_key(uri, name), sha256=digest)
        (tmp / MANIFEST).write_bytes(manifest_bytes)
        verify_shards(tmp, manifest)
        os.replace(tmp, dest)
    except OSError as e:
        if not (dest / MANIFEST).is_file():  # else another rank finished first: use its copy
            raise StorageError(f"{uri}: cannot cache the data set in {dest.parent} ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
