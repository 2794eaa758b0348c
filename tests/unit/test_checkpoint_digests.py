"""No stale or wrong checkpoint (issue 37, item 4): each rank's digests of what it was asked to
save, the audit of what was written against them (validation, ``rfsdp bench soak --audit``) and
resume's fallback from a checkpoint whose shards are stale but well formed. Real DCP
checkpoints of a small model (1 rank, the synchronous writer); a real run's (2 ranks, the async
writer): tests/integration/test_checkpoint_audit_runs.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit import test_checkpointer
from tests.unit.test_checkpoint_trust import real_checkpoints, reseal
from tests.unit.test_checkpointer import checkpointer
from trainer.checkpoint import (
    CHECKPOINTS,
    MANIFEST,
    StaleShardError,
    SyncDcpWriter,
    audit_checkpoint,
    latest_checkpoint,
    load_tensors,
    published_checkpoints,
    read_full_state,
    step_dir_name,
    verify_checkpoint,
)
from trainer.checkpoint.digests import audit_full_state, digests_file, shard_of, shard_records, tensor_digest
from trainer.events import Checkpoint, RunWarning, read_events, select

one_rank = test_checkpointer.one_rank  # the fixture: a 1-rank gloo process group for this module


def test_a_shard_digest_is_sha256_of_its_values_bytes() -> None:
    """The digest is SHA-256 of the bytes, row-major: a view (a transpose) digests as its
    values, and another value or dtype gives another digest."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    expected = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    assert tensor_digest(t) == expected == "e2c0a71510b5394df7773b63fb5f54372b84c3564e67811bde7d665be227976d"
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous()) != expected
    assert tensor_digest(t.to(torch.bfloat16)) != expected
    assert tensor_digest(torch.tensor(3.0)) == hashlib.sha256(b"\x00\x00\x40\x40").hexdigest()
    (record,) = shard_records({"optim": {"state": {"w": {"step": torch.tensor(3.0)}}}})
    assert record == {
        "fqn": "optim.state.w.step",
        "offsets": [],
        "shape": [],
        "dtype": "float32",
        "digest": tensor_digest(torch.tensor(3.0)),
    }


def test_the_audit_slices_each_recorded_shard_at_its_offsets() -> None:
    """Two ranks' shards of one 4x3 tensor (rows 0-1, rows 2-3), recorded by offsets: the whole
    written tensor audits clean; one value changed in rank 1's rows is named with its tensor, its
    rank and its offsets; a recorded tensor that is not written is named too."""
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert torch.equal(shard_of(full, [2, 0], [2, 3]), full[2:])

    def record(rank: int, offsets: list[int]) -> dict:
        shard = shard_of(full, offsets, [2, 3])
        entry = {"fqn": "model.w", "offsets": offsets, "shape": [2, 3], "dtype": "float32"}
        return {"rank": rank, "shards": [entry | {"digest": tensor_digest(shard)}]}

    records = {0: record(0, [0, 0]), 1: record(1, [2, 0])}
    assert audit_full_state({"model": {"w": full}}, records) == []
    stale = full.clone()
    stale[3, 1] = -1.0
    (found,) = audit_full_state({"model": {"w": stale}}, records)
    assert (found.rank, found.fqn, found.offsets) == (1, "model.w", (2, 0))
    assert found.describe(9).startswith(
        "model.w (rank 1's shard at offsets [2, 0]) at step 9: the written values differ"
    )
    (missing,) = audit_full_state(
        {"model": {"w": full}}, {0: {"shards": [records[0]["shards"][0] | {"fqn": "model.v"}]}}
    )
    assert missing.fqn == "model.v" and "not in the written checkpoint" in missing.problem


def redigest(path: Path) -> None:
    """Record every rank's shards of a checkpoint (manifest resealed) as they are written now, as
    if each rank had saved those values; reseal the manifest after it."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(read_full_state(path))
    for file in path.glob("digests_rank*.json"):
        record = json.loads(file.read_text())
        for shard in record["shards"]:
            shard["digest"] = tensor_digest(shard_of(flat[shard["fqn"]], shard["offsets"], shard["shape"]))
        file.write_text(json.dumps(record))


def stale_copy(newest: Path, older: Path) -> None:
    """Write ``older``'s shard file over ``newest``'s (the same layout: a stale but well-formed
    write, as a reused plan or buffer would leave) and reseal the manifest's checksums."""
    assert (newest / "__0_0.distcp").stat().st_size == (older / "__0_0.distcp").stat().st_size
    shutil.copyfile(older / "__0_0.distcp", newest / "__0_0.distcp")
    reseal(newest)
    verify_checkpoint(newest)  # every checksum agrees: only the digests can tell


