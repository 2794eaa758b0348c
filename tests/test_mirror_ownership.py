"""Issue 34, item 4: a checkpoint mirror location belongs to one run (its config and its data).

Real ``rfsdp train`` runs on 2 CPU ranks, mirrored to a local-path location: another run on the
same location (other data) is refused before its first step and leaves the owner's checkpoints
alone; a garbage remote ``latest`` is repaired like a local one. Unit level: the location's
record is written before any process starts, and retention skips another run's checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import train
from trainer.checkpoint import CHECKPOINTS, MANIFEST
from trainer.data.shards import builtin_corpus_text, prepare_tokens
from trainer.errors import ParameterError
from trainer.events import MirrorRestore, RunEnd, RunWarning, read_events
from trainer.launch.local import check_launch
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig
from trainer.rank.identity import DATA_IDENTITY
from trainer.storage.mirror import CheckpointMirror
from trainer.storage.store import open_storage

FIRST = ("--steps", "20", "--stop-at-step", "10", "--ckpt-every", "5", "--keep-last", "2", "--local-ckpt-every", "0")


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


@pytest.fixture(scope="module")
def run_a(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run A, stopped at step 10, mirrored to M; returns (run dir, M)."""
    root = tmp_path_factory.mktemp("owner")
    run, mirror = root / "run", root / "mirror"
    train(data_dir, run, *FIRST, "--checkpoint-uri", str(mirror))
    assert sorted(remote_steps(mirror)) == ["step_000005", "step_000010"]
    return run, mirror


@pytest.mark.slow
def test_another_run_on_the_same_mirror_is_refused_and_leaves_it_alone(run_a: tuple[Path, Path], other_data: Path, tmp_path: Path) -> None:
    """Reproduction: run B (fresh run dir, other data, the same hyperparameters) on A's mirror
    location restored A's step 10, trained on its own data, and its retention emptied A's steps."""
    _, owned = run_a
    mirror = tmp_path / "mirror"
    shutil.copytree(owned, mirror)
    before = remote_steps(mirror)
    b = tmp_path / "b"
    proc = train(other_data, b, *FIRST, "--checkpoint-uri", str(mirror), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--checkpoint-uri: {mirror} mirrors another run (data: manifest sha256" in proc.stderr
    assert remote_steps(mirror) == before  # A's checkpoints whole
    assert not (b / CHECKPOINTS).exists() and not (b / "events.jsonl").exists()  # B never started


@pytest.mark.slow
def test_a_garbage_remote_latest_is_ignored_and_the_newest_verifying_checkpoint_used(
    run_a: tuple[Path, Path], data_dir: Path, tmp_path: Path
) -> None:
    """Reproduction: garbage in the remote ``latest`` made a fresh run crash-loop on ``int()``."""
    _, owned = run_a
    mirror = tmp_path / "mirror"
    shutil.copytree(owned, mirror)
    (mirror / CHECKPOINTS / "latest").write_bytes(b"\xff\xfe../../elsewhere\n")
    fresh = tmp_path / "fresh"
    train(data_dir, fresh, "--steps", "20", "--stop-at-step", "12", "--ckpt-every", "5", "--keep-last", "2",
          "--local-ckpt-every", "0", "--checkpoint-uri", str(mirror))  # fmt: skip
    events = read_events(fresh)
    assert [e.step for e in events if isinstance(e, MirrorRestore)] == [10]
    (warning,) = [e for e in events if isinstance(e, RunWarning) and e.kind == "latest_repaired"]
    assert warning.step == 10 and warning.was.startswith("remote ")
    assert [e.status for e in events if isinstance(e, RunEnd)][-1] == "stopped"
    assert (mirror / CHECKPOINTS / "latest").read_text() == "step_000012\n"  # the stop's checkpoint, mirrored: repaired there too


def test_the_mirror_record_is_written_before_any_process_starts(data_dir: Path, other_data: Path, tmp_path: Path) -> None:
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
        store.write_bytes(f"{CHECKPOINTS}/step_{step:06d}/{MANIFEST}", json.dumps({"fingerprint": fingerprint}).encode())
    store.write_bytes(f"{CHECKPOINTS}/step_000000/x.distcp", b"partial upload")  # no manifest yet: this run's
    mirror = CheckpointMirror(str(remote), tmp_path / "run", keep_last=2)
    try:
        mirror._retain("step_000004", "mine")
    finally:
        mirror.close()
    assert sorted(remote_steps(remote)) == ["step_000001", "step_000003", "step_000004"]
