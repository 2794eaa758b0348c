"""The import contracts in ``pyproject.toml`` (import-linter): they hold, and they catch a breach."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "components", "pipelines", "bench")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold() -> None:
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "trainer" / "events" / "__init__.py", "a") as f:
        f.write("\nfrom trainer.cli import main  # a deliberate violation: the bottom layer imports the top\n")
    with open(tmp_path / "trainer" / "results" / "summary.py", "a") as f:
        f.write("\nimport mlflow  # a deliberate violation: only trainer.results.tracking talks to MLflow\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "Layers: the CLI, apps" in proc.stdout and "BROKEN" in proc.stdout
    assert "trainer.events -> trainer.cli" in proc.stdout
    assert "Only trainer.results.tracking imports MLflow BROKEN" in proc.stdout.replace("\n", " ")


def test_compiling_the_pipeline_needs_neither_torch_nor_the_trainer_runtime() -> None:
    # A pipeline compile (a laptop, a CI job) reads the step definitions and two shared constants.
    heavy = ("torch", "mlflow", "nvidia_resiliency_ext", "kubeflow.training")
    code = f"import sys, pipelines.resilient_fsdp; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


LAUNCH = """
import sys
import trainer.cli
from trainer.launch import local
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig
cfg = TrainConfig(data=sys.argv[1], run_dir=sys.argv[2], world_size=2)
local.check_launch(cfg, LaunchSpec())
"""


def test_launching_a_job_imports_no_torch(data_dir: Path, tmp_path: Path) -> None:
    """The launcher (``rfsdp train``: the CLI, then every check before a process starts) never
    imports torch: its ranks pay their own import, and each job start would pay seconds more."""
    code = LAUNCH + "print('torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(data_dir), str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False", proc.stdout[-1000:]


# Files that name such paths on purpose.
PURPOSEFUL = {
    "tests/integration/test_layout.py": "this test's own samples",
    "tests/integration/test_storage.py": "object keys that must be refused",
    "tests/unit/test_checkpoint_trust.py": "a corrupt latest that points outside the run",
}


def paths_above(root: Path, name: str, text: str) -> list[str]:
    """Relative paths (``../x``) in ``text`` of the file ``name`` that leave ``root``: read from
    the file's folder in Markdown (links), from the root elsewhere (code runs from the root)."""
    base = (root / name).parent if name.endswith(".md") else root
    return [
        f"{name}: {m[0]}"
        for m in re.finditer(r"(?<![\w/.])(?:\.\./)+[\w.-]+", text)
        if not (base / m[0]).resolve().is_relative_to(root)
    ]


def test_no_tracked_file_refers_to_a_path_above_the_repository() -> None:
    """A user's clone has no folder beside it: everything the code, tests and docs name lives in
    the repository."""
    assert paths_above(
        ROOT, "tests/test_k8s.py", 'CRD = ROOT / "../beside-the-clone/pytorchjob.yaml"'
    )  # it would catch this
    assert not paths_above(ROOT, "docs/events.md", "[back](../README.md), a/../../b")
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in set(names) - set(PURPOSEFUL):
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        offenders += paths_above(ROOT, name, text)
    assert offenders == []
