"""Issue 35: ``rfsdp export``: a run's checkpoint as a Hugging Face model directory that plain
transformers loads with no project code (tensors and logits equal the checkpoint's bit for bit),
tied embeddings written once, the data set's tokenizer carried along, an ``s3://`` destination,
the built-in and ``py:`` formats, and bad input refused before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.conftest import train
from tests.integration.test_models import save_model
from trainer.checkpoint import read_full_state
from trainer.cli import main
from trainer.data.prepare import prepare_dataset
from trainer.data.shards import builtin_corpus_text

RUN = ("--steps", "4", "--ckpt-every", "2", "--seq-len", "32", "--batch-size", "4")
INPUT_IDS = [[1, 5, 9, 42, 7, 250, 3, 77, 100, 11, 2, 64]]

# Run with -I -S: no PYTHONPATH, no working directory, no .pth files (the project's editable
# install is one), only the venv's site-packages: transformers and torch, never this project.
PLAIN = """
import importlib.util, json, sys
sys.path.append({site!r})
assert importlib.util.find_spec("trainer") is None, "the project is importable"
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained({model!r})
model.eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor({ids!r})).logits
torch.save({{"state": dict(model.state_dict()), "logits": logits}}, {dump!r})
out = {{"class": type(model).__name__, "dtype": str(model.dtype), \
"tied": model.lm_head.weight is model.get_input_embeddings().weight}}
if {tokenizer!r}:
    tok = PreTrainedTokenizerFast.from_pretrained({model!r})
    out["tokens"] = tok("def f(x):\\n    return x + 1")["input_ids"]
print(json.dumps(out))
"""


def load_with_plain_transformers(model: Path, tmp: Path, *, tokenizer: bool = False) -> tuple[dict, dict]:
    """Load ``model`` in a Python that cannot import this project; returns what it printed and its
    state dict and logits on ``INPUT_IDS``."""
    dump = tmp / "reloaded.pt"
    site = sysconfig.get_paths()["purelib"]
    script = PLAIN.format(site=site, model=str(model), ids=INPUT_IDS, dump=str(dump), tokenizer=tokenizer)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script], cwd=tmp, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(dump)


def checkpoint_logits(config_dir: Path, state: dict) -> torch.Tensor:
    """The logits of a fresh model of ``config_dir``'s architecture holding the checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits


def assert_equal_bits(reloaded: dict, checkpoint: dict) -> None:
    assert sorted(reloaded) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert reloaded[name].dtype == tensor.dtype and torch.equal(reloaded[name], tensor), name


@pytest.fixture(scope="module")
def llama_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama (from a config) trained for 4 steps on byte tokens: (its config dir, the run)."""
    root = tmp_path_factory.mktemp("llama-export")
    config = save_model(root / "llama", "llama", weights=False)
    train(data_dir, root / "run", "--model", f"hf:{config}", *RUN)
    return config, root / "run"


def test_an_exported_llama_loads_with_plain_transformers_and_equals_the_checkpoint(
    llama_run: tuple[Path, Path], tmp_path: Path
) -> None:
    config, run = llama_run
    out = tmp_path / "exported"
    assert main(["export", "--run-dir", str(run), "--out", str(out), "--max-shard-size", "150KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"  # ~460 KB in shards of at most 150 KB
    assert all((out / s).stat().st_size <= 150_000 + 10_000 for s in shards)  # (+ each file's header)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors.index.json", *shards])
    assert (out / "config.json").read_bytes() == (config / "config.json").read_bytes()
    checkpoint = read_full_state(run / "checkpoints" / "step_000004")["model"]  # the latest
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in checkpoint.values())

    shown, reloaded = load_with_plain_transformers(out, tmp_path)
    assert shown == {"class": "LlamaForCausalLM", "dtype": "torch.float32", "tied": False}
    assert_equal_bits(reloaded["state"], checkpoint)
    assert torch.equal(reloaded["logits"], checkpoint_logits(config, checkpoint))

    # An earlier step, in one shard (the default 2GB): still with its index, as a sharded save.
    earlier = tmp_path / "step2"
    assert main(["export", "--run-dir", str(run), "--step", "2", "--out", str(earlier)]) == 0
    assert sorted(p.name for p in earlier.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    _, reloaded = load_with_plain_transformers(earlier, tmp_path)
    assert_equal_bits(reloaded["state"], read_full_state(run / "checkpoints" / "step_000002")["model"])


def test_tied_embeddings_are_written_once_and_the_trained_tokenizer_goes_along(tmp_path: Path) -> None:
    """A Qwen2 with tie_word_embeddings on a data set with its own BPE tokenizer."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(builtin_corpus_text()[:400_000])
    data = tmp_path / "data"
    prepare_dataset(str(corpus), str(data), train_tokenizer=400)
    config = save_model(tmp_path / "qwen2", "qwen2", weights=True, vocab_size=512, tie_word_embeddings=True)
    run, out = tmp_path / "run", tmp_path / "exported"
    train(data, run, "--model", f"hf:{config}", *RUN)
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == sorted(index["weight_map"])  # noqa: SIM118 (not a dict)
    assert (out / "generation_config.json").read_bytes() == (config / "generation_config.json").read_bytes()
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}

    shown, reloaded = load_with_plain_transformers(out, tmp_path, tokenizer=True)
    assert shown["class"] == "Qwen2ForCausalLM" and shown["tied"] is True
    # The data's own tokenizer. (transformers 5's AutoTokenizer gives a qwen2 model its family's
    # Qwen2Tokenizer whatever tokenizer_config.json names: PreTrainedTokenizerFast reads tokenizer.json as is.)
    assert (
        shown["tokens"]
        == Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json")).encode("def f(x):\n    return x + 1").ids
    )
    checkpoint = read_full_state(run / "checkpoints" / "step_000004")["model"]
    assert_equal_bits(reloaded["state"], checkpoint)  # lm_head.weight included: tied to the embeddings again
    assert torch.equal(reloaded["logits"], checkpoint_logits(config, checkpoint))


