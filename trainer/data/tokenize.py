"""Tokenizers for data prep: byte-level UTF-8 (the default), a Hugging Face ``tokenizer.json``
(local or ``s3://``), or a byte-level BPE trained on the corpus.

Only the ``tokenizers`` library is used here (``transformers`` costs seconds to import): a
trained tokenizer is saved as ``tokenizer.json`` + ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.shards import TOKENIZER, token_dtype
from trainer.errors import ParameterError
from trainer.storage.store import StorageError, is_remote, open_storage

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The files of a Hugging Face tokenizer directory that a data set keeps (when present)."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""Special tokens taken as the end-of-document token when no config names one."""
TRAINED_EOS = "<|endoftext|>"
MAX_TRAIN_VOCAB = 1 << 20
BYTE_SEPARATOR = "\n\n"
"""What separates documents for a tokenizer without an end-of-document token."""


@dataclass
class Tokenizer:
    """A tokenizer as data prep uses it.

    ``hf`` is a ``tokenizers.Tokenizer`` (None for byte-level); ``files`` maps the file names to
    keep with the data set to local paths; ``eos_id`` separates documents when set.
    """

    name: str
    vocab_size: int
    eos_id: int | None = None
    hf: Any = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        """The shard dtype that holds every id of the vocabulary."""
        return token_dtype(self.vocab_size)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added)."""
        if self.hf is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=self.dtype) for e in encodings]

    def separator(self) -> np.ndarray:
        """The tokens between two documents: the EOS token, else the encoding of a blank line."""
        if self.eos_id is not None:
            return np.array([self.eos_id], dtype=self.dtype)
        return self.encode_batch([BYTE_SEPARATOR])[0].astype(self.dtype)


def byte_tokenizer() -> Tokenizer:
    """The default: one token per UTF-8 byte."""
    return Tokenizer(TOKENIZER, 256)


def load_tokenizer(path: str, workdir: Path) -> Tokenizer:
    """The Hugging Face tokenizer at ``path``: a directory holding ``tokenizer.json`` (and maybe
    ``tokenizer_config.json``, ``special_tokens_map.json``) or a bare ``tokenizer.json`` file,
    local or ``s3://`` (remote files are fetched into ``workdir``).

    Raises:
        ParameterError: naming ``--tokenizer`` for a missing path or a file that does not parse.
    """
    if is_remote(path):
        local, name = _fetch_remote(path, workdir / "tokenizer-src"), path.rstrip("/").rsplit("/", 1)[-1]
    else:
        local = Path(path.removeprefix("file://"))
        if not local.exists():
            raise ParameterError("tokenizer", f"no tokenizer at {path}")
        name = local.name if local.is_dir() else local.stem
        if local.is_file() and local.name == "tokenizer.json":
            name = local.resolve().parent.name
    files = (
        {n: local / n for n in TOKENIZER_FILES if (local / n).is_file()}
        if local.is_dir()
        else {"tokenizer.json": local}
    )
    if "tokenizer.json" not in files:
        raise ParameterError(
            "tokenizer", f"{path}: no tokenizer.json (give a Hugging Face tokenizer directory or its tokenizer.json)"
        )
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_file(str(files["tokenizer.json"]))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ParameterError(
            "tokenizer", f"{path}: not a tokenizer.json the tokenizers library reads ({str(e)[:200]})"
        ) from None
    configs = [_read_json(files[n], path) for n in ("tokenizer_config.json", "special_tokens_map.json") if n in files]
    return Tokenizer(
        name.removesuffix(".json") or "tokenizer",
        hf.get_vocab_size(with_added_tokens=True),
        _eos_id(hf, configs),
        hf,
        files,
    )


def _fetch_remote(uri: str, dest: Path) -> Path:
    """Download a remote tokenizer (a prefix holding the files, or one tokenizer.json object)."""
    try:
        store = open_storage(uri)
        keys = set(store.list())
        if not keys:
            if store.stat("") is None:
                raise ParameterError("tokenizer", f"no tokenizer at {uri}")
            store.download("", dest / "tokenizer.json")
            return dest
        for name in TOKENIZER_FILES:
            if name in keys:
                store.download(name, dest / name)
    except StorageError as e:
        raise ParameterError("tokenizer", str(e)) from None
    return dest


def _read_json(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ParameterError("tokenizer", f"{where}: cannot read {path.name} ({e})") from None
    if not isinstance(data, dict):
        raise ParameterError("tokenizer", f"{where}: {path.name} is not a JSON object")
    return data


def _eos_id(hf: Any, configs: list[dict]) -> int | None:
    """The end-of-document token: the configs' ``eos_token``, else a well-known special token."""
    for config in configs:
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and (found := hf.token_to_id(eos)) is not None:
            return int(found)
    for token in EOS_CANDIDATES:
        if (found := hf.token_to_id(token)) is not None:
            return int(found)
    return None


def check_train_vocab(vocab_size: int) -> None:
    """Refuse a BPE vocabulary that cannot hold the byte alphabet plus the EOS token, or is absurd."""
    least = 256 + 1
    if not least <= vocab_size <= MAX_TRAIN_VOCAB:
        raise ParameterError(
            "train_tokenizer",
            f"vocabulary size must be in [{least}, {MAX_TRAIN_VOCAB:,}] (256 bytes + {TRAINED_EOS}), got {vocab_size}",
        )


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (streamed) and save it into ``out_dir`` in a form
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_train_vocab(vocab_size)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[TRAINED_EOS],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": TRAINED_EOS,
        "bos_token": TRAINED_EOS,
        "unk_token": TRAINED_EOS,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "model_max_length": 1_000_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: TRAINED_EOS for k in ("eos_token", "bos_token", "unk_token")}, indent=2) + "\n"
    )
    files = {n: out_dir / n for n in TOKENIZER_FILES}
    size = hf.get_vocab_size(with_added_tokens=True)
    return Tokenizer(f"bpe-{size}", size, hf.token_to_id(TRAINED_EOS), hf, files)


def copy_files(tokenizer: Tokenizer, dest: Path) -> None:
    """Copy the tokenizer's files into ``dest`` (a data set's ``tokenizer/``)."""
    if not tokenizer.files:
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name, path in tokenizer.files.items():
        shutil.copyfile(path, dest / name)
