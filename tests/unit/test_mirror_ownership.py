"""Issue 34, item 4: a checkpoint mirror location belongs to one run (its config and its data).

Unit level: the location's record is written before any process starts, and retention skips
another run's checkpoints. Real runs: tests/integration/test_mirror_ownership_runs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.checkpoint import CHECKPOINTS, MANIFEST
from trainer.data.shards import builtin_corpus_text, prepare_tokens
from trainer.errors import ParameterError
from trainer.launch.local import check_launch
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig
from trainer.rank.identity import DATA_IDENTITY
from trainer.storage.mirror import CheckpointMirror
from trainer.storage.store import open_storage


def remote_steps(uri: Path) -> dict[str, list[str]]:
    """Each remote checkpoint dir that holds files, and its files (a local-path store leaves a
    deleted checkpoint's folder empty)."""
    root = uri / CHECKPOINTS
    steps = {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(root.iterdir()) if d.is_dir()}
    return {name: files for name, files in steps.items() if files}


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("other-data")
    prepare_tokens(builtin_corpus_text().swapcase(), out, source="swapcase")
    return out


def test_the_mirror_record_is_written_before_any_process_starts(
    data_dir: Path, other_data: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror"
    mine = TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "a"), checkpoint_uri=str(mirror))
    check_launch(mine, LaunchSpec())
    record = json.loads((mirror / "config.json").read_text())
    assert record == json.loads((tmp_path / "a" / "config.json").read_text())
    assert record[DATA_IDENTITY] and record["steps"] == mine.steps
    theirs = TrainConfig(data=str(other_data), run_dir=str(tmp_path / "b"), checkpoint_uri=str(mirror))
    with pytest.raises(ParameterError, match=r"^--checkpoint-uri: .* mirrors another run \(data: manifest sha256 "):
        check_launch(theirs, LaunchSpec())
    assert not (tmp_path / "b").exists()  # nothing written on a refusal
    check_launch(TrainConfig(data=str(data_dir), run_dir=str(tmp_path / "c"), checkpoint_uri=str(mirror)), LaunchSpec())


def test_retention_deletes_only_its_own_runs_checkpoints(tmp_path: Path) -> None:
    remote = tmp_path / "mirror"
    store = open_storage(str(remote))
    for step, fingerprint in ((1, "theirs"), (2, "mine"), (3, "mine"), (4, "mine")):
        store.write_bytes(
            f"{CHECKPOINTS}/step_{step:06d}/{MANIFEST}", json.dumps({"fingerprint": fingerprint}).encode()
        )
    store.write_bytes(f"{CHECKPOINTS}/step_000000/x.distcp", b"partial upload")  # no manifest yet: this run's
    mirror = CheckpointMirror(str(remote), tmp_path / "run", keep_last=2)
    try:
        mirror._retain("step_000004", "mine")
    finally:
        mirror.close()
    assert sorted(remote_steps(remote)) == ["step_000001", "step_000003", "step_000004"]
