"""Issue 6: the storage layer against a real S3-compatible server (moto's server mode) on loopback.

Round trips, multipart, checksums on read, and the bad-input errors: missing bucket, wrong
credentials, endpoint down, corrupt object, path traversal.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import boto3
import pytest
import requests

from tests.conftest import S3_SECRET
from trainer.cli import main as rfsdp_main
from trainer.data.prepare import local_data
from trainer.data.shards import MANIFEST, builtin_corpus_text, prepare_tokens
from trainer.launch.local import free_port
from trainer.storage.store import S3Storage, StorageError, fetch_run_dir, open_storage, upload_tree


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """Run the real `rfsdp` entry point in this process (the error paths end before any subprocess)."""
    capsys.readouterr()
    code = rfsdp_main(list(args))
    return code, capsys.readouterr().err.strip()


@pytest.fixture(params=["local", "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return f"file://{tmp_path / 'store'}"
    return request.getfixturevalue("s3_bucket") + "/some/prefix"


def test_round_trip(store_uri: str, tmp_path: Path) -> None:
    store = open_storage(store_uri)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    info = store.upload(src, "a/b/src.bin")
    assert info.size == 100_000 and info.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    store.write_bytes("a/marker", b"hello\n")
    assert store.list() == ["a/b/src.bin", "a/marker"]
    assert store.list("a/b") == ["a/b/src.bin"]
    assert store.stat("a/b/src.bin").size == 100_000 and store.stat("missing") is None
    store.download("a/b/src.bin", tmp_path / "out" / "copy.bin", sha256=info.sha256)
    assert (tmp_path / "out" / "copy.bin").read_bytes() == src.read_bytes()
    assert store.read_bytes("a/marker") == b"hello\n"
    store.delete(["a/marker", "not-there"])
    assert store.list() == ["a/b/src.bin"]
    # A local file that differs from the checksum the caller expects is never uploaded.
    with pytest.raises(StorageError, match="fails its checksum"):
        store.upload(src, "a/bad.bin", sha256="0" * 64)
    assert store.stat("a/bad.bin") is None


def test_large_objects_are_uploaded_in_parts(s3_bucket: str, tmp_path: Path) -> None:
    store = S3Storage(f"{s3_bucket}/big", part_size=5 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 << 20))
    store.upload(src, "big.bin")
    head = store.client.head_object(Bucket=store.bucket, Key="big/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # S3's multipart ETag: 3 parts
    store.download("big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_corrupt_object_is_detected_on_read(s3_bucket: str, tmp_path: Path) -> None:
    store = open_storage(f"{s3_bucket}/ckpt")
    src = tmp_path / "shard.bin"
    src.write_bytes(os.urandom(50_000))
    info = store.upload(src, "shard.bin")
    # Bit rot behind the store's back: same recorded checksum, one flipped byte.
    data = bytearray(src.read_bytes())
    data[1234] ^= 0xFF
    bucket = s3_bucket.removeprefix("s3://")
    boto3.client("s3").put_object(
        Bucket=bucket, Key="ckpt/shard.bin", Body=bytes(data), Metadata={"sha256": info.sha256}
    )
    for read in (lambda: store.download("shard.bin", tmp_path / "got.bin"), lambda: store.read_bytes("shard.bin")):
        with pytest.raises(StorageError, match=rf"^{s3_bucket}/ckpt/shard.bin fails its checksum"):
            read()
    assert not (tmp_path / "got.bin").exists() and not list(tmp_path.glob(".got.bin*"))  # nothing half-written
    # An object without a recorded checksum is still checked against the one the caller expects.
    boto3.client("s3").put_object(Bucket=bucket, Key="ckpt/other.bin", Body=bytes(data))
    with pytest.raises(StorageError, match="differs from the expected checksum"):
        store.download("other.bin", tmp_path / "got.bin", sha256=info.sha256)


def test_corrupt_data_shard_refuses_training_before_any_process_starts(
    s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = f"{s3_bucket}/data"
    prepare_tokens(builtin_corpus_text(), tmp_path / "prepared")
    upload_tree(tmp_path / "prepared", data, last=MANIFEST)
    manifest = json.loads(open_storage(data).read_bytes("manifest.json"))
    assert [s["file"] for s in manifest["splits"]["train"]["shards"]] == ["train_000.bin"]
    local = local_data(data, tmp_path / "ok")  # the verified cache that training reads
    assert (local / "train_000.bin").stat().st_size == 2 * manifest["splits"]["train"]["tokens"]
    boto3.client("s3").put_object(Bucket=s3_bucket.removeprefix("s3://"), Key="data/train_000.bin", Body=b"\0" * 4096)
    run = tmp_path / "run"
    code, err = cli(capsys, "train", "--quiet", "--data", data, "--run-dir", str(run), "--steps", "10")
    assert code == 2
    actual, expected = hashlib.sha256(bytes(4096)).hexdigest(), manifest["splits"]["train"]["shards"][0]["sha256"]
    assert err == (
        f"rfsdp train: error: --data: {data}/train_000.bin fails its checksum: "
        f"sha256 {actual[:12]}... differs from the expected checksum {expected[:12]}... (corrupt object)"
    )
    assert not (run / "logs").exists()
    assert not [p for p in (run / "data_cache").rglob("*") if p.is_file()]  # nothing half-written in the cache


def test_path_traversal_is_refused(store_uri: str, tmp_path: Path) -> None:
    store = open_storage(store_uri)
    for key in ("../escape", "a/../../b", "a/.."):
        with pytest.raises(StorageError, match=r"path traversal \('\.\.'\)"):
            store.upload(tmp_path, key)
        with pytest.raises(StorageError, match="path traversal"):
            store.download(key, tmp_path / "x")
    with pytest.raises(StorageError, match="path traversal"):
        open_storage(f"{store_uri}/../other")


def test_missing_bucket(s3_server: str, capsys: pytest.CaptureFixture) -> None:
    store = open_storage("s3://no-such-bucket/run")
    missing = f"bucket 'no-such-bucket' does not exist (endpoint {s3_server})"
    for call in (store.check, store.list, lambda: store.read_bytes("x")):
        with pytest.raises(StorageError) as err:
            call()
        assert str(err.value).startswith("s3://no-such-bucket/run") and str(err.value).endswith(f": {missing}")
    assert cli(capsys, "prepare-data", "--out", "s3://no-such-bucket/data") == (
        2,
        f"rfsdp prepare-data: error: s3://no-such-bucket/data: {missing}",
    )


def test_wrong_credentials(s3_server: str, s3_bucket: str, capsys: pytest.CaptureFixture) -> None:
    # Make the server check credentials (moto's IAM emulation): the test's key is unknown to it.
    requests.post(f"{s3_server}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    try:
        store = open_storage(f"{s3_bucket}/run")
        with pytest.raises(StorageError) as err:
            store.list()
        code, err_line = cli(capsys, "prepare-data", "--out", f"{s3_bucket}/data")
    finally:
        requests.post(f"{s3_server}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()
    message = str(err.value)
    assert message == (
        f"{s3_bucket}/run: access denied (InvalidAccessKeyId); "
        "check the AWS credentials in the environment or AWS config"
    )
    # The CLI checks the bucket first (HEAD: no error body, so only the status is known).
    hint = "check the AWS credentials in the environment or AWS config"
    assert (code, err_line) == (2, f"rfsdp prepare-data: error: {s3_bucket}/data: access denied (403); {hint}")
    for text in (message, err_line):
        assert S3_SECRET not in text and "rfsdp-test-key" not in text


def test_endpoint_down(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", down)
    with pytest.raises(StorageError, match=rf"^s3://bucket/run/events.jsonl: cannot reach the S3 endpoint {down}$"):
        open_storage("s3://bucket/run").read_bytes("events.jsonl")
    with pytest.raises(StorageError, match="cannot reach"):
        fetch_run_dir("s3://bucket/run", tmp_path / "run")
    code, err = cli(capsys, "train", "--quiet", "--data", "s3://bucket/data", "--run-dir", str(tmp_path / "r"))
    assert (code, err) == (
        2,
        f"rfsdp train: error: --data: s3://bucket/data/manifest.json: cannot reach the S3 endpoint {down}",
    )


def test_a_mirror_of_another_run_is_refused_before_anything_starts(
    s3_bucket: str, data_dir: Path, tmp_path: Path
) -> None:
    from trainer.errors import ParameterError
    from trainer.launch.local import check_launch
    from trainer.launch.spec import LaunchSpec
    from trainer.rank.config import TRAJECTORY_FIELDS, TrainConfig

    remote = f"{s3_bucket}/run"
    other = TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "other"), seed=7)
    open_storage(remote).write_bytes(
        "config.json", json.dumps({k: getattr(other, k) for k in TRAJECTORY_FIELDS}).encode()
    )
    mine = TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "mine"), checkpoint_uri=remote)
    with pytest.raises(
        ParameterError, match=rf"^--checkpoint-uri: {remote} mirrors another run \(seed: 7 there, 0 now\)"
    ):
        check_launch(mine, LaunchSpec())
    assert not (tmp_path / "mine").exists() and open_storage(remote).list() == [
        "config.json"
    ]  # nothing written anywhere
    check_launch(
        TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "again"), checkpoint_uri=remote, seed=7), LaunchSpec()
    )
