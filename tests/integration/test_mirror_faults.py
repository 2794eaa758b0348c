"""Issue 34 (low): the checkpoint mirror and S3 uploads under real faults, against moto's S3 server.

- an event the mirror thread cannot write (its ``events.jsonl`` is no file) neither kills the
  thread nor lets ``close()`` report success;
- ``events.jsonl`` is uploaded again only when it changed;
- a multipart upload that fails, or whose process is killed, leaves no unfinished upload behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from botocore.exceptions import EndpointConnectionError

from trainer.checkpoint import CHECKPOINTS, MANIFEST
from trainer.events import EVENTS_FILE
from trainer.storage.mirror import CheckpointMirror
from trainer.storage.store import S3Storage, StorageError, open_storage, remote_latest


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint dir as the mirror sees it: files and a manifest with their sizes and checksums."""
    ckpt = run_dir / CHECKPOINTS / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    data = os.urandom(4096)
    (ckpt / "shard.bin").write_bytes(data)
    files = {"shard.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    (ckpt / MANIFEST).write_text(json.dumps({"files": files, "fingerprint": "f", "step": step}))
    return ckpt


def wait_for_latest(uri: str, name: str, timeout: float = 30) -> None:
    store = open_storage(uri)
    deadline = time.monotonic() + timeout
    while remote_latest(store) != name:
        assert time.monotonic() < deadline, f"remote latest never became {name}"
        time.sleep(0.1)


def uploads_left(uri: str) -> list[dict]:
    store = S3Storage(uri)
    return store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])


def test_mirror_survives_an_event_it_cannot_write(s3_bucket: str, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    uri = f"{s3_bucket}/run"
    (run / EVENTS_FILE).mkdir(parents=True)  # every append fails (EISDIR), as on a broken volume
    mirror = CheckpointMirror(uri, run, keep_last=3, backoff=(0.1, 0.1))
    mirror.submit(fake_checkpoint(run, 5))
    wait_for_latest(uri, "step_000005")
    time.sleep(0.5)  # the thread writes its `mirror` event now, and fails
    (run / EVENTS_FILE).rmdir()
    mirror.submit(fake_checkpoint(run, 10))
    wait_for_latest(uri, "step_000010")  # the thread is alive: it mirrored the next checkpoint
    assert mirror.close() is False  # an event was lost: close says so
    assert any("could not write the Mirror event" in f for f in mirror.failures)
    assert "could not write the Mirror event" in capfd.readouterr().err
    events = [json.loads(line) for line in (run / EVENTS_FILE).read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "mirror"] == [10]


def test_mirror_close_reports_success_when_all_went_well(s3_bucket: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    mirror = CheckpointMirror(f"{s3_bucket}/run", run, keep_last=3)
    mirror.submit(fake_checkpoint(run, 5))
    assert mirror.close() is True and mirror.failures == []


def test_events_are_uploaded_only_when_they_changed(s3_bucket: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    uri = f"{s3_bucket}/run"
    mirror = CheckpointMirror(uri, run, keep_last=3)
    puts: list[str] = []
    mirror.store.client.meta.events.register(
        "before-parameter-build.s3.PutObject", lambda params, **_: puts.append(params["Key"])
    )
    mirror.submit(fake_checkpoint(run, 5))
    assert mirror.close() is True
    events_key = f"run/{EVENTS_FILE}"
    uploaded = puts.count(events_key)
    assert uploaded >= 1
    store = open_storage(uri)
    assert store.read_bytes(EVENTS_FILE) == (run / EVENTS_FILE).read_bytes()
    mirror._upload_run_files()  # nothing changed: nothing uploaded
    assert puts.count(events_key) == uploaded
    with open(run / EVENTS_FILE, "a") as f:
        f.write('{"event": "warning", "kind": "test"}\n')
    mirror._upload_run_files()
    assert puts.count(events_key) == uploaded + 1
    assert store.read_bytes(EVENTS_FILE) == (run / EVENTS_FILE).read_bytes()


def test_failed_multipart_upload_is_aborted_even_when_the_transfer_abort_is_lost(
    s3_bucket: str, tmp_path: Path
) -> None:
    store = S3Storage(f"{s3_bucket}/big", part_size=5 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 << 20))
    calls = {"UploadPart": 0, "AbortMultipartUpload": 0}

    def fault(model, **_):  # the endpoint goes away for the second part and for the transfer's abort
        calls[model.name] += 1
        if (model.name, calls[model.name]) in (("UploadPart", 2), ("AbortMultipartUpload", 1)):
            raise EndpointConnectionError(endpoint_url=store.endpoint)

    store.client.meta.events.register("before-call.s3.UploadPart", fault)
    store.client.meta.events.register("before-call.s3.AbortMultipartUpload", fault)
    with pytest.raises(StorageError):
        store.upload(src, "big.bin")
    assert calls["AbortMultipartUpload"] >= 2
    assert uploads_left(s3_bucket) == []
    assert store.stat("big.bin") is None


KILLED_UPLOAD = """
import os, signal, sys
from trainer.storage.store import S3Storage
store = S3Storage(sys.argv[1], part_size=5 << 20)
store.client.meta.events.register("after-call.s3.UploadPart", lambda **_: os.kill(os.getpid(), signal.SIGKILL))
store.upload(sys.argv[2], "checkpoints/step_000005/shard.bin")
"""


def test_multipart_upload_of_a_killed_process_is_aborted_by_the_next_mirror(s3_bucket: str, tmp_path: Path) -> None:
    uri = f"{s3_bucket}/run"
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 << 20))
    proc = subprocess.run([sys.executable, "-c", KILLED_UPLOAD, uri, str(src)], timeout=120, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert len(uploads_left(s3_bucket)) == 1  # killed mid-upload: its parts stay, invisible and billed
    mirror = CheckpointMirror(uri, tmp_path / "run", keep_last=3)
    assert mirror.close() is True
    assert uploads_left(s3_bucket) == []
