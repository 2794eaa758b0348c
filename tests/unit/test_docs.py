"""The deployment guide's commands are ones this code base accepts, and its files exist.

Running the guide's compile and manifest commands: tests/integration/test_docs_runs.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from trainer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deployment.md"


def commands(prefix: str) -> list[list[str]]:
    """The command lines of the guide's bash blocks that start with ``prefix``."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(prefix)]


@pytest.mark.parametrize("argv", commands("rfsdp "), ids=lambda argv: " ".join(argv[1:3]))
def test_every_rfsdp_command_parses_with_the_real_cli(argv: list[str]) -> None:
    args = build_parser().parse_args(argv[1:])  # argparse exits (a failure here) on an unknown flag or choice
    for item in getattr(args, "set", None) or []:
        assert "=" in item, item


def test_every_file_the_guide_names_exists() -> None:
    named = set(re.findall(r"(?:deploy|scripts|docs|tests)/[\w./-]+\.(?:yaml|sh|md|py)", GUIDE.read_text()))
    assert {"deploy/pvc.yaml", "deploy/rbac.yaml", "scripts/gpu_check.sh"} <= named
    assert [name for name in sorted(named) if not (ROOT / name).is_file()] == []
    kubectl = [argv for argv in commands("kubectl ") if "apply" in argv]
    assert {argv[argv.index("-f") + 1] for argv in kubectl} == {"deploy/pvc.yaml", "deploy/rbac.yaml"}


def test_the_volume_claim_is_one_the_pods_mount() -> None:
    import dataclasses

    from trainer.launch.k8s import ClusterOptions

    default = next(f.default for f in dataclasses.fields(ClusterOptions) if f.name == "pvc_name")
    claim = yaml.safe_load((ROOT / "deploy" / "pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["apiVersion"] == "v1"
    assert claim["metadata"]["name"] == default  # the pipeline's default pvc_name
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # workers on several nodes write to it


def test_the_readme_commands_for_your_own_model_parse_with_the_real_cli() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your model, your data, your weights", 1)[1].split("\n## ", 1)[0]
    lines = [
        line.split("  #")[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
        for line in block.splitlines()
    ]
    argvs = [shlex.split(line)[1:] for line in lines if line.startswith("rfsdp ")]
    assert [argv[0] for argv in argvs] == ["prepare-data", "train", "export"]
    for argv in argvs:
        build_parser().parse_args(argv)  # argparse exits (a failure here) on an unknown flag
    models = (ROOT / "docs" / "models.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", models, re.S):
        for line in block.splitlines():
            if line.startswith("rfsdp "):
                build_parser().parse_args(shlex.split(line.split("  #")[0])[1:])
