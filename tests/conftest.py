"""Shared fixtures: a prepared data set and helpers that run real `rfsdp train` jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.data import BUILTIN_CORPUS, builtin_corpus_text, prepare_tokens
from trainer.events import final_losses, read_events

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare_tokens(builtin_corpus_text(), out, source=BUILTIN_CORPUS)
    return out


def rfsdp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `rfsdp` CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def train(data: Path, run_dir: Path, *extra: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`rfsdp train` with the tiny model on 2 CPU workers."""
    proc = rfsdp("train", "--quiet", "--data", str(data), "--run-dir", str(run_dir), *extra, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
        raise AssertionError(f"rfsdp train failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    return final_losses(read_events(run_dir))


@pytest.fixture(scope="session")
def baseline_60(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 60-step run (checkpoints every 10): the reference trajectory."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    train(data_dir, run, "--steps", "60")
    return run
