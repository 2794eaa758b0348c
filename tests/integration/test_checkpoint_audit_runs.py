"""No stale or wrong checkpoint, proven on a real run (issue 37, item 4): 2 ranks, the async
writer (NVRx's background worker, the copy into staging beside the next step). Every published
checkpoint audits clean against its ranks' digests; a stale but well-formed write (the newest
checkpoint's shard files replaced by the previous checkpoint's, every checksum made consistent)
is named by validation and by the soak's audit, and skipped by resume. The digests' parts in
one process: tests/unit/test_checkpoint_digests.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.audit import audit_run
from tests.conftest import train
from tests.unit.test_checkpoint_trust import reseal
from trainer.checkpoint import CHECKPOINTS, MANIFEST, audit_checkpoint, published_checkpoints, verify_checkpoint
from trainer.events import Checkpoint, RunStart, RunWarning, final_losses, read_events, select
from trainer.results.validate import validate_run

# One session stopped at step 12 of 18 (resumable), a durable checkpoint every 3 steps, all kept;
# no local tier, so that resume's choice is the durable tier's alone.
FLAGS = ("--ckpt-every", "3", "--keep-last", "10", "--local-ckpt-every", "0")


@pytest.fixture(scope="module")
def run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("audit") / "run"
    train(data_dir, run_dir, "--steps", "18", "--stop-at-step", "12", *FLAGS)
    return run_dir


def test_every_published_checkpoint_of_a_real_run_audits_clean(run: Path) -> None:
    """Both ranks recorded the digests of every save (under the manifest's checksums); the written
    shards hold exactly that, and each durable event names the digest's cost after the copy."""
    published = published_checkpoints(run / CHECKPOINTS)
    assert [s for s, _ in published] == [3, 6, 9, 12]
    for step, path in published:
        files = json.loads((path / MANIFEST).read_text())["files"]
        assert {"digests_rank0.json", "digests_rank1.json"} <= set(files)
        audit = audit_checkpoint(path)
        assert (audit.step, audit.ranks, audit.mismatches) == (step, 2, ())
        assert audit.shards > 0 and audit.digest_s is not None
    for event in select(read_events(run), Checkpoint):
        names = list(event.phases)
        assert names[names.index("handoff") + 1 :][:3] == ["copy", "copy_wait", "digest"], names


def test_a_stale_well_formed_write_is_named_by_validation_and_resume_falls_back(
    run: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Step 12's shard files replaced by step 9's (the same plan, so the same layout), the
    manifest's checksums made consistent as the writer makes them: every checksum verifies; the
    audit in validation names the tensor, the rank and the step; resume sets step 12 aside and
    resumes from step 9, redoing steps 10-12 with the losses the run logged."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest, previous = copy / CHECKPOINTS / "step_000012", copy / CHECKPOINTS / "step_000009"
    shards = sorted(p.name for p in newest.glob("*.distcp"))
    assert shards == sorted(p.name for p in previous.glob("*.distcp")) and len(shards) == 2
    for name in shards:
        assert (newest / name).stat().st_size == (previous / name).stat().st_size
        shutil.copyfile(previous / name, newest / name)
    reseal(newest)
    verify_checkpoint(newest)  # only the digests can tell

    report = validate_run(copy, step=12)
    assert not report.valid and report.failed == ["intact"]
    intact = next(c for c in report.checks if c.name == "intact")
    assert intact.detail.startswith("stale or wrong shard written: model.")
    assert "(rank " in intact.detail and "at step 12:" in intact.detail
    assert intact.values["audited"] and intact.values["mismatches"] > 0
    soak = audit_run(copy)  # what `rfsdp bench soak --audit` reports of a run (it prunes to the newest 3)
    assert (soak["saves_published"], soak["saves_audited"], soak["not_audited"]) == (4, 4, 0)
    assert soak["mismatches"] == intact.values["mismatches"] and soak["mismatched"][0] in intact.detail
    assert soak["digest_s"]["max"] >= soak["digest_s"]["mean"] > 0

    train(data_dir, copy, "--steps", "18", *FLAGS)
    events = read_events(copy)
    (skipped,) = [w for w in select(events, RunWarning) if w.kind == "checkpoint_skipped"]
    assert skipped.step == 12 and "stale or wrong shard written" in skipped.reason
    assert select(events, RunStart)[-1].resumed_from_step == 9
    assert (copy / CHECKPOINTS / "step_000012.rejected").is_dir()
    logged, redone = final_losses(read_events(run)), final_losses(events)
    assert [redone[s] for s in (10, 11, 12)] == [logged[s] for s in (10, 11, 12)]
    after = audit_run(copy)
    assert (after["mismatches"], after["rejected_at_resume"], after["saves_audited"]) == (0, [12], 5)  # 6 to 18
