"""Checkpoint mirroring to object storage, and resuming from it on a machine with an empty run dir.

Remote layout under ``--checkpoint-uri`` (a remote run dir, readable by ``trainer.storage.store.fetch_run_dir``)::

    <uri>/checkpoints/step_000120/...   the files a checkpoint's manifest lists, manifest.json last
    <uri>/checkpoints/latest            names the newest checkpoint whose every object is verified
    <uri>/config.json                   the owning run's identity (trajectory config + data manifest
                                        sha256), written by the launcher before the first step
    <uri>/events.jsonl                  a copy of the run dir's, refreshed after each mirrored checkpoint

Rank 0 hands every published (durable) local checkpoint to :class:`CheckpointMirror`, whose
background thread uploads it while training goes on. The remote ``latest`` moves only after every
object of that checkpoint is uploaded and checked (size and SHA-256 against the manifest). A failed
upload is retried with exponential backoff (a ``mirror_failed`` event per failure) and never stops
training; checkpoints published meanwhile wait (only the newest of them: it replaces older queued ones).

The thread survives its own failures: an event it cannot write (a full volume) is reported on
stderr and mirroring goes on; an unexpected error ends the thread but not the run. Either way
:meth:`CheckpointMirror.close` then returns False. ``events.jsonl`` is uploaded only when it changed
since its last upload (size and mtime); when it did, it is uploaded whole (S3 has no append).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

from trainer.checkpoint import CHECKPOINTS, LATEST, MANIFEST, CheckpointError, verify_checkpoint
from trainer.events import EVENTS_FILE, EventLog, Mirror, MirrorFailed, MirrorRestore, RunWarning
from trainer.fsutil import atomic_write_text
from trainer.storage.store import (
    RUN_FILES,
    BadLatest,
    Storage,
    StorageError,
    download_checkpoint,
    open_storage,
    remote_checkpoints,
    remote_latest,
)

FINAL_WAIT_S = 120.0
"""How long the end of a run waits for its last checkpoint to be mirrored."""


class CheckpointMirror:
    """Uploads published checkpoints of one run dir to ``uri`` in a background thread (rank 0 only).

    Args:
        uri: the remote run dir (``s3://bucket/prefix`` or a path).
        run_dir: the local run dir (its ``events.jsonl`` receives ``mirror`` / ``mirror_failed``).
        keep_last: remote retention: checkpoints older than the newest ``keep_last`` are deleted.
        backoff: first and longest delay between retries of a failed upload, in seconds.
    """

    def __init__(self, uri: str, run_dir: Path, *, keep_last: int, backoff: tuple[float, float] = (1.0, 30.0)) -> None:
        self.store: Storage = open_storage(uri)
        self.run_dir = Path(run_dir)
        self.events = EventLog(self.run_dir, rank=0)
        self.keep_last = keep_last
        self.backoff = backoff
        self._queued: Path | None = None
        self._closing = False
        self._stop = False
        self._current: int | None = None  # step being mirrored
        self._failures: list[str] = []  # what the thread could not do or record (close reports it)
        self._dropped = False  # a queued checkpoint was given up without being mirrored
        self._uploaded: dict[str, tuple[int, int]] = {}  # run file -> (size, mtime_ns) last uploaded
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side
    def submit(self, checkpoint: Path) -> None:
        """Queue a published checkpoint (the ``Checkpointer``'s ``on_published``); never blocks.

        Only the newest queued checkpoint matters: it replaces one not yet started.
        """
        with self._cv:
            self._queued = Path(checkpoint)
            self._cv.notify_all()

    def close(self, *, wait: bool = True, timeout: float = FINAL_WAIT_S) -> bool:
        """Finish: with ``wait``, give the queued checkpoint up to ``timeout`` s to be mirrored.

        Returns True when everything queued was mirrored and recorded: False when the upload did
        not finish in time, a queued checkpoint was given up, the final upload of the run's files
        failed, an event could not be written or the thread died (see :attr:`failures`). A failing
        process passes ``wait=False``: its restart must not wait for an upload.
        """
        with self._cv:
            self._closing = True
            self._stop = not wait
            self._cv.notify_all()
        self._thread.join(timeout if wait else 0)
        if not self._thread.is_alive():
            return not self._failures and not self._dropped
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if wait:
            error = f"the run ended before the upload finished (waited {timeout:g} s)"
            self._emit(MirrorFailed(step=self._current, attempt=None, error=error, retry_in_s=None))
        return False

    @property
    def failures(self) -> list[str]:
        """What the mirror could not do or record (empty while all is well)."""
        return list(self._failures)

    def _fail(self, what: str) -> None:
        self._failures.append(what)
        print(f"rfsdp checkpoint mirror: {what}", file=sys.stderr, flush=True)

    def _emit(self, event: object) -> None:
        """Append an event; one that cannot be written is reported on stderr, never raised (the
        mirror goes on: its uploads do not depend on the local volume having room for a line).
        """
        try:
            self.events.emit(event)  # type: ignore[arg-type]
        except Exception as e:  # whatever it is: the mirror must go on
            self._fail(f"could not write the {type(event).__name__} event to {self.events.path}: {e}")

    def restore(self, *, fingerprint: str, world_size: int) -> int | None:
        """Put the newest complete remote checkpoint into the empty local run dir; returns its step.

        Candidates are the checkpoint ``latest`` names, then older ones (newer remote dirs may be
        partial uploads). Each is downloaded into a temp dir, checked object by object against its
        manifest and with ``verify_checkpoint``, and only then renamed to ``step_NNNNNN`` and made
        ``latest``. A bad one is skipped with a ``warning`` event. The remote ``events.jsonl`` is
        copied too when the local run dir has none, so the run's history stays whole.

        A remote ``latest`` that names no checkpoint (garbage, not UTF-8) is repaired like a local
        one: ignored, every remote checkpoint is a candidate, newest first, and the one restored
        gets a ``warning`` event (``latest_repaired``, ``was`` what the marker held).
        """
        try:
            latest, bad = remote_latest(self.store), None
        except BadLatest as e:
            latest, bad = None, e.text
        if latest is None and bad is None:
            return None
        candidates = list(reversed(remote_checkpoints(self.store, upto=latest)))
        if not candidates:
            return None
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        if not (self.run_dir / EVENTS_FILE).exists() and self.store.stat(EVENTS_FILE) is not None:
            self.store.download(EVENTS_FILE, self.run_dir / EVENTS_FILE)
        for step, name in candidates:
            t0 = time.perf_counter()
            tmp = root / f"{name}.tmp-download"  # removed as stale by the Checkpointer if we die here
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                download_checkpoint(self.store, name, tmp)
                manifest = verify_checkpoint(tmp, fingerprint=fingerprint, world_size=world_size)
            except (StorageError, CheckpointError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self.events.emit(
                    RunWarning(kind="checkpoint_skipped", step=step, reason=f"remote {self.store.url(name)}: {e}")
                )
                continue
            tmp.rename(root / name)
            atomic_write_text(root / LATEST, name + "\n")
            nbytes = sum(f["size"] for f in manifest["files"].values())
            self.events.emit(
                MirrorRestore(
                    step=step,
                    uri=self.store.url(f"{CHECKPOINTS}/{name}"),
                    bytes=nbytes,
                    download_s=time.perf_counter() - t0,
                )
            )
            if bad is not None:
                self.events.emit(RunWarning(kind="latest_repaired", step=step, was=f"remote {bad!r}"))
            return step
        return None

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the run goes on without a mirror; close() reports it
            self._fail(f"the mirror thread died: {type(e).__name__}: {e}")
            self._dropped = True

    def _loop(self) -> None:
        self._abort_leftover_uploads()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queued is not None or self._closing)
                checkpoint, self._queued = self._queued, None
                if self._stop:
                    return
            if checkpoint is None:  # the run ended and everything queued is mirrored
                self._final_sync()
                return
            self._mirror_with_retries(checkpoint)

    def _abort_leftover_uploads(self) -> None:
        """Abort the multipart uploads a killed predecessor left under the location (S3 bills their
        invisible parts until then). The location is this run's: nobody else uploads there.
        """
        try:
            self.store.abort_incomplete_uploads()
        except (StorageError, OSError) as e:
            self._emit(
                MirrorFailed(step=None, attempt=None, error=f"aborting unfinished uploads: {e}", retry_in_s=None)
            )

    def _final_sync(self) -> None:
        # The run's last events (run_end) come after its last checkpoint was mirrored.
        try:
            self._upload_run_files()
        except (StorageError, OSError) as e:
            self._dropped = True  # the remote run dir lacks the run's last events
            self._emit(MirrorFailed(step=None, attempt=1, error=str(e), retry_in_s=None))

    def _mirror_with_retries(self, checkpoint: Path) -> None:
        """Upload until it succeeds; give up only when the local copy is gone (local retention
        removed it: newer checkpoints exist) or the run is ending.
        """
        step = int(checkpoint.name.removeprefix("step_"))
        self._current = step
        delay, attempt = self.backoff[0], 0
        while True:
            attempt += 1
            t0 = time.perf_counter()
            try:
                nbytes = self._upload(checkpoint)
            except (StorageError, OSError, CheckpointError) as e:
                give_up = self._stop or not checkpoint.is_dir()
                self._emit(
                    MirrorFailed(step=step, attempt=attempt, error=str(e), retry_in_s=None if give_up else delay)
                )
                with self._cv:
                    if give_up or self._cv.wait_for(lambda: self._stop, timeout=delay):
                        # Local retention removed it (a newer one is queued) or the run is ending.
                        self._dropped = self._dropped or self._stop
                        return
                delay = min(2 * delay, self.backoff[1])
                continue
            self._dropped = False  # the newest queued checkpoint is mirrored
            self._emit(
                Mirror(
                    step=step,
                    uri=self.store.url(f"{CHECKPOINTS}/{checkpoint.name}"),
                    bytes=nbytes,
                    upload_s=time.perf_counter() - t0,
                    attempts=attempt,
                )
            )
            return

    def _upload(self, checkpoint: Path) -> int:
        """Upload one checkpoint, verify every object, then move the remote ``latest``; returns bytes.

        A checkpoint the remote ``latest`` already names (offered again at a resume) is complete
        there: only the run's files are brought up to date.
        """
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        try:
            latest = remote_latest(self.store)
        except BadLatest:  # names no checkpoint: this upload replaces it
            latest = None
        if latest == checkpoint.name:
            self._upload_run_files()
            return sum(rec["size"] for rec in manifest["files"].values())
        prefix = f"{CHECKPOINTS}/{checkpoint.name}"
        for name, rec in sorted(manifest["files"].items()):
            self.store.upload(checkpoint / name, f"{prefix}/{name}", sha256=rec["sha256"])
        manifest_info = self.store.upload(checkpoint / MANIFEST, f"{prefix}/{MANIFEST}")
        expected = {**manifest["files"], MANIFEST: {"size": manifest_info.size, "sha256": manifest_info.sha256}}
        for name, rec in expected.items():
            info = self.store.stat(f"{prefix}/{name}")
            if info is None or info.size != rec["size"] or info.sha256 not in (None, rec["sha256"]):
                raise StorageError(f"{self.store.url(f'{prefix}/{name}')}: uploaded object does not match the manifest")
        self.store.write_bytes(f"{CHECKPOINTS}/{LATEST}", (checkpoint.name + "\n").encode())
        self._retain(checkpoint.name, manifest.get("fingerprint"))
        self._upload_run_files()
        return sum(rec["size"] for rec in manifest["files"].values())

    def _retain(self, latest: str, fingerprint: str | None) -> None:
        """Delete the remote checkpoints older than the newest ``keep_last``: only this run's (a
        complete one whose manifest names another training config is never touched; the launcher
        refuses a location another run owns, this is the second line of defence).
        """
        old = [
            name
            for _, name in remote_checkpoints(self.store, upto=latest)[: -self.keep_last]
            if self._ours(name, fingerprint)
        ]
        self.store.delete([key for name in old for key in self.store.list(f"{CHECKPOINTS}/{name}")])

    def _ours(self, name: str, fingerprint: str | None) -> bool:
        key = f"{CHECKPOINTS}/{name}/{MANIFEST}"
        if self.store.stat(key) is None:
            return True  # a partial upload (the manifest goes last): only this run uploads here
        try:
            theirs = json.loads(self.store.read_bytes(key)).get("fingerprint")
        except (StorageError, ValueError, AttributeError):
            return False  # unreadable: not known to be ours, kept
        return theirs == fingerprint

    def _upload_run_files(self) -> None:
        """Upload the run's files, each only when it changed (size or mtime) since its last upload."""
        for name in RUN_FILES:
            path = self.run_dir / name
            if not path.is_file():
                continue
            st = path.stat()
            if self._uploaded.get(name) == (st.st_size, st.st_mtime_ns):
                continue
            data = path.read_bytes()
            if name == EVENTS_FILE:  # whole lines only: another rank or thread may be appending one
                data = data[: data.rfind(b"\n") + 1]
            self.store.write_bytes(name, data)
            if len(data) == st.st_size:  # a torn last line left out: upload again next time
                self._uploaded[name] = (st.st_size, st.st_mtime_ns)
