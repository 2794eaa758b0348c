"""One typed path from parameters to config: defaults defined once, errors named as the caller wrote them."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from pipelines.resilient_fsdp import resilient_fsdp_training
from trainer.cli import build_parser
from trainer.errors import ParameterError
from trainer.launch.local import job_from_parameters
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig, config_defaults


def pipeline_defaults() -> dict:
    signature = inspect.signature(resilient_fsdp_training.pipeline_func)
    return {name: p.default for name, p in signature.parameters.items()}


def train_flag_defaults() -> dict:
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # argparse keeps subparsers here
    return {a.dest: a.default for a in train._actions if a.dest != "help"}


def test_the_cli_the_pipeline_and_the_config_share_their_defaults() -> None:
    config = config_defaults()
    launch = dataclasses.asdict(LaunchSpec())
    pipeline, flags = pipeline_defaults(), train_flag_defaults()
    shared = {**config, **launch}
    in_pipeline = set(pipeline) & set(shared)
    assert {
        "steps",
        "ckpt_every",
        "ckpt_mode",
        "fault",
        "model",
        "hang_timeout",
        "grace_period",
        "nnodes",
        "max_restarts",
    } <= in_pipeline
    assert {name: pipeline[name] for name in in_pipeline} == {name: shared[name] for name in in_pipeline}
    in_cli = set(flags) & set(shared)
    assert set(config) - {"world_size"} <= in_cli  # every config field is a flag (world_size derives from the spec)
    assert {name: flags[name] for name in in_cli} == {name: shared[name] for name in in_cli}


def test_errors_name_the_flag_on_the_command_line_and_the_parameter_in_the_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ParameterError, match="^--ckpt-every: must be positive, got 0$"):
        TrainConfig(data="d", run_dir="r", ckpt_every=0)
    params = {**config_defaults(), **dataclasses.asdict(LaunchSpec()), "ckpt_every": 0}
    with pytest.raises(ParameterError, match="^ckpt_every: must be positive, got 0$") as caught:
        job_from_parameters(params, data=str(tmp_path), run_dir=str(tmp_path / "run"))
    assert caught.value.field == "ckpt_every"
    with pytest.raises(ParameterError, match="^fault: step 99 in 'exception@99' is outside the run"):
        job_from_parameters(
            {**params, "ckpt_every": 10, "fault": "exception@99"}, data=str(tmp_path), run_dir=str(tmp_path / "run")
        )
    with pytest.raises(ParameterError, match="^max_restarts: must be at least 0"):
        job_from_parameters({**params, "max_restarts": -1}, data=str(tmp_path), run_dir=str(tmp_path / "run"))


def test_train_help_shows_defaults_choices_fault_kinds_and_an_example(capsys: pytest.CaptureFixture) -> None:
    from trainer.cli import main
    from trainer.faults import FAULT_KINDS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ckpt-mode {async,sync}" in text and "--model MODEL" in text and "hf:PATH" in text
    assert "(default: 10)" in text and "(default: 'async')" in text
    unwrapped = text.replace("- ", "-")  # argparse may wrap a line after the hyphen of corrupt-event
    assert all(f"{kind}:" in unwrapped for kind in FAULT_KINDS)
    assert "example: rfsdp train --data" in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("rfsdp 0.1.0")


def test_pipeline_params_lists_every_parameter_and_writes_a_file_that_reads_back_as_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from pipelines.resilient_fsdp import parameter_defaults, read_parameters_file
    from trainer.cli import main

    assert main(["pipeline", "params"]) == 0
    listing = capsys.readouterr().out
    for name, spec in resilient_fsdp_training.component_spec.inputs.items():
        assert f"{name} ({spec.type}, default {spec.default!r})" in listing
        assert " ".join(spec.description.split())[:40] in " ".join(listing.split())
    assert main(["pipeline", "params", "--yaml"]) == 0
    params = tmp_path / "params.yaml"
    params.write_text(capsys.readouterr().out)
    assert read_parameters_file(params) == parameter_defaults()


def test_params_file_feeds_manifest_and_set_overrides_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import yaml

    from trainer.cli import main

    params = tmp_path / "params.yaml"
    # YAML's own types where the parameter is text (cpu: 2) and a float given as an integer.
    params.write_text("steps: 20\nnnodes: 3\ncpu: 2\nhang_timeout: 12\ntracking_uri: http://mlflow.ns:5000\n")
    assert main(["pipeline", "manifest", "--params", str(params), "--set", "nnodes=2"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2  # --set wins over the file
    container = worker["template"]["spec"]["containers"][0]
    assert container["command"][container["command"].index("--steps") + 1] == "20"
    assert container["resources"]["limits"]["cpu"] == "2"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("steps: 20\nstesp: 30\n", "unknown parameter 'stesp'"),
        ("steps: many\n", "steps: 'many' is not a valid int"),
        ("gpus: 3\n", "gpus: 3 is not a valid bool"),
        ("- steps\n", "not a mapping of parameter names to values"),
        ("steps: [\n", "cannot read it"),
    ],
)
def test_a_bad_params_file_is_refused_naming_the_key_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: str, error: str
) -> None:
    from trainer.cli import main

    params = tmp_path / "params.yaml"
    params.write_text(text)
    assert main(["pipeline", "run-local", "--params", str(params), "--root", str(tmp_path / "root")]) == 2
    out, err = capsys.readouterr()
    assert f"--params {params}" in err and error in err and out == ""
    assert not (tmp_path / "root").exists()
