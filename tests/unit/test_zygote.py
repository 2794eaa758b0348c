"""Pre-warmed workers (trainer.launch.zygote): a request carries no secret. Real jobs whose
restarted ranks are forks of the node's zygote: tests/integration/test_zygote_runs.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trainer.launch.worker import request_of
from trainer.launch.zygote import Request, model_flag, rank_environment
from trainer.models import model_modules


def test_a_request_carries_no_secret_and_the_rank_gets_them_from_the_zygote() -> None:
    """The zygote was started from the same launcher's environment, so a request names the
    secrets it withholds and the rank takes their values from the zygote's own.
    """
    env = {
        "RANK": "1",
        "AWS_SECRET_ACCESS_KEY": "a",
        "RFSDP_CHECKPOINT_KEY": "b",
        "MLFLOW_TRACKING_PASSWORD": "c",
        "AWS_SESSION_TOKEN": "d",
    }
    request = request_of(["--steps", "3"], env)
    assert request["env"] == {"RANK": "1"}
    assert request["withheld"] == [
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "MLFLOW_TRACKING_PASSWORD",
        "RFSDP_CHECKPOINT_KEY",
    ]
    assert "a" not in json.dumps(request["env"])
    zygote_env = {**env, "RANK": "0", "UNRELATED_KEY": "z"}
    req = Request(request["argv"], request["env"], request["withheld"], "/", 1, 0.0, [])
    assert rank_environment(req, zygote_env) == env  # the client's RANK; the zygote's other secrets stay out


def test_the_agent_names_its_zygote_by_the_rendezvous_id_its_workers_get() -> None:
    """The agent starts the zygote under the run id ft_launcher gives its workers
    (``TORCHELASTIC_RUN_ID``): its flag, in either spelling, over ``PET_RDZV_ID``; a flag of the
    training module after ``-m`` is not ft_launcher's."""
    from trainer.launch.agent import rendezvous_id
    from trainer.launch.local import worker_command
    from trainer.rank.config import TrainConfig

    argv = worker_command(TrainConfig(data="d", run_dir="r"))[3:]
    assert argv[argv.index("-m") + 1] == "trainer.launch.worker"
    assert rendezvous_id(argv, {"PET_RDZV_ID": "job-7"}) == "job-7"  # the operator's environment
    assert rendezvous_id(argv, {}) == "none"  # ft_launcher's default
    assert rendezvous_id(["--rdzv-id", "a", *argv], {"PET_RDZV_ID": "job-7"}) == "a"
    assert rendezvous_id(["--rdzv_id=b", *argv], {}) == "b"
    assert rendezvous_id([*argv, "--rdzv-id", "c"], {"PET_RDZV_ID": "job-7"}) == "job-7"


def test_the_zygote_finds_the_model_on_the_agents_command_line() -> None:
    """The agent's flags come first, the training module's after them: the last ``--model`` wins."""
    agent = ["python", "-m", "trainer.launch.agent", "--nproc-per-node", "2", "-m", "trainer.launch.worker"]
    assert model_flag([*agent, "--data", "d", "--model", "hf:/m", "--steps", "3"]) == "hf:/m"
    assert model_flag([*agent, "--model=py:team.model:build"]) == "py:team.model:build"
    assert model_flag([*agent, "--data", "d"]) == model_flag([*agent, "--model"]) == ""


