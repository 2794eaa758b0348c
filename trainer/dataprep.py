"""Data prep: a corpus (a file, a directory, an ``s3://`` prefix or the built-in one) becomes
checksummed token shards at a local or ``s3://`` location. Called by ``rfsdp prepare-data`` and
the pipeline's ``prepare_data`` step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.data import BUILTIN_CORPUS, MANIFEST, builtin_corpus_text, prepare_tokens
from trainer.storage import is_remote, open_storage, read_corpus, upload_tree

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
