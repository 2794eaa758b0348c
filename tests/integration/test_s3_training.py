"""Issue 6: training with S3 (moto's real server on loopback): data in S3, checkpoint mirroring,
resume on an empty machine, an S3 outage in the middle of an upload, a corrupt remote checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.conftest import losses, rfsdp, train
from trainer.checkpoint import CHECKPOINTS, CheckpointError, latest_checkpoint, published_checkpoints, verify_checkpoint
from trainer.data.shards import builtin_corpus_text, load_manifest
from trainer.events import (
    Mirror,
    MirrorFailed,
    MirrorRestore,
    RunEnd,
    RunStart,
    RunWarning,
    Step,
    final_losses,
    read_events,
)
from trainer.rank.config import TrainConfig
from trainer.storage.mirror import CheckpointMirror
from trainer.storage.store import Storage, fetch_run_dir, open_storage


def remote_steps(uri: str) -> list[str]:
    return sorted({k.split("/")[1] for k in open_storage(uri).list(CHECKPOINTS) if k.count("/") == 2})


class OutageProxy:
    """The S3 endpoint the trainer talks to: a loopback TCP proxy in front of a moto server that
    it stops when the ``nth`` request starting with ``trigger`` arrives (that request and every
    open connection die, as with a crashed server) and starts again ``outage_s`` later (moto keeps
    its state in this process, so the objects survive; the new server gets a new port).
    """

    def __init__(self, trigger: bytes, nth: int, outage_s: float) -> None:
        self.trigger, self.nth, self.outage_s = trigger, nth, outage_s
        self.seen = 0
        self.stopped_at: float | None = None
        self.restarted_at: float | None = None
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.server = self._start_server()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _start_server() -> ThreadedMotoServer:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        return server

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.server.get_host_and_port()) if self.server else None
        except OSError:
            upstream = None
        if upstream is None:  # the server is down: connection dropped
            client.close()
            return
        with self.lock:
            self.conns |= {client, upstream}
        threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
        self._pipe(client, upstream, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if watch and data.startswith(self.trigger) and self._hit():
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def _hit(self) -> bool:
        with self.lock:
            self.seen += 1
            if self.seen != self.nth:
                return False
            server, self.server = self.server, None
            for conn in self.conns:
                conn.close()
            self.conns.clear()
        server.stop()
        self.stopped_at = time.time()
        threading.Timer(self.outage_s, self._restart).start()
        return True

    def _restart(self) -> None:
        server = self._start_server()
        self.restarted_at = time.time()  # before the proxy forwards again: no upload can end before it
        self.server = server

    def close(self) -> None:
        self.listener.close()
        if self.server:
            self.server.stop()


def watch_latest(store: Storage, stop: threading.Event, seen: list[str], violations: list[str]) -> None:
    """Poll the remote run dir (through the always-up session server): whenever ``latest`` exists,
    the checkpoint it names must be complete (its manifest and every object it lists, right size).
    """
    while not stop.is_set():
        if store.stat("checkpoints/latest") is not None:
            name = store.read_bytes("checkpoints/latest").decode().strip()
            seen.append(name)
            manifest = store.stat(f"checkpoints/{name}/manifest.json")
            if manifest is None:
                violations.append(f"{name}: no manifest")
            else:
                files = json.loads(store.read_bytes(f"checkpoints/{name}/manifest.json"))["files"]
                for file, rec in files.items():
                    info = store.stat(f"checkpoints/{name}/{file}")
                    if info is None or info.size != rec["size"]:
                        violations.append(f"{name}/{file}: {info}")
        time.sleep(0.05)


@dataclass
class MirroredRun:
    """A 30-step run (of the 60-step baseline trajectory) whose data came from S3 and whose
    checkpoints were mirrored to S3 through an outage of the S3 server mid-upload."""

    bucket: str
    data: str
    remote_run: str
    run: Path
    proxy: OutageProxy
    seen_latest: list[str]
    violations: list[str]


@pytest.fixture(scope="module")
def mirrored_run(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> MirroredRun:
    bucket = "mirrored-run"
    boto3.client("s3").create_bucket(Bucket=bucket)
    # The corpus is an object in S3, as a user would upload it; data prep reads it and writes shards to S3.
    boto3.client("s3").put_object(Bucket=bucket, Key="corpus/python-docs.txt", Body=builtin_corpus_text().encode())
    data, remote_run = f"s3://{bucket}/data", f"s3://{bucket}/run"
    proc = rfsdp("prepare-data", "--source", f"s3://{bucket}/corpus", "--out", data)
    assert proc.returncode == 0, proc.stderr

    # Stop the server at the 2nd object of the first checkpoint: one object is already up.
    proxy = OutageProxy(f"PUT /{bucket}/run/checkpoints/step_000010/".encode(), nth=2, outage_s=3.0)
    stop, seen, violations = threading.Event(), [], []
    watcher = threading.Thread(
        target=watch_latest, args=(open_storage(remote_run), stop, seen, violations), daemon=True
    )
    watcher.start()
    run = tmp_path_factory.mktemp("mirrored") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", proxy.url)  # the trainer sees only the proxy
        try:
            train(data, run, "--steps", "60", "--stop-at-step", "30", "--checkpoint-uri", remote_run)
        finally:
            stop.set()
            watcher.join()
            proxy.close()
    return MirroredRun(bucket, data, remote_run, run, proxy, seen, violations)


def test_s3_outage_mid_upload_never_publishes_a_partial_checkpoint(
    mirrored_run: MirroredRun, baseline_60: Path, tmp_path: Path
) -> None:
    proxy, run, remote_run = mirrored_run.proxy, mirrored_run.run, mirrored_run.remote_run
    assert proxy.stopped_at and proxy.restarted_at, "the outage never happened"
    events = read_events(run)
    # Training went on during the outage and its trajectory is untouched.
    during = [e.step for e in events if isinstance(e, Step) and proxy.stopped_at < e.time < proxy.restarted_at]
    assert during, "no training step completed while the server was down"
    assert losses(run) == {s: v for s, v in losses(baseline_60).items() if s <= 30}
    assert [e.status for e in events if isinstance(e, RunEnd)] == ["stopped"]
    # The failed upload was reported and retried; the mirror caught up once the server was back.
    failed = [e for e in events if isinstance(e, MirrorFailed)]
    assert failed and failed[0].step == 10 and failed[0].attempt == 1 and failed[0].retry_in_s == 1.0
    assert "s3://" in failed[0].error and "/checkpoints/step_000010/" in failed[0].error
    assert all(e.step == 10 and e.retry_in_s for e in failed)  # retried with backoff, never given up
    mirrored = [e for e in events if isinstance(e, Mirror)]
    assert mirrored[0].step == 10 and mirrored[0].attempts == len(failed) + 1 and mirrored[0].time > proxy.restarted_at
    assert mirrored[-1].step == 30
    # The remote latest never named an incomplete checkpoint, and ends at the last one.
    assert mirrored_run.seen_latest and not mirrored_run.violations, mirrored_run.violations
    assert mirrored_run.seen_latest[-1] == "step_000030"
    fetched = fetch_run_dir(remote_run, tmp_path / "fetched")
    verify_checkpoint(latest_checkpoint(fetched), world_size=2)


def test_round_trip_through_s3_resumes_exactly(
    mirrored_run: MirroredRun, data_dir: Path, baseline_60: Path, tmp_path: Path
) -> None:
    bucket, data, remote_run, first = mirrored_run.bucket, mirrored_run.data, mirrored_run.remote_run, mirrored_run.run
    remote_manifest = json.loads(open_storage(data).read_bytes("manifest.json"))
    assert remote_manifest["splits"] == load_manifest(data_dir)["splits"]  # same shards, same checksums

    mirrored = [e for e in read_events(first) if isinstance(e, Mirror)]
    assert mirrored and mirrored[-1].step == 30 and mirrored[-1].uri == f"{remote_run}/checkpoints/step_000030"
    assert open_storage(remote_run).read_bytes("checkpoints/latest") == b"step_000030\n"
    assert list((first / "data_cache").glob("*/train_000.bin"))  # training read the verified local cache

    shutil.rmtree(first)  # the machine is gone; a fresh one with an empty run dir takes over
    second = tmp_path / "second"
    train(data, second, "--steps", "60", "--checkpoint-uri", remote_run)
    events = read_events(second)
    assert [e.step for e in events if isinstance(e, MirrorRestore)] == [30]
    (restored,) = [i for i, e in enumerate(events) if isinstance(e, MirrorRestore)]
    assert {e.step for e in events[:restored] if isinstance(e, Step)} == set(
        range(1, 31)
    )  # the first run's history came along
    assert [e.resumed_from_step for e in events[restored:] if isinstance(e, RunStart)] == [30]
    assert losses(second) == losses(baseline_60)  # all 60 steps, bit for bit

    # The remote run dir is complete: latest, retention (keep-last 3), events up to run_end.
    assert remote_steps(remote_run) == ["step_000040", "step_000050", "step_000060"]
    fetched = fetch_run_dir(remote_run, tmp_path / "fetched")
    verify_checkpoint(latest_checkpoint(fetched), world_size=2)
    assert latest_checkpoint(fetched).name == "step_000060"
    assert final_losses(read_events(fetched)) == losses(baseline_60)
    assert [e.status for e in read_events(fetched) if isinstance(e, RunEnd)] == ["stopped", "completed"]
    assert json.loads((fetched / "config.json").read_text())["steps"] == 60

    # Bit rot in the newest remote checkpoint: detected by checksum on read, the previous one is used.
    key = "run/checkpoints/step_000060/__0_0.distcp"
    obj = boto3.client("s3").get_object(Bucket=bucket, Key=key)
    body = bytearray(obj["Body"].read())
    body[len(body) // 2] ^= 0x01
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=bytes(body), Metadata=obj["Metadata"])
    third = tmp_path / "third"
    fingerprint = TrainConfig(data=data, run_dir=str(third), steps=60).trajectory_hash()
    mirror = CheckpointMirror(remote_run, third, keep_last=3)
    try:
        assert mirror.restore(fingerprint=fingerprint, world_size=2) == 50
    finally:
        mirror.close()
    (warning,) = [e for e in read_events(third) if isinstance(e, RunWarning)]
    assert warning.step == 60 and warning.kind == "checkpoint_skipped"
    assert f"{remote_run}/checkpoints/step_000060/__0_0.distcp fails its checksum" in warning.reason
    assert latest_checkpoint(third).name == "step_000050" and not list((third / CHECKPOINTS).glob("*.tmp*"))


def test_validating_a_mirrored_run_leaves_the_mirror_and_the_run_untouched(
    mirrored_run: MirroredRun, tmp_path: Path
) -> None:
    """A copy of the run whose recorded config names the production mirror: the validator's replay
    and reshard write to neither (every remote object keeps its ETag and time; the run's record
    keeps its files and mtimes; an s3:// data set's verified cache is the one thing added)."""
    fetched = fetch_run_dir(mirrored_run.remote_run, tmp_path / "fetched")
    assert any(
        e.config.get("checkpoint_uri") == mirrored_run.remote_run
        for e in read_events(fetched)
        if isinstance(e, RunStart)
    )
    intact = []  # another test in this module may have damaged the newest remote checkpoint
    for _, path in published_checkpoints(fetched / CHECKPOINTS):
        with contextlib.suppress(CheckpointError):
            intact.append(verify_checkpoint(path)["step"])
    s3 = boto3.client("s3")

    def remote() -> dict[str, tuple]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=mirrored_run.bucket)
        return {o["Key"]: (o["ETag"], o["LastModified"], o["Size"]) for page in pages for o in page.get("Contents", [])}

    def record() -> dict[str, tuple[int, int]]:
        files = (p for p in fetched.rglob("*") if p.is_file() and "data_cache" not in p.parts)
        return {str(p.relative_to(fetched)): (p.stat().st_mtime_ns, p.stat().st_size) for p in files}

    remote_before, record_before = remote(), record()
    proc = rfsdp("validate", "--run-dir", str(fetched), "--step", str(intact[-1]), timeout=600)
    assert proc.returncode == 0 and json.loads(proc.stdout)["valid"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert remote() == remote_before
    assert record() == record_before
