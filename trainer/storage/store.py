"""Object storage behind one small Protocol: local paths and S3 (boto3).

Locations are URIs: ``/path`` or ``file:///path`` (:class:`LocalStorage`) and
``s3://bucket/prefix`` (:class:`S3Storage`). Keys are ``/``-separated paths below that root.

For S3 the endpoint, region and credentials come only from the standard AWS environment and
config files (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, and ``AWS_ENDPOINT_URL`` for S3-compatible stores such as MinIO or moto):
never from parameters. Errors name the URI (and the endpoint), never a secret.

Integrity: every object this module writes to S3 records its SHA-256 in the object's user metadata;
every read re-hashes the bytes and compares them with that record and with the checksum the caller
expects (from a data or checkpoint manifest). Downloads land in a temporary file that is renamed
into place only once verified, so a corrupt object never leaves a half-written file behind.

Example::

    store = open_storage("s3://bucket/runs/a")
    store.upload(Path("manifest.json"), "data/manifest.json")
    store.download("data/manifest.json", Path("/tmp/m.json"))
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from trainer.checkpoint import CHECKPOINTS, LATEST, MANIFEST, step_dir_name
from trainer.events import EVENTS_FILE
from trainer.fsutil import file_sha256, fsync_dir

SHA256_META = "sha256"
"""S3 user-metadata key (``x-amz-meta-sha256``) holding an object's SHA-256."""
PART_SIZE = 16 << 20
"""Objects above this size are uploaded in parts of this size (S3 needs at least 5 MiB)."""
RUN_FILES = ("config.json", EVENTS_FILE)
"""Run-dir files (besides checkpoints) that a remote run dir holds."""


class StorageError(ValueError):
    """An object store refused or failed a request, or an object is missing or corrupt.

    A ``ValueError`` so that the CLI reports it as bad input (one line, no traceback). The
    message names the URI, never a credential.
    """


