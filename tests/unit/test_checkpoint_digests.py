"""No stale or wrong checkpoint (issue 37, item 4): each rank's digests of what it was asked to
save, recorded beside its shards, and the audit of what was written against them. Real DCP
checkpoints of a small model (1 rank, the synchronous writer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from tests.unit import test_checkpointer
from tests.unit.test_checkpoint_trust import real_checkpoints
from trainer.checkpoint import CHECKPOINTS, MANIFEST, published_checkpoints, read_full_state
from trainer.checkpoint.digests import audit_full_state, digests_file, shard_of, shard_records, tensor_digest
from trainer.events import Checkpoint, read_events, select

one_rank = test_checkpointer.one_rank  # the fixture: a 1-rank gloo process group for this module


def test_a_shard_digest_is_blake2b_of_its_values_bytes() -> None:
    """The digest is BLAKE2b-128 of the bytes, row-major: a view (a transpose) digests as its
    values, and another value or dtype gives another digest."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    expected = hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
    assert tensor_digest(t) == expected == "4edaf0fe20d221bc27cb2558c661fea0"
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous()) != expected
    assert tensor_digest(t.to(torch.bfloat16)) != expected
    assert tensor_digest(torch.tensor(3.0)) == hashlib.blake2b(b"\x00\x00\x40\x40", digest_size=16).hexdigest()
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


def test_a_sync_save_records_digests_the_manifest_covers(one_rank: None, tmp_path: Path) -> None:
    """Every rank's digest record is one of its files, under the manifest's checksum, and holds
    what was written; each save's event names the digest's cost (a ``digest`` phase after ``write``)."""
    real_checkpoints(tmp_path)
    for _, path in published_checkpoints(tmp_path / CHECKPOINTS):
        assert digests_file(0) in json.loads((path / MANIFEST).read_text())["files"]
        record = json.loads((path / digests_file(0)).read_text())
        assert len(record["shards"]) == 2 + 2 * 3  # weight and bias; AdamW's step, exp_avg, exp_avg_sq of each
        assert audit_full_state(read_full_state(path), {0: record}) == []
    for event in select(read_events(tmp_path), Checkpoint):
        names = list(event.phases)
        assert names[names.index("write") + 1] == "digest" and event.phases["digest"] >= 0
