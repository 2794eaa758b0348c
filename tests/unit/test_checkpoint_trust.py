"""What a checkpoint is trusted for (issue 34, items 2, 8 and 10): nothing in it is deserialized
before its manifest and checksums verify, through every reader; the signature binds the step;
each rank verifies what it loads; a signed run does not resume without its key; a corrupt
``latest`` is repaired. Real files, real DCP checkpoints, planted pickles that would leave a
marker file if they ever ran.

Validation of a real run's checkpoints: tests/integration/test_checkpoint_trust_runs.py.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.unit import test_checkpointer
from tests.unit.test_checkpointer import FakeWriter, checkpointer, run_steps
from trainer.checkpoint import (
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    SIGNING_KEY_ENV,
    CheckpointError,
    SyncDcpWriter,
    latest_checkpoint,
    load_tensors,
    manifest_signature,
    read_full_state,
    step_dir_name,
    verify_checkpoint,
)
from trainer.errors import NonTransientError
from trainer.events import RunWarning, read_events, select
from trainer.fsutil import file_sha256

KEY = "the run's secret"
one_rank = test_checkpointer.one_rank  # the fixture: a 1-rank gloo process group for this module


class Payload:
    """A pickle that creates ``marker`` when it is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def plant(file: Path, marker: Path) -> None:
    """Replace ``file`` by a pickle payload of the same size (pickle ignores what follows its end)."""
    payload = pickle.dumps(Payload(marker))
    size = file.stat().st_size
    assert len(payload) <= size
    file.write_bytes(payload + b"\0" * (size - len(payload)))