class ChecksumError(StorageError):
    """An object's bytes differ from its recorded or expected SHA-256."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """Size of a stored object and its recorded SHA-256 (None where the store keeps none)."""

    size: int
    sha256: str | None


class Storage(Protocol):
    """A tree of objects under one root URI."""

    uri: str

    def url(self, key: str) -> str:
        """The URI of ``key`` below the root (raises StorageError on a ``..`` segment)."""

    def check(self) -> None:
        """Raise StorageError when the root cannot be used (missing bucket, wrong credentials...)."""

    def list(self, prefix: str = "") -> list[str]:
        """Keys below ``prefix`` (recursive, sorted), relative to the root."""

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and recorded checksum of an object, None when it does not exist."""

    def upload(self, local: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        """Store a local file as ``key``; with ``sha256``, refuse a local file that differs from it."""

    def download(self, key: str, local: Path, *, sha256: str | None = None) -> None:
        """Fetch ``key`` into ``local`` (atomically), verified against the recorded and expected checksums."""

    def read_bytes(self, key: str, *, sha256: str | None = None) -> bytes:
        """The verified contents of ``key``."""

    def write_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` (readers see the old or the whole new object)."""

    def delete(self, keys: list[str]) -> None:
        """Remove objects (missing ones are ignored)."""

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort multipart uploads left unfinished below ``prefix`` (by a killed process); returns how many."""


def is_remote(uri: str) -> bool:
    """True for an object-store URI (``s3://``), False for a local path or ``file://`` URI."""
    return str(uri).startswith("s3://")


def open_storage(uri: str) -> Storage:
    """The storage for a URI: ``s3://bucket/prefix``, ``file:///path`` or a plain path."""
    uri = str(uri)
    if is_remote(uri):
        return S3Storage(uri)
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(f"{uri}: unsupported URI scheme (use a path, file:// or s3://)")
    return LocalStorage(uri)


def check_key(uri: str, key: str) -> str:
    """Return ``key`` normalized (no empty segments), refusing a path traversal."""
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StorageError(f"{uri}: refusing key {key!r}: path traversal ('..') is not allowed")
    return "/".join(parts)


def _join(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{key}" if key else root


# ------------------------------------------------------------------------------------------ local
class LocalStorage:
    """A directory on a local or shared file system (the ``file://`` flavour of :class:`Storage`)."""

    def __init__(self, uri: str) -> None:
        self.uri = str(uri)
        path = self.uri.removeprefix("file://")
        check_key(self.uri, path)
        self.root = Path(path)

    def url(self, key: str) -> str:
        """The path of ``key`` below the root."""
        return str(self.root / check_key(self.uri, key))

    def check(self) -> None:
        """A local root needs no check beyond not being a file."""
        if self.root.is_file():
            raise StorageError(f"{self.uri}: is a file, not a directory")

    def list(self, prefix: str = "") -> list[str]:
        """Files below ``prefix`` relative to the root, sorted."""
        base = self.root / check_key(self.uri, prefix)
        if base.is_file():
            return [check_key(self.uri, prefix)]
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()) if base.is_dir() else []

    def stat(self, key: str) -> ObjectInfo | None:
        """Size of the file (local files carry no recorded checksum)."""
        path = Path(self.url(key))
        return ObjectInfo(path.stat().st_size, None) if path.is_file() else None

    def upload(self, local: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        """Copy ``local`` to ``key`` through a temporary file, fsynced and renamed into place."""
        digest = _verified_local_sha256(local, sha256, self.url(key))
        with open(local, "rb") as src:
            self._write(key, src)
        return ObjectInfo(Path(local).stat().st_size, digest)

    def download(self, key: str, local: Path, *, sha256: str | None = None) -> None:
        """Copy ``key`` to ``local``, verified against ``sha256`` when given."""
        path = Path(self.url(key))
        if not path.is_file():
            raise StorageError(f"{path}: no such file")
        with open(path, "rb") as src:
            _receive(src, Path(local), sha256, None, str(path))

    def read_bytes(self, key: str, *, sha256: str | None = None) -> bytes:
        """Contents of ``key``, verified against ``sha256`` when given."""
        path = Path(self.url(key))
        if not path.is_file():
            raise StorageError(f"{path}: no such file")
        data = path.read_bytes()
        _check_digest(hashlib.sha256(data).hexdigest(), sha256, None, str(path))
        return data

    def write_bytes(self, key: str, data: bytes) -> None:
        """Atomically replace ``key`` with ``data``."""
        import io

        self._write(key, io.BytesIO(data))

    def delete(self, keys: list[str]) -> None:
        """Remove files."""
        for key in keys:
            Path(self.url(key)).unlink(missing_ok=True)

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Nothing to abort: a local upload is a temporary file renamed into place."""
        return 0

    def _write(self, key: str, src: IO[bytes]) -> None:
        target = Path(self.url(key))
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as tmp:
            shutil.copyfileobj(src, tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, target)
        fsync_dir(target.parent)


# --------------------------------------------------------------------------------------------- S3
class S3Storage:
    """A prefix in an S3 bucket (any S3-compatible store reachable through boto3).

    Args:
        uri: ``s3://bucket[/prefix]``.
        part_size: objects larger than this are uploaded as a multipart upload with parts of
            this size (at least 5 MiB), by boto3's managed transfer (parts in parallel). A failed
            multipart upload is aborted (by the transfer, and again by :meth:`upload` in case that
            abort was lost), so no invisible parts stay billed; one left by a killed process is
            aborted by :meth:`abort_incomplete_uploads` (the mirror calls it when it starts).
    """

    def __init__(self, uri: str, *, part_size: int = PART_SIZE) -> None:
        import boto3
        from botocore.config import Config

        self.uri = str(uri).rstrip("/")
        bucket, _, prefix = self.uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise StorageError(f"{uri}: no bucket name (expected s3://bucket/prefix)")
        self.bucket = bucket
        self.prefix = check_key(self.uri, prefix)
        if part_size < 5 << 20:
            raise StorageError(f"part_size must be at least 5 MiB, got {part_size}")
        self.part_size = part_size
        # Few, quick retries: callers that must survive outages (the mirror) retry with backoff.
        config = Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=30)
        self.client = boto3.session.Session().client("s3", config=config)
        self.endpoint = self.client.meta.endpoint_url

    def url(self, key: str) -> str:
        """``s3://bucket/prefix/key``."""
        return _join(self.uri, check_key(self.uri, key))

    def _key(self, key: str) -> str:
        return _join(self.prefix, check_key(self.uri, key)) if self.prefix else check_key(self.uri, key)

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Translate boto errors into one StorageError line naming the URI (never a secret)."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

        url = self.url(key)
        try:
            try:
                yield
            except S3UploadFailedError as e:  # the managed transfer wraps the client error it met
                if isinstance(e.__context__, ClientError | BotoCoreError):
                    raise e.__context__ from None
                raise StorageError(f"{url}: S3 upload failed ({e})") from None
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                raise StorageError(f"{url}: bucket {self.bucket!r} does not exist (endpoint {self.endpoint})") from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise StorageError(f"{url}: no such object") from None
            if code in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "403",
                "ExpiredToken",
                "InvalidToken",
            ):
                raise StorageError(
                    f"{url}: access denied ({code}); check the AWS credentials in the environment or AWS config"
                ) from None
            raise StorageError(
                f"{url}: S3 request failed ({code or 'error'}: {e.response.get('Error', {}).get('Message', '')})"
            ) from None
        except NoCredentialsError:
            raise StorageError(
                f"{url}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
            ) from None
        except EndpointConnectionError:
            raise StorageError(f"{url}: cannot reach the S3 endpoint {self.endpoint}") from None
        except BotoCoreError as e:  # connection reset, timeouts, incomplete reads...
            raise StorageError(f"{url}: S3 transfer failed ({type(e).__name__}, endpoint {self.endpoint})") from None

    def check(self) -> None:
        """Raise StorageError unless the bucket exists and the credentials may use it."""
        from botocore.exceptions import ClientError

        with self._errors(""):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) == "404":  # HEAD has no body: say which 404
                    raise StorageError(
                        f"{self.uri}: bucket {self.bucket!r} does not exist (endpoint {self.endpoint})"
                    ) from None
                raise

    def list(self, prefix: str = "") -> list[str]:
        """Keys below ``prefix``, relative to the root, sorted."""
        base = self._key(prefix)
        keys = []
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{base}/" if base else ""
            )
            for page in pages:
                keys += [obj["Key"] for obj in page.get("Contents", [])]
        start = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[start:] for k in keys)

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and recorded SHA-256 of an object (None when absent)."""
        from botocore.exceptions import ClientError

        with self._errors(key):
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise
        return ObjectInfo(head["ContentLength"], head.get("Metadata", {}).get(SHA256_META))

    def upload(self, local: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        """Upload a file (multipart above ``part_size``) with its SHA-256 in the metadata."""
        from boto3.s3.transfer import TransferConfig

        local = Path(local)
        digest = _verified_local_sha256(local, sha256, self.url(key))
        transfer = TransferConfig(multipart_threshold=self.part_size, multipart_chunksize=self.part_size)
        try:
            with self._errors(key):
                self.client.upload_file(
                    str(local),
                    self.bucket,
                    self._key(key),
                    ExtraArgs={"Metadata": {SHA256_META: digest}},
                    Config=transfer,
                )
        except BaseException:
            # The managed transfer aborts a failed multipart upload itself, but that request can be
            # lost too: its parts would stay invisible and billed. Abort whatever is left of this key.
            if not local.is_file() or local.stat().st_size >= self.part_size:  # (a smaller file: one PUT)
                self._abort_key_uploads(self._key(key))
            raise
        return ObjectInfo(local.stat().st_size, digest)

    def _abort_key_uploads(self, full_key: str, *, prefix: bool = False) -> int:
        """Abort the unfinished multipart uploads of ``full_key`` (of every key below it with
        ``prefix``); best effort: an error leaves them for the next sweep. Returns how many.
        """
        aborted = 0
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full_key)
            for page in pages:
                for up in page.get("Uploads", []):
                    if prefix or up["Key"] == full_key:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        aborted += 1
        except Exception:  # already failing: the caller's error is the one to report
            pass
        return aborted

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort every unfinished multipart upload below ``prefix`` (one a killed process left:
        S3 keeps and bills its parts until aborted). Only the owner of the location may call it:
        it also aborts uploads in progress. Returns how many were aborted.
        """
        base = self._key(prefix)
        return self._abort_key_uploads(f"{base}/" if base else "", prefix=True)

    def download(self, key: str, local: Path, *, sha256: str | None = None) -> None:
        """Stream ``key`` into a temporary file, verify it, then rename it to ``local``."""
        with self._errors(key):
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            _receive(obj["Body"], Path(local), sha256, obj.get("Metadata", {}).get(SHA256_META), self.url(key))

    def read_bytes(self, key: str, *, sha256: str | None = None) -> bytes:
        """The verified contents of ``key``."""
        with self._errors(key):
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = obj["Body"].read()
        _check_digest(hashlib.sha256(data).hexdigest(), sha256, obj.get("Metadata", {}).get(SHA256_META), self.url(key))
        return data

    def write_bytes(self, key: str, data: bytes) -> None:
        """One PUT (atomic in S3: readers see the old or the whole new object)."""
        with self._errors(key):
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                Metadata={SHA256_META: hashlib.sha256(data).hexdigest()},
            )

    def delete(self, keys: list[str]) -> None:
        """Delete objects in batches of 1000 (the S3 limit)."""
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            with self._errors(batch[0]):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True}
                )


# ----------------------------------------------------------------------------------- integrity
def _verified_local_sha256(local: Path, expected: str | None, url: str) -> str:
    if not Path(local).is_file():
        raise StorageError(f"{url}: local source {local} is not a file")
    digest = file_sha256(local)
    if expected is not None and digest != expected:
        raise StorageError(f"{url}: refusing to upload {local}: it fails its checksum (corrupt local file)")
    return digest


def _check_digest(actual: str, expected: str | None, recorded: str | None, url: str) -> None:
    for what, want in (("the expected checksum", expected), ("the checksum recorded with the object", recorded)):
        if want is not None and actual != want:
            raise ChecksumError(
                f"{url} fails its checksum: sha256 {actual[:12]}... differs from {what} {want[:12]}... (corrupt object)"
            )


class _Readable(Protocol):
    def read(self, size: int) -> bytes: ...


def _receive(src: _Readable, local: Path, expected: str | None, recorded: str | None, url: str) -> None:
    """Copy a stream into ``local`` via a temporary file that is renamed only once it verifies."""
    local.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=local.parent, prefix=f".{local.name}.", delete=False) as tmp:
        try:
            while block := src.read(1 << 20):
                digest.update(block)
                tmp.write(block)
            tmp.flush()
            os.fsync(tmp.fileno())
            _check_digest(digest.hexdigest(), expected, recorded, url)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, local)


# ------------------------------------------------------------------ data sets and run dirs
def upload_tree(local_dir: Path, uri: str, *, last: str | None = None) -> list[str]:
    """Upload every file below ``local_dir`` to ``uri``; ``last`` (e.g. the manifest) goes last,
    so that a reader who finds it finds everything it lists. Returns the uploaded keys.
    """
    store = open_storage(uri)
    names = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    names.sort(key=lambda n: n == last)
    for name in names:
        store.upload(Path(local_dir) / name, name)
    return names


def read_corpus(uri: str) -> str:
    """The text of a corpus object, or of every object below a prefix (sorted, joined by blank lines)."""
    store = open_storage(uri)
    keys = store.list()
    if not keys:  # not a prefix: the URI names one object
        return store.read_bytes("").decode("utf-8", errors="replace")
    return "\n\n".join(store.read_bytes(k).decode("utf-8", errors="replace") for k in keys)


def download_checkpoint(store: Storage, name: str, dest: Path, *, skip_corrupt: bool = False) -> Path:
    """Download the remote checkpoint ``checkpoints/<name>/`` into ``dest`` (which must not exist):
    the manifest first, then every file it lists, each verified against the manifest's checksum.
    With ``skip_corrupt`` a file that fails its checksum is left out instead of raising (a
    validator then reports the checkpoint incomplete).
    """
    prefix = f"{CHECKPOINTS}/{check_key(store.uri, name)}"
    manifest_bytes = store.read_bytes(f"{prefix}/{MANIFEST}")
    try:
        files = json.loads(manifest_bytes)["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise StorageError(f"{store.url(prefix)}: unreadable checkpoint manifest ({e})") from None
    dest.mkdir(parents=True)
    for file, rec in files.items():
        try:
            store.download(f"{prefix}/{file}", dest / check_key(store.uri, file), sha256=rec["sha256"])
        except ChecksumError:
            if not skip_corrupt:
                raise
    (dest / MANIFEST).write_bytes(manifest_bytes)
    return dest


_CHECKPOINT_NAME = re.compile(r"step_\d{6}")


def remote_latest(store: Storage) -> str | None:
    """The checkpoint name the remote ``checkpoints/latest`` marker names (None without one).

    Raises:
        BadLatest: the marker holds anything but a checkpoint's name (garbage, not UTF-8, a path):
            callers ignore it with a warning and use the newest checkpoint that verifies, as
            resume does with a bad local ``latest``.
    """
    if store.stat(f"{CHECKPOINTS}/{LATEST}") is None:
        return None
    text = store.read_bytes(f"{CHECKPOINTS}/{LATEST}").decode("utf-8", errors="backslashreplace").strip()
    if not _CHECKPOINT_NAME.fullmatch(text):
        raise BadLatest(f"{store.url(f'{CHECKPOINTS}/{LATEST}')} names no checkpoint ({text[:40]!r})", text)
    return text


class BadLatest(StorageError):
    """The remote ``latest`` marker names no checkpoint; ``text`` is what it holds (printable)."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text


def remote_checkpoints(store: Storage, *, upto: str | None) -> list[tuple[int, str]]:
    """Remote checkpoint dirs up to (including) ``upto`` (every one with ``None``), as
    ``(step, name)`` oldest first (newer ones may be partial uploads).
    """
    limit = int(upto.removeprefix("step_")) if upto is not None else None
    names = {key.split("/")[1] for key in store.list(CHECKPOINTS) if key.count("/") >= 2}
    steps = sorted(int(n.removeprefix("step_")) for n in names if _CHECKPOINT_NAME.fullmatch(n))
    return [(s, step_dir_name(s)) for s in steps if limit is None or s <= limit]


def fetch_run_dir(uri: str, dest: Path) -> Path:
    """Download a remote run dir (``events.jsonl``, ``config.json``, the remote ``latest`` marker
    and every checkpoint up to it) into ``dest`` and return it; a local ``uri`` is returned as is.

    Every object is verified by checksum; a checkpoint file that fails it is left out, so that the
    local copy shows the remote one's damage. Used by ``rfsdp validate`` / ``rfsdp log-mlflow`` on
    an ``s3://`` run dir (a checkpoint mirror's ``--checkpoint-uri``).
    """
    if not is_remote(uri):
        return Path(str(uri).removeprefix("file://"))
    store = open_storage(uri)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if store.stat(name) is not None:
            store.download(name, dest / name)
    try:
        latest = remote_latest(store)
    except BadLatest as e:  # copied as it is: the local copy shows the remote one's damage
        latest, bad = None, e.text
    else:
        bad = None
    if latest is not None or bad is not None:
        root = dest / CHECKPOINTS
        for _, name in remote_checkpoints(store, upto=latest):
            shutil.rmtree(root / name, ignore_errors=True)
            download_checkpoint(store, name, root / name, skip_corrupt=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / LATEST).write_text((latest or bad) + "\n")
    return dest
