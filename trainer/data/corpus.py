"""Reading a corpus as a stream of documents: text files, JSON lines and Parquet, local or
``s3://``, or the built-in corpus.

A source is a file, a directory (every file below it, sorted) or an ``s3://`` object or prefix
(every object below it, sorted). The reader follows each file's extension: ``.jsonl`` / ``.json``
are JSON lines and ``.parquet`` is Parquet, where each record (row) is one document, its text in
the ``text_field``; any other file is UTF-8 text and is one document. Records without a string
in that field are skipped and counted. Nothing is read whole: text comes in blocks of about
1 MB, JSON lines one line at a time, Parquet one record batch at a time, and an S3 object is
first streamed to a temporary file (deleted once read).
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.data import BUILTIN_CORPUS
from trainer.data.shards import DataError
from trainer.errors import ParameterError
from trainer.storage.store import StorageError, is_remote, open_storage

BLOCK_CHARS = 1 << 20
"""A text file is handed on in blocks of about this many characters, cut at a line break."""
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 1024


class Corpus:
    """The documents of ``source``; iterate :meth:`blocks` (once per pass, as often as needed).

    After a pass, ``documents`` counts the documents read and ``skipped`` the records that had
    no string in ``text_field``; ``chars`` counts the characters of text.

    Raises:
        ParameterError: naming ``--source`` when there is no corpus file at ``source``.
    """

    def __init__(self, source: str, *, text_field: str = "text") -> None:
        self.source = source
        self.text_field = text_field
        self.documents = self.skipped = self.chars = 0
        self._files = self._list()

    def _list(self) -> list[str]:
        """The keys (S3) or paths (local) to read, in order."""
        if self.source == BUILTIN_CORPUS:
            return []
        if is_remote(self.source):
            try:
                store = open_storage(self.source)
                keys = store.list()
                if not keys and store.stat("") is None:
                    raise ParameterError("source", f"no corpus object at {self.source}")
            except StorageError as e:
                raise ParameterError("source", str(e)) from None
            return keys or [""]
        path = Path(self.source.removeprefix("file://"))
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        if not files or not all(p.is_file() for p in files):
            raise ParameterError("source", f"no corpus file at {self.source}")
        return [str(p) for p in files]

    def blocks(self) -> Iterator[tuple[bool, str]]:
        """``(starts_a_document, text)`` pairs: a document's text, in one or more blocks."""
        self.documents = self.skipped = self.chars = 0
        for first, text in self._blocks():
            self.documents += first
            self.chars += len(text)
            yield first, text

    def texts(self) -> Iterator[str]:
        """The text blocks alone (for training a tokenizer)."""
        return (text for _, text in self.blocks())

    def check_not_empty(self) -> None:
        """After a pass: refuse a corpus without text, naming the parameter at fault."""
        if self.documents and self.chars:
            return
        if self.skipped and not self.documents:
            raise ParameterError(
                "text_field",
                f"no record of {self.source} has a string field {self.text_field!r} ({self.skipped:,} records)",
            )
        raise ParameterError("source", f"no text in {self.source}")

    def _blocks(self) -> Iterator[tuple[bool, str]]:
        if self.source == BUILTIN_CORPUS:
            from pydoc_data.topics import topics

            for key in sorted(topics):
                yield True, topics[key]
            return
        for name in self._files:
            with self._local(name) as path:
                suffix = Path(name or self.source).suffix.lower()
                if suffix in JSON_SUFFIXES:
                    yield from self._json_lines(path, name or self.source)
                elif suffix in PARQUET_SUFFIXES:
                    yield from self._parquet(path, name or self.source)
                else:  # as before: a local file's newlines are translated, an S3 object's kept
                    yield from _text_blocks(path, newline="" if is_remote(self.source) else None)

    @contextmanager
    def _local(self, name: str) -> Iterator[Path]:
        """A local path holding ``name`` (an S3 object streamed to a temporary file)."""
        if not is_remote(self.source):
            yield Path(name)
            return
        with tempfile.TemporaryDirectory(prefix="rfsdp-corpus-") as tmp:
            path = Path(tmp) / "object"
            open_storage(self.source).download(name, path)
            yield path

    def _record_text(self, record: object) -> str | None:
        value = record.get(self.text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            self.skipped += 1
            return None
        return value

    def _json_lines(self, path: Path, name: str) -> Iterator[tuple[bool, str]]:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{name}:{number}: not a JSON record ({e})") from None
                if (text := self._record_text(record)) is not None:
                    yield True, text

    def _parquet(self, path: Path, name: str) -> Iterator[tuple[bool, str]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{name}: not a Parquet file ({e})") from None
        if self.text_field not in file.schema_arrow.names:
            self.skipped += file.metadata.num_rows
            return
        is_text = pa.types.is_string(file.schema_arrow.field(self.text_field).type) or pa.types.is_large_string(
            file.schema_arrow.field(self.text_field).type
        )
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.text_field]):
            if not is_text:
                self.skipped += batch.num_rows
                continue
            for value in batch.column(0).to_pylist():
                if value is None:
                    self.skipped += 1
                else:
                    yield True, value


def _text_blocks(path: Path, *, newline: str | None) -> Iterator[tuple[bool, str]]:
    """One document: the file's text in blocks cut at a line break (see :func:`_seam`), so a
    tokenizer's pre-tokenization sees the same words as in the whole text.
    """
    first = True
    pending = ""
    with open(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=newline) as f:
        while chunk := f.read(BLOCK_CHARS):
            pending += chunk
            if cut := _seam(pending):
                yield first, pending[:cut]
                first, pending = False, pending[cut:]
    if pending or first:
        yield first, pending


def _seam(text: str) -> int:
    """Where to cut ``text`` (0: not yet): after the last lone newline between two non-space
    characters (GPT-2 and Llama style pre-tokenizers split there as in the whole text); past 4
    blocks without one, after the last newline, else anywhere.
    """
    if len(text) < BLOCK_CHARS:
        return 0
    end = len(text) - 1
    while (i := text.rfind("\n", 1, end)) >= 0 and len(text) - i < BLOCK_CHARS:
        if not text[i + 1].isspace() and not text[i - 1].isspace():
            return i + 1
        end = i
    if len(text) < 4 * BLOCK_CHARS:
        return 0
    return text.rfind("\n") + 1 or len(text)
