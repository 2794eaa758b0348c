"""The image's build context, checked without a Docker engine: exactly what the Dockerfile's COPY
lines bring must build the distribution (a package named in pyproject.toml but not copied fails
`pip install .` in the image)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from trainer.launch import IMAGE_GID, IMAGE_UID

ROOT = Path(__file__).resolve().parent.parent


def copied_paths() -> list[str]:
    """Sources of the Dockerfile's COPY lines (relative to the build context)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *src, _dest = line.split()[1:]
            sources += src
    return sources


def test_the_image_build_context_makes_a_wheel(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for src in copied_paths():
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, context / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, context / src)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"), str(context)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "wheel").glob("resilient_fsdp-*.whl"))


def test_the_image_runs_as_the_unprivileged_user_the_pods_declare() -> None:
    """The image's final USER is numeric (Kubernetes' runAsNonRoot can only verify a number), is
    created with the ids trainer.launch declares for the pods' securityContext, and comes after
    every RUN, so installing stays root's and nothing the steps run is."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    users = [i for i, line in enumerate(lines) if line.startswith("USER ")]
    assert users, "the image must not run as root"
    assert lines[users[-1]].split()[1] == f"{IMAGE_UID}:{IMAGE_GID}"
    assert IMAGE_UID != 0 and IMAGE_GID != 0
    assert max(i for i, line in enumerate(lines) if line.startswith("RUN ")) < users[-1]
    created = " ".join(line for line in lines if "useradd" in line or "groupadd" in line)
    assert f"groupadd --gid {IMAGE_GID} " in created and f"useradd --uid {IMAGE_UID} --gid {IMAGE_GID} " in created
