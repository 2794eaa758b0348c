"""What a checkpoint is trusted for (issue 34, items 2 and 10), in validation: a real run's
checkpoints with a planted pickle or a corrupt ``latest``. Every reader and resume, in this
process: tests/unit/test_checkpoint_trust.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.test_checkpoint_trust import KEY, plant, reseal
from trainer.checkpoint import (
    CHECKPOINTS,
    LATEST,
    SIGNING_KEY_ENV,
    step_dir_name,
)


def test_validate_never_unpickles_a_planted_metadata(
    baseline_60: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's reproduction: a signed run, ``.metadata`` replaced by a payload of the same size,
    the manifest untouched. Validation names the checksum failure and the payload never runs;
    without a key and with the checksum rewritten too, the restricted unpickler refuses it."""
    from trainer.results.validate import validate_run

    marker = tmp_path / "ran"
    run = Path(shutil.copytree(baseline_60, tmp_path / "run"))
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    for path in (run / CHECKPOINTS).glob("step_*"):
        reseal(path, key=KEY)
    newest = run / CHECKPOINTS / step_dir_name(60)
    plant(newest / ".metadata", marker)
    report = validate_run(run)
    assert not marker.exists(), "the planted pickle ran"
    assert report.failed == ["complete"]
    assert report.checks[0].detail == "step_000060: .metadata fails its checksum"

    monkeypatch.delenv(SIGNING_KEY_ENV)
    reseal(newest)
    report = validate_run(run)
    assert not marker.exists(), "the planted pickle ran"
    assert report.failed == ["complete"] and "not DCP metadata" in report.checks[0].detail


def test_validate_survives_a_corrupt_latest(baseline_60: Path, tmp_path: Path) -> None:
    """Validation of a run whose ``latest`` is not UTF-8 runs its checks on the newest checkpoint
    (the one resume takes) and says that ``latest`` is corrupt. (A flipped byte ends it at
    ``intact``, before the dear checks.)"""
    from trainer.results.validate import validate_run

    run = Path(shutil.copytree(baseline_60, tmp_path / "run"))
    (run / CHECKPOINTS / LATEST).write_bytes(b"\xff\xfe\x00")
    shard = run / CHECKPOINTS / step_dir_name(60) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = validate_run(run)
    complete = report.checks[0]
    assert complete.passed and "checkpoints/latest is corrupt" in complete.detail and complete.values["latest"] is None
    assert report.failed == ["intact"]
