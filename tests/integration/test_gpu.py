"""The GPU check (NCCL, bf16, NVRx's CUDA checkpoint path, both recovery layers): GPU machines only."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL + bf16 path); this machine has none")
def test_gpu_check_script(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "gpu")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