def test_a_sync_save_records_digests_the_manifest_covers_and_they_audit_clean(one_rank: None, tmp_path: Path) -> None:
    """Every rank's digest record is one of its files, under the manifest's checksum; each
    published checkpoint audits clean, its event names the digest's cost (a ``digest`` phase
    after ``write``), and a checkpoint without digests (saved before they were kept) still loads,
    reported as not audited."""
    model, optimizer = real_checkpoints(tmp_path)
    for step, path in published_checkpoints(tmp_path / CHECKPOINTS):
        assert digests_file(0) in json.loads((path / MANIFEST).read_text())["files"]
        audit = audit_checkpoint(path)
        assert (audit.step, audit.audited, audit.ranks, audit.mismatches) == (step, True, 1, ())
        assert audit.shards == 2 + 2 * 3  # weight and bias; AdamW's step, exp_avg, exp_avg_sq of each
    for event in select(read_events(tmp_path), Checkpoint):
        names = list(event.phases)
        assert names[names.index("write") + 1] == "digest" and event.phases["digest"] >= 0
    newest = latest_checkpoint(tmp_path)
    manifest = json.loads((newest / MANIFEST).read_text())
    del manifest["files"][digests_file(0)]
    (newest / digests_file(0)).unlink()
    (newest / MANIFEST).write_text(json.dumps(manifest))
    assert not audit_checkpoint(newest).audited
    load_tensors(model, optimizer, newest)


def test_a_stale_but_well_formed_shard_is_named_and_resume_falls_back(one_rank: None, tmp_path: Path) -> None:
    """Step 6's shard file replaced by step 3's, checksums made consistent: the audit names the
    tensor, the rank and the step; the load refuses it (before the fix it loaded step 3's weights
    as step 6's), and resume sets it aside and restores step 3."""
    model, optimizer = real_checkpoints(tmp_path)
    checkpoints = dict(published_checkpoints(tmp_path / CHECKPOINTS))
    stale_copy(checkpoints[6], checkpoints[3])
    audit = audit_checkpoint(checkpoints[6])
    assert audit.audited and len(audit.mismatches) == audit.shards  # every tensor changed in 3 steps
    assert any(m.startswith("model.weight (rank 0's shard at offsets [0, 0])") for m in audit.mismatches)
    assert all("at step 6" in m for m in audit.mismatches)
    with pytest.raises(StaleShardError, match=r"step_000006: stale or wrong shard written: .*rank 0.* at step 6"):
        load_tensors(model, optimizer, checkpoints[6])
    loaded = []

    def load(path: Path) -> None:
        load_tensors(model, optimizer, path)
        loaded.append(path.name)

    assert checkpointer(tmp_path, SyncDcpWriter()).load_latest(load) == 3
    assert loaded == [step_dir_name(3)]
    (warning,) = [w for w in select(read_events(tmp_path), RunWarning) if w.kind == "checkpoint_skipped"]
    assert warning.step == 6 and "stale or wrong shard written" in warning.reason
    assert (tmp_path / CHECKPOINTS / f"{step_dir_name(6)}.rejected").is_dir()


def test_with_nothing_older_a_stale_checkpoint_fails_the_attempt(one_rank: None, tmp_path: Path) -> None:
    """The only checkpoint is stale: it is set aside, and the attempt fails (the state holds its
    values), so the restart starts afresh instead of training on."""
    model, optimizer = real_checkpoints(tmp_path, last=6)
    checkpoints = dict(published_checkpoints(tmp_path / CHECKPOINTS))
    stale_copy(checkpoints[6], checkpoints[3])
    shutil.rmtree(checkpoints[3])
    ckpt = checkpointer(tmp_path, SyncDcpWriter())
    with pytest.raises(StaleShardError, match="no older checkpoint to resume from"):
        ckpt.load_latest(lambda path: load_tensors(model, optimizer, path))
    assert published_checkpoints(tmp_path / CHECKPOINTS) == []
    assert checkpointer(tmp_path, SyncDcpWriter()).load_latest(lambda path: None) == 0
