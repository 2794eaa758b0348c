"""Issue 35: a team's own model: Hugging Face causal LMs (two families, from weights and from a
config) and a ``py:`` factory, trained on 2 CPU ranks with faults, resumed bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import losses, rfsdp, train
from trainer.data.shards import load_split
from trainer.events import Restart, RunStart, read_events, select

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
RUN = ("--steps", "12", "--ckpt-every", "4", "--seq-len", "32", "--batch-size", "4")


def save_model(out: Path, family: str, *, weights: bool, vocab_size: int = 320, **shape: int) -> Path:
    """A tiny model of ``family`` (llama or qwen2) saved as Hugging Face saves it: with weights
    (``save_pretrained``) or its config alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](
        vocab_size=vocab_size, max_position_embeddings=128, **{**SHAPE, **shape}
    )
    if weights:
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    else:
        config.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "model", "llama", weights=True)


@pytest.fixture(scope="session")
def qwen2_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("qwen2") / "model", "qwen2", weights=False)


def first_step_loss(model_dir: Path, data: Path) -> float:
    """Step 1's loss as plain transformers computes it: the mean of both ranks' first batches."""
    from transformers import AutoModelForCausalLM

    from trainer.data.loader import TokenLoader

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = load_split(data, "train")
    per_rank = []
    for rank in (0, 1):
        inputs, targets = TokenLoader(tokens, 32, 4, rank=rank, world_size=2).next_batch()
        with torch.no_grad():
            logits = model(input_ids=inputs).logits
        per_rank.append(
            float(torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)))
        )
    return sum(per_rank) / 2


FAULTS = "exception@6:1,sigkill@10:0"


def baseline_and_faulted(model: str, data: Path, folder: Path, *, resumed: bool = False) -> tuple[Path, Path]:
    """``model`` trained for 12 steps uninterrupted, and again with an in-process and an in-job
    restart; ``resumed``: the faulted one with the local tier, stopped at step 8 by one `rfsdp
    train` and resumed to 12 by another (each fault fires in the session that reaches its step)."""
    baseline, faulted = folder / "baseline", folder / "faulted"
    train(data, baseline, "--model", model, *RUN)
    if resumed:
        tier = ("--local-ckpt-every", "1")
        train(data, faulted, "--model", model, *RUN, *tier, "--fault", FAULTS, "--stop-at-step", "8")
        train(data, faulted, "--model", model, *RUN, *tier, "--fault", FAULTS)
    else:
        train(data, faulted, "--model", model, *RUN, "--fault", FAULTS)
    return baseline, faulted


@pytest.fixture(scope="module")
def llama_runs(llama_weights: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Llama from its weights: uninterrupted, and faulted, with the local tier, and resumed
    by a second `rfsdp train` (shared by the resume test and the validation test)."""
    return baseline_and_faulted(f"hf:{llama_weights}", data_dir, tmp_path_factory.mktemp("llama-runs"), resumed=True)


@pytest.mark.parametrize("kind", ["llama-weights", "qwen2-config", "py-example"])
def test_a_model_of_your_own_resumes_bit_for_bit_after_faults(
    kind: str, llama_weights: Path, qwen2_config: Path, data_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "llama-weights":
        baseline, faulted = request.getfixturevalue("llama_runs")
    else:
        model = {"qwen2-config": f"hf:{qwen2_config}", "py-example": "py:trainer.models.example:build"}[kind]
        baseline, faulted = baseline_and_faulted(model, data_dir, tmp_path)
    resumed = kind == "llama-weights"  # that one with the local tier too, and resumed by a second session
    assert sorted(losses(baseline)) == list(range(1, 13))
    assert losses(faulted) == losses(baseline)  # every step's final loss, bit for bit
    sources = [e.source for e in select(read_events(faulted), Restart)]
    assert len(sources) == 2 and (not resumed or "local" in sources), sources
    starts = select(read_events(faulted), RunStart)
    assert [s.resumed_from_step for s in starts] == ([0, 8] if resumed else [0])
    assert all(s.config["seq_len"] == 32 for s in starts)
    if kind == "llama-weights":  # training continued from the saved weights, not from a fresh initialization
        assert math.isclose(losses(baseline)[1], first_step_loss(llama_weights, data_dir), rel_tol=1e-5)
    assert losses(baseline)[12] < losses(baseline)[1]


def test_a_resumed_hf_run_validates_with_all_six_checks(llama_runs: tuple[Path, Path]) -> None:
    """The Llama run that was faulted and resumed by a second `rfsdp train`."""
    _, run = llama_runs
    proc = rfsdp("validate", "--run-dir", str(run), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = json.loads(proc.stdout)
    assert {c["name"]: c["passed"] for c in verdict["checks"]} == dict.fromkeys(
        ("complete", "intact", "loadable", "finite", "quality", "replays"), True
    )


def test_grad_accumulation_and_activation_checkpointing_train_the_same_model(
    llama_weights: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Recomputing activations changes no number; two micro-batches of 2 make one step of 4 sequences."""
    plain, recomputed = tmp_path / "plain", tmp_path / "recomputed"
    common = ("--model", f"hf:{llama_weights}", "--steps", "4", "--ckpt-every", "4", "--seq-len", "32")
    train(data_dir, plain, *common, "--batch-size", "2", "--grad-accum-steps", "2")
    train(data_dir, recomputed, *common, "--batch-size", "2", "--grad-accum-steps", "2", "--activation-checkpointing")
    assert losses(recomputed) == losses(plain)
    [start] = select(read_events(plain), RunStart)
    assert start.config["grad_accum_steps"] == 2
    assert all(np.isfinite(v) for v in losses(plain).values())


def test_bad_models_are_refused_before_any_worker_starts(llama_weights: Path, data_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    (bad / "unbuildable").mkdir(parents=True)
    (bad / "unbuildable" / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    misfit = save_model(bad / "misfit", "llama", weights=False, hidden_size=32, intermediate_size=64)
    for name in ("model.safetensors", "generation_config.json"):  # another shape's weights beside this config
        (misfit / name).write_bytes((llama_weights / name).read_bytes())
    small_vocab = save_model(bad / "small-vocab", "llama", weights=False, vocab_size=100)
    cases = {
        f"hf:{bad / 'missing'}": "no model directory",
        f"hf:{bad / 'unbuildable'}": "cannot read its config.json",
        f"hf:{misfit}": "do not fit its config",
        f"hf:{small_vocab}": "vocabulary of 100, smaller than the data's largest token id",
        "py:trainer.models.example:no_such_factory": "has no function no_such_factory",
        "py:no_such_package.module:build": "cannot import no_such_package.module",
    }
    for model, problem in cases.items():
        run = tmp_path / "runs" / model.split("/")[-1].replace(":", "_")
        proc = rfsdp("train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), "--model", model)
        assert proc.returncode == 2, (model, proc.stderr[-2000:])
        assert "--model" in proc.stderr and problem in proc.stderr and "Traceback" not in proc.stderr, (
            model,
            proc.stderr[-2000:],
        )
        assert not run.exists(), model  # nothing written