def test_an_export_to_s3_uploads_a_whole_model_and_refuses_a_second_one(
    llama_run: tuple[Path, Path], s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from trainer.storage.store import open_storage

    config, run = llama_run
    uri = f"{s3_bucket}/models/llama"
    assert main(["export", "--run-dir", str(run), "--out", uri]) == 0
    store = open_storage(uri)
    keys = store.list()
    assert sorted(keys) == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    local = tmp_path / "downloaded"
    for key in keys:
        store.download(key, local / key)
    _, reloaded = load_with_plain_transformers(local, tmp_path)
    assert_equal_bits(reloaded["state"], read_full_state(run / "checkpoints" / "step_000004")["model"])

    capsys.readouterr()
    assert main(["export", "--run-dir", str(run), "--out", uri]) == 2
    assert f"--out: {uri} is not empty" in capsys.readouterr().err
    assert sorted(store.list()) == sorted(keys)


@pytest.mark.parametrize("model", ["tiny", "py:trainer.models.example:build"])
def test_builtin_and_py_models_export_to_the_documented_format(model: str, data_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "exported"
    train(data_dir, run, "--model", model, *RUN)
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    checkpoint = read_full_state(run / "checkpoints" / "step_000004")["model"]
    if model == "tiny":  # the recipe docs/models.md gives
        from trainer.models.builtin import ModelSize, Transformer

        assert config == {
            "architecture": "rfsdp-builtin",
            "format_version": 1,
            "model": "tiny",
            "dim": 64,
            "layers": 2,
            "heads": 4,
            "seq_len": 64,
            "vocab_size": 256,
            "dtype": "float32",
            "step": 4,
        }
        module = Transformer(ModelSize(**{k: config[k] for k in ("dim", "layers", "heads", "seq_len", "vocab_size")}))
    else:
        from trainer.models.example import build

        assert config["architecture"] == "rfsdp-py" and config["factory"] == "trainer.models.example:build"
        assert (config["vocab_size"], config["seq_len"], config["step"]) == (256, 64, 4)
        module = build().module
    module.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert_equal_bits(dict(module.state_dict()), checkpoint)


def test_bad_input_is_refused_naming_the_parameter_before_anything_is_written(
    llama_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    _, run = llama_run
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("checkpoints"))
    full = tmp_path / "full"
    (full / "keep.txt").parent.mkdir()
    (full / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    cases = {
        (
            "--run-dir",
            str(tmp_path / "missing"),
            "--out",
            str(out),
        ): f"--run-dir: {tmp_path / 'missing'} does not exist",
        ("--run-dir", str(bare), "--out", str(out)): f"--run-dir: {bare} has no published checkpoint",
        (
            "--run-dir",
            str(run),
            "--step",
            "3",
            "--out",
            str(out),
        ): f"--step: {run} has no published checkpoint step_000003 (published: [2, 4]",
        ("--run-dir", str(run), "--out", str(full)): f"--out: {full} is not an empty directory",
        (
            "--run-dir",
            str(run),
            "--out",
            str(out),
            "--max-shard-size",
            "lots",
        ): "--max-shard-size: 'lots' is not a size",
    }
    for args, problem in cases.items():
        capsys.readouterr()
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert problem in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not out.exists(), args
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
