"""Issue 34, item 4: a checkpoint mirror location belongs to one run (its config and its data).

Real ``rfsdp train`` runs on 2 CPU ranks, mirrored to a local-path location: another run on the
same location (other data) is refused before its first step and leaves the owner's checkpoints
alone; a garbage remote ``latest`` is repaired like a local one. Unit level:
tests/unit/test_mirror_ownership.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import train
from tests.unit import test_mirror_ownership
from tests.unit.test_mirror_ownership import remote_steps
from trainer.checkpoint import CHECKPOINTS
from trainer.events import MirrorRestore, RunEnd, RunWarning, read_events

other_data = test_mirror_ownership.other_data  # a fixture of the unit tests'

FIRST = ("--steps", "20", "--stop-at-step", "10", "--ckpt-every", "5", "--keep-last", "2", "--local-ckpt-every", "0")


@pytest.fixture(scope="module")
def run_a(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run A, stopped at step 10, mirrored to M; returns (run dir, M)."""
    root = tmp_path_factory.mktemp("owner")
    run, mirror = root / "run", root / "mirror"
    train(data_dir, run, *FIRST, "--checkpoint-uri", str(mirror))
    assert sorted(remote_steps(mirror)) == ["step_000005", "step_000010"]
    return run, mirror


def test_another_run_on_the_same_mirror_is_refused_and_leaves_it_alone(
    run_a: tuple[Path, Path], other_data: Path, tmp_path: Path
) -> None:
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


def test_a_garbage_remote_latest_is_ignored_and_the_newest_verifying_checkpoint_used(
    run_a: tuple[Path, Path], data_dir: Path, tmp_path: Path
) -> None:
    """Reproduction: garbage in the remote ``latest`` made a fresh run crash-loop on ``int()``."""
    _, owned = run_a
    mirror = tmp_path / "mirror"
    shutil.copytree(owned, mirror)
    (mirror / CHECKPOINTS / "latest").write_bytes(b"\xff\xfe../../elsewhere\n")
    fresh = tmp_path / "fresh"
    train(
        data_dir,
        fresh,
        "--steps",
        "20",
        "--stop-at-step",
        "12",
        "--ckpt-every",
        "5",
        "--keep-last",
        "2",
        "--local-ckpt-every",
        "0",
        "--checkpoint-uri",
        str(mirror),
    )
    events = read_events(fresh)
    assert [e.step for e in events if isinstance(e, MirrorRestore)] == [10]
    (warning,) = [e for e in events if isinstance(e, RunWarning) and e.kind == "latest_repaired"]
    assert warning.step == 10 and warning.was.startswith("remote ")
    assert [e.status for e in events if isinstance(e, RunEnd)][-1] == "stopped"
    assert (
        mirror / CHECKPOINTS / "latest"
    ).read_text() == "step_000012\n"  # the stop's checkpoint, mirrored: repaired there too
