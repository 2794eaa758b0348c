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
    assert {"steps", "ckpt_every", "ckpt_mode", "fault", "model", "hang_timeout", "grace_period", "nnodes", "max_restarts"} <= in_pipeline
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
        job_from_parameters({**params, "ckpt_every": 10, "fault": "exception@99"}, data=str(tmp_path), run_dir=str(tmp_path / "run"))
    with pytest.raises(ParameterError, match="^max_restarts: must be at least 0"):
        job_from_parameters({**params, "max_restarts": -1}, data=str(tmp_path), run_dir=str(tmp_path / "run"))


def test_train_help_shows_defaults_choices_fault_kinds_and_an_example(capsys: pytest.CaptureFixture) -> None:
    from trainer.cli import main
    from trainer.faults import FAULT_KINDS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ckpt-mode {async,sync}" in text and "--model {tiny,small,base,large,1b}" in text
    assert "(default: 10)" in text and "(default: 'async')" in text
    assert all(f"{kind}:" in text for kind in FAULT_KINDS)
    assert "example: rfsdp train --data" in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("rfsdp 0.1.0")
