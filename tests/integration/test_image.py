"""The image, checked without a Docker engine: exactly what the Dockerfile's COPY lines bring must
install and pass the Dockerfile's own import check (a package named in pyproject.toml but not
copied fails `pip install .` in the image; one the code imports but not copied fails the check)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from trainer.launch import IMAGE_GID, IMAGE_UID

ROOT = Path(__file__).resolve().parents[2]


def copied_paths(dockerfile: str) -> list[str]:
    """Sources of the Dockerfile's COPY lines (relative to the build context)."""
    sources = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *src, _dest = line.split()[1:]
            sources += src
    return sources


def import_check(dockerfile: str) -> str:
    """The Python the Dockerfile's install step runs to fail the build, not the first run."""
    return re.search(r'python -c "([^"]+)"', dockerfile)[1]


def build_image_env(dockerfile: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The image's Python environment without a Docker engine: a fresh venv into which exactly what
    ``dockerfile``'s COPY lines bring is installed (``pip install .``, as its RUN line does), then
    its own import check and ``rfsdp --help``, run away from the repository. The third-party
    packages come from this venv's site-packages (the image installs the same pins from PyPI)."""
    context = tmp_path / "context"
    context.mkdir()
    for src in copied_paths(dockerfile):
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, context / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, context / src)
    # The wheel is built by this venv's pip (it only writes the wheel); the fresh venv's own pip
    # installs it, so this venv's editable install of the repository is never touched.
    wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path / "wheel"),
        str(context),
    ]
    proc = subprocess.run(wheel, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return proc
    env_dir = tmp_path / "image-venv"
    venv.create(env_dir, with_pip=True)
    python, deps = env_dir / "bin" / "python", sysconfig.get_path("purelib")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    )
    # A plain path line: the dependencies, but not this venv's editable install of the repository.
    (Path(site.stdout.strip()) / "image_deps.pth").write_text(deps + "\n")
    steps = [
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            *map(str, (tmp_path / "wheel").glob("*.whl")),
        ],
        [python, "-c", import_check(dockerfile)],
        [env_dir / "bin" / "rfsdp", "--help"],
    ]
    for cmd in steps:
        proc = subprocess.run(
            cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}
        )
        if proc.returncode:
            return proc
    return proc


def test_the_image_environment_installs_and_passes_its_own_import_check(tmp_path: Path) -> None:
    proc = build_image_env((ROOT / "Dockerfile").read_text(), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: rfsdp" in proc.stdout  # the last step: the console script of the installed package


def test_a_dockerfile_that_leaves_a_package_out_fails_the_check(tmp_path: Path) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text().replace("COPY components components\n", "")
    proc = build_image_env(dockerfile, tmp_path)
    assert proc.returncode != 0 and "components" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(
    shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0,
    reason="no Docker engine runs on this machine: the image's environment is checked without one above",
)
def test_docker_build(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["docker", "build", "-q", "-t", "resilient-fsdp:test", str(ROOT)], capture_output=True, text=True, timeout=3600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


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