def reseal(path: Path, *, key: str | None = None) -> None:
    """Rewrite the manifest's checksums for the files as they are now (what anyone who can write
    the storage can do), and sign it with ``key`` when given."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (path / name).stat().st_size, "sha256": file_sha256(path / name)}
    manifest.pop("signature", None)
    if key is not None:
        manifest["signature"] = manifest_signature(manifest, key.encode())
    (path / MANIFEST).write_text(json.dumps(manifest))


def real_checkpoints(run_dir: Path, last: int = 6) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and optimizer saved with real DCP every 3 steps up to ``last`` (1 rank)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())

    def state(step: int) -> tuple[dict, dict]:
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}, {"step": step}

    ckpt = checkpointer(run_dir, SyncDcpWriter())
    for step in range(1, last + 1):
        ckpt.step(step, lambda step=step: state(step), last=step == last)
    return model, optimizer


# ------------------------------------------------------------------ item 2: nothing unpickled first
def test_no_reader_unpickles_a_planted_metadata(one_rank: None, tmp_path: Path) -> None:
    """``.metadata`` replaced by a pickle payload and the manifest's checksum rewritten to match
    (no key: anyone who can write the storage can): resume skips it, and neither the DCP load
    nor the conversion to one state dict runs it."""
    marker = tmp_path / "ran"
    model, optimizer = real_checkpoints(tmp_path / "run")
    newest = latest_checkpoint(tmp_path / "run")
    plant(newest / ".metadata", marker)
    reseal(newest)
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        read_full_state(newest)
    with pytest.raises(BaseException, match="not DCP metadata"):  # DCP wraps it in its CheckpointException
        load_tensors(model, optimizer, newest)
    assert checkpointer(tmp_path / "run", SyncDcpWriter()).load_latest(lambda path: None) == 3
    skipped = [w for w in select(read_events(tmp_path / "run"), RunWarning) if w.kind == "checkpoint_skipped"]
    assert [w.step for w in skipped] == [6] and "not DCP metadata" in skipped[0].reason
    assert not marker.exists(), "the planted pickle ran"


def test_a_non_tensor_item_is_read_as_plain_data_only(one_rank: None, tmp_path: Path) -> None:
    """DCP loads its non-tensor items (the optimizer's hyperparameters) with ``weights_only=False``:
    one replaced by a pickle payload, checksum rewritten, is refused and never runs."""
    marker = tmp_path / "ran"
    real_checkpoints(tmp_path / "run", last=3)
    path = latest_checkpoint(tmp_path / "run")
    metadata = pickle.loads((path / ".metadata").read_bytes())
    (index, info) = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("optim.param_groups"))
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    payload = pickle.dumps(Payload(marker))
    assert len(payload) <= info.length, index
    data[info.offset : info.offset + info.length] = payload + b"\0" * (info.length - len(payload))
    shard.write_bytes(bytes(data))
    reseal(path)
    with pytest.raises(CheckpointError, match="not plain data"):
        read_full_state(path)
    assert not marker.exists(), "the planted pickle ran"


# ------------------------------------------------------------------ item 8: what the signature binds
def test_a_signed_checkpoint_copied_to_another_step_is_refused(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed step 6 copied to ``step_000025`` does not resume as step 25: its manifest's step,
    which the signature covers, is not the directory's."""
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    run_steps(checkpointer(tmp_path, FakeWriter()), last=6)
    copy = tmp_path / CHECKPOINTS / step_dir_name(25)
    shutil.copytree(tmp_path / CHECKPOINTS / step_dir_name(6), copy)
    with pytest.raises(CheckpointError, match="of step 6, not 25"):
        verify_checkpoint(copy)
    assert checkpointer(tmp_path, FakeWriter()).load_latest(lambda path: None) == 6
    skipped = [w for w in select(read_events(tmp_path), RunWarning) if w.kind == "checkpoint_skipped"]
    assert [w.step for w in skipped] == [25]


def test_a_run_signed_with_a_key_does_not_resume_without_it(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key's secret is missing at a restart: the run ends (an error no restart can fix)
    instead of trusting everything, and its checkpoints are left as they are."""
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    run_steps(checkpointer(tmp_path, FakeWriter()), last=6)
    monkeypatch.delenv(SIGNING_KEY_ENV)
    with pytest.raises(NonTransientError, match=SIGNING_KEY_ENV):
        checkpointer(tmp_path, FakeWriter()).load_latest(lambda path: None)
    assert latest_checkpoint(tmp_path).name == step_dir_name(6)
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    assert checkpointer(tmp_path, FakeWriter()).load_latest(lambda path: None) == 6


def test_each_rank_verifies_what_it_loads(one_rank: None, tmp_path: Path) -> None:
    """Rank 0 chose the checkpoint; a shard or a rank state altered after that check is refused
    by the load itself, which hashes the bytes it reads (no time-of-check gap)."""
    model, optimizer = real_checkpoints(tmp_path)
    ckpt = checkpointer(tmp_path, SyncDcpWriter())
    step = ckpt.find_latest()
    path = tmp_path / CHECKPOINTS / step_dir_name(step)
    original = (path / "__0_0.distcp").read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01  # a bit of a tensor: DCP alone loads it silently
    (path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(BaseException, match="__0_0.distcp fails its checksum"):
        ckpt.load(step, lambda p: load_tensors(model, optimizer, p))
    (path / "__0_0.distcp").write_bytes(original)
    ckpt.load(step, lambda p: load_tensors(model, optimizer, p))
    from trainer.checkpoint import read_rank_state

    state = read_rank_state(path, dist.get_rank())
    assert state == {"step": step}
    buffer = io.BytesIO()
    torch.save({"step": 99}, buffer)
    (path / "rank0.pt").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="rank0.pt"):
        read_rank_state(path, 0)


def test_a_write_outcome_is_never_unpickled(tmp_path: Path) -> None:
    """The background writer's outcome record lies on the shared volume beside the shard: a
    pickle planted there is refused as a failed write and never runs."""
    from trainer.rank.resilience import _outcome_name, _read_outcome

    marker = tmp_path / "ran"
    (tmp_path / _outcome_name(0)).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises((RuntimeError, ValueError)):
        _read_outcome(tmp_path, 0)
    assert not marker.exists(), "the planted pickle ran"


# ------------------------------------------------------------------ item 10: a corrupt latest
@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00step", b"/".join([b"..", b"..", b"etc\n"]), b""])
def test_resume_repairs_a_corrupt_latest(one_rank: None, tmp_path: Path, garbage: bytes) -> None:
    """``latest`` holding bytes that are no checkpoint name (not UTF-8, a path, nothing) is
    repaired like a stale one; older checkpoints are intact and the newest is taken."""
    run_steps(checkpointer(tmp_path, FakeWriter()), last=6)
    (tmp_path / CHECKPOINTS / LATEST).write_bytes(garbage)
    assert latest_checkpoint(tmp_path) is None
    assert checkpointer(tmp_path, FakeWriter()).load_latest(lambda path: None) == 6
    assert latest_checkpoint(tmp_path).name == step_dir_name(6)
    (warning,) = select(read_events(tmp_path), RunWarning)
    assert warning.kind == "latest_repaired" and warning.step == 6
