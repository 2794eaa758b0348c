"""The deployment guide's compile and manifest commands run (the real CLI, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.test_docs import commands

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv", [a for a in commands("rfsdp pipeline ") if a[2] in ("compile", "manifest")], ids=lambda a: a[2]
)
def test_the_guides_compile_and_manifest_commands_run(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout if argv[2] == "manifest" else (tmp_path / argv[argv.index("--out") + 1]).read_text()
    assert all(yaml.safe_load_all(out))  # the compiled IR: the pipeline spec, then the platform spec (the volume)
