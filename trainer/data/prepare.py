"""Data prep: a corpus (a file, a directory, an ``s3://`` prefix or the built-in one) becomes
checksummed token shards at a local or ``s3://`` location (``rfsdp prepare-data`` and the
pipeline's ``prepare_data`` step); and a prepared data set's verified local copy for a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from trainer.data import BUILTIN_CORPUS
from trainer.data.shards import MANIFEST, builtin_corpus_text, prepare_tokens, verify_shards
from trainer.storage.store import StorageError, check_key, is_remote, open_storage, read_corpus, upload_tree

DEFAULT_SHARD_TOKENS = 1 << 20


def read_corpus_text(source: str) -> str:
    """The corpus text of ``source``.

    Raises:
        ValueError: naming ``--source`` when there is no corpus file there.
    """
    if source == BUILTIN_CORPUS:
        return builtin_corpus_text()
    if is_remote(source):
        return read_corpus(source)
    path = Path(source.removeprefix("file://"))
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files or not all(p.exists() for p in files):
        raise ValueError(f"--source: no corpus file at {source}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def prepare_dataset(source: str, out: str, *, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict:
    """Tokenize ``source`` into shards + ``manifest.json`` at ``out``; returns the manifest.

    A remote ``out`` is checked before any work (a missing bucket or bad credentials fail first)
    and gets the shards first, the manifest last: readers never see a partial data set.
    """
    if is_remote(out):
        open_storage(out).check()
    text = read_corpus_text(source)
    if not is_remote(out):
        return prepare_tokens(text, Path(out.removeprefix("file://")), shard_tokens=shard_tokens, source=source)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = prepare_tokens(text, Path(tmp), shard_tokens=shard_tokens, source=source)
        upload_tree(Path(tmp), out, last=MANIFEST)
    return manifest


def local_data(uri: str, run_dir: Path) -> Path:
    """A local directory holding the prepared data set at ``uri``.

    A local path (or ``file://`` URI) is returned as is. An ``s3://`` data set is downloaded once
    into ``RUN_DIR/data_cache/<manifest sha256>/``: every shard verified against the manifest's
    checksum, the directory renamed into place only when complete. Later calls (every rank, every
    restart) reuse it.
    """
    if not is_remote(uri):
        return Path(str(uri).removeprefix("file://"))
    store = open_storage(uri)
    manifest_bytes = store.read_bytes(MANIFEST)
    try:
        manifest = json.loads(manifest_bytes)
        shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise StorageError(f"{store.url(MANIFEST)} is not a data manifest ({e})") from None
    dest = Path(run_dir) / "data_cache" / hashlib.sha256(manifest_bytes).hexdigest()[:16]
    if (dest / MANIFEST).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        for shard in shards:
            store.download(shard["file"], tmp / check_key(uri, shard["file"]), sha256=shard["sha256"])
        (tmp / MANIFEST).write_bytes(manifest_bytes)
        verify_shards(tmp, manifest)
        os.replace(tmp, dest)
    except OSError as e:
        if not (dest / MANIFEST).is_file():  # else another rank finished first: use its copy
            raise StorageError(f"{uri}: cannot cache the data set in {dest.parent} ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