def test_an_hf_models_modules_come_from_its_config(tmp_path: Path) -> None:
    """What the zygote imports for an ``hf:`` model: transformers' causal-LM classes, and the
    modeling module its config names where the config is local. Each name is a real module."""
    base = ["trainer.models.hf", "transformers.models.auto.modeling_auto"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    local = model_modules(f"hf:{tmp_path}")
    assert local == [*base, "transformers.models.llama.modeling_llama"]
    assert all(importlib.util.find_spec(name) is not None for name in local)
    assert model_modules("hf:meta-llama/Llama-3.2-1B") == base  # the hub's: its config is not here yet
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama.modeling_llama.os"}))
    assert model_modules(f"hf:{tmp_path}") == base  # only a plain name makes a module name
    (tmp_path / "config.json").write_text("[]")
    assert model_modules(f"hf:{tmp_path}") == base


@pytest.mark.parametrize("model", ["tiny", "py:trainer.models.example:build"])
def test_only_an_hf_model_adds_imports_to_the_zygote(model: str) -> None:
    """A built-in size needs none; a team's own module may take a GPU when imported."""
    assert model_modules(model) == []


def test_the_agent_drops_a_dead_node_from_the_rendezvous_after_5_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVRx 0.4.1's rendezvous handler fixes the keep-alive at 3 renewals of 5 s, by keyword: the
    agent makes every settings object it builds renew each second and give up after 5 missed."""
    import datetime
    import inspect

    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rendezvous

    from trainer.launch.agent import KEEP_ALIVE_ATTEMPTS, KEEP_ALIVE_S, shorten_keep_alive

    monkeypatch.setattr(rendezvous, "RendezvousSettings", rendezvous.RendezvousSettings)  # restored after
    built = inspect.getsource(rendezvous.FtRendezvousHandler.from_backend)
    assert "keep_alive_interval=" in built and "keep_alive_max_attempt=" in built  # by keyword, as the shim needs
    assert shorten_keep_alive()
    settings = rendezvous.RendezvousSettings(
        "run",
        1,
        2,
        rendezvous.RendezvousTimeout(),
        keep_alive_interval=datetime.timedelta(seconds=5),
        keep_alive_max_attempt=3,
    )
    assert settings.keep_alive_interval == datetime.timedelta(seconds=KEEP_ALIVE_S) == datetime.timedelta(seconds=1)
    assert settings.keep_alive_max_attempt == KEEP_ALIVE_ATTEMPTS == 5


def test_the_agent_delays_only_its_first_join_and_polls_a_waiting_rendezvous_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVRx 0.4.1 delays a join by a random 0-0.3 s while the rendezvous is at round 0, which it
    still is at the first restart; a node serves a copy of the state up to 1 s old, and one that
    waits for its peers polls every 1 s: the agent delays only each handler's first join, and
    both waits are ``SYNC_POLL_S``."""
    import inspect
    import types

    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rendezvous
    from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.rendezvous import utils

    from trainer.launch.agent import SYNC_POLL_S, prompt_rendezvous

    handler = rendezvous.FtRendezvousHandler
    joining = inspect.getsource(handler.next_rendezvous)
    assert "state.round == 0" in joining and "_delay(seconds=(0, 0.3))" in joining  # what the shim takes out
    assert "_delay(seconds=1)" in inspect.getsource(rendezvous._DistributedRendezvousOpExecutor.run)
    assert "_BackendRendezvousStateHolder(backend, settings)" in inspect.getsource(handler.from_backend)

    slept: list[float] = []
    # NVRx's _delay sleeps through its module's time.sleep: replaced there only, so that no other
    # thread's sleep is counted (or made to spin)
    monkeypatch.setattr(utils, "time", types.SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(rendezvous, "_delay", rendezvous._delay)  # all three restored after
    monkeypatch.setattr(rendezvous, "_BackendRendezvousStateHolder", rendezvous._BackendRendezvousStateHolder)
    monkeypatch.setattr(handler, "next_rendezvous", lambda self: rendezvous._delay(seconds=(0.1, 0.2)) or self)
    assert prompt_rendezvous()

    class Agent:  # stands in for a handler: the join above only delays, as NVRx's does at round 0
        pass

    first, other = Agent(), Agent()
    assert handler.next_rendezvous(first) is first and len(slept) == 1 and 0.1 <= slept[0] <= 0.2
    handler.next_rendezvous(first)  # a restart: no delay
    handler.next_rendezvous(first)
    assert len(slept) == 1
    handler.next_rendezvous(other)  # another handler's first join is still delayed
    assert len(slept) == 2
    rendezvous._delay(seconds=1)  # a waiting node's poll
    assert slept[2:] == [SYNC_POLL_S] == [0.1]
    assert rendezvous._BackendRendezvousStateHolder(object(), object())._cache_duration == SYNC_POLL_S
