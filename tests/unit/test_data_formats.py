"""`rfsdp prepare-data` with real tokenizers (given or trained) and local corpora (text, JSON
lines, Parquet). S3 and the memory bound: tests/integration/test_data_formats_runs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer.cli import main as rfsdp_main
from trainer.data.loader import TokenLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.shards import (
    builtin_corpus_text,
    data_vocab,
    load_manifest,
    load_split,
    tokenizer_dir,
    verify_shards,
)
from trainer.errors import ParameterError

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "naïve",
    "café",
    "✓",
    "über",
    "数据",
]


def documents(n: int, seed: int = 0) -> list[str]:
    """Varied documents (unicode, spacing, newlines) of a few hundred characters each."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(20, 80)))
        text = " ".join(words).replace(" kappa ", "\n  kappa\t")
        docs.append(f"Doc {i}: {text}.  End!")
    return docs


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def all_tokens(data: Path) -> np.ndarray:
    return np.concatenate([load_split(data, "train"), load_split(data, "val")])


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = rfsdp_main(["prepare-data", *args])
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return documents(400)


@pytest.fixture(scope="module")
def trained(docs: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data set whose BPE tokenizer was trained on its own JSON lines corpus."""
    root = tmp_path_factory.mktemp("trained")
    source = write_jsonl(root / "corpus.jsonl", [{"text": d} for d in docs])
    prepare_dataset(str(source), str(root / "data"), train_tokenizer=400, shard_tokens=5000)
    return root / "data"


def test_trained_tokenizer_round_trips_through_transformers(trained: Path, docs: list[str]) -> None:
    from transformers import AutoTokenizer

    manifest = load_manifest(trained)
    assert manifest["tokenizer"] == "bpe-400" and manifest["vocab_size"] == 400 and manifest["dtype"] == "uint16"
    assert set(manifest["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert data_vocab(manifest) == (400, manifest["max_token_id"]) and 256 < manifest["max_token_id"] < 400
    assert tokenizer_dir(trained) == trained / "tokenizer"
    verify_shards(trained, manifest)
    hf = AutoTokenizer.from_pretrained(str(trained / "tokenizer"))
    for text in (*docs[:5], "naïve café ✓ 数据\n\n  indented\ttab  ", " leading space"):
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    # The shards hold the documents, joined by the EOS token.
    tokens = all_tokens(trained)
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    cuts = np.flatnonzero(tokens == eos)
    pieces = np.split(tokens, cuts)
    decoded = [hf.decode(p[1:] if i else p) for i, p in enumerate(pieces)]
    assert decoded == docs


def test_given_tokenizer_matches_its_own_encoding(
    trained: Path, docs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"body": d} for d in docs] + [{"text": "no body"}, {"body": 7}])
    code, out, err = cli(
        capsys,
        "--source",
        str(source),
        "--out",
        str(tmp_path / "d"),
        "--tokenizer",
        str(trained / "tokenizer"),
        "--text-field",
        "body",
    )
    assert code == 0, err
    assert "tokenizer tokenizer, vocab 400, uint16; 2 record(s) without 'body' skipped" in out
    tok = Tokenizer.from_file(str(trained / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for i, d in enumerate(docs):
        expected += ([eos] if i else []) + tok.encode(d, add_special_tokens=False).ids
    assert all_tokens(tmp_path / "d").tolist() == expected
    manifest = load_manifest(tmp_path / "d")
    assert (manifest["documents"], manifest["skipped_records"], manifest["text_field"]) == (400, 2, "body")
    # A bare tokenizer.json works too; its name is its directory's.
    assert prepare_dataset(
        str(source), str(tmp_path / "e"), tokenizer=str(trained / "tokenizer" / "tokenizer.json"), text_field="body"
    )["tokenizer_files"] == {"tokenizer.json": manifest["tokenizer_files"]["tokenizer.json"]}
    assert all_tokens(tmp_path / "e").tolist() == expected


def test_a_text_file_in_many_blocks_encodes_as_a_whole(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.data import corpus

    monkeypatch.setattr(corpus, "BLOCK_CHARS", 20_000)  # ~15 blocks, cut at line breaks
    text = builtin_corpus_text()[:300_000]
    (tmp_path / "c.txt").write_text(text)
    prepare_dataset(str(tmp_path / "c.txt"), str(tmp_path / "d"), tokenizer=str(trained / "tokenizer"))
    tok = Tokenizer.from_file(str(trained / "tokenizer" / "tokenizer.json"))
    assert all_tokens(tmp_path / "d").tolist() == tok.encode(text, add_special_tokens=False).ids


def test_parquet_rows_are_documents_and_nulls_are_counted(docs: list[str], tmp_path: Path) -> None:
    source = tmp_path / "corpus"
    source.mkdir()
    texts = [*docs[:200], None, *docs[200:]]
    pq.write_table(pa.table({"content": texts, "n": list(range(len(texts)))}), source / "a.parquet", row_group_size=50)
    write_jsonl(source / "b.jsonl", [{"content": "tail document"}, ["not", "a", "record"]])
    manifest = prepare_dataset(str(source), str(tmp_path / "d"), text_field="content")
    assert (manifest["documents"], manifest["skipped_records"]) == (401, 2)
    text = bytes(all_tokens(tmp_path / "d").astype(np.uint8)).decode()
    assert text == "\n\n".join([*docs, "tail document"])  # byte-level: documents joined by a blank line
    with pytest.raises(
        ParameterError, match=r"^--text-field: no record of .* has a string field 'text' \(403 records\)"
    ):
        prepare_dataset(str(source), str(tmp_path / "x"), text_field="text")
    with pytest.raises(ParameterError, match="^--text-field"):  # a column of numbers holds no text
        prepare_dataset(str(source / "a.parquet"), str(tmp_path / "x"), text_field="n")
    assert not (tmp_path / "x").exists()


def test_a_vocabulary_above_65535_gets_uint32(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}, "<|endoftext|>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    source = write_jsonl(
        tmp_path / "c.jsonl",
        [{"text": " ".join(f"w{(i * 7919 + j) % 70_000}" for j in range(100))} for i in range(120)],
    )
    manifest = prepare_dataset(str(source), str(tmp_path / "d"), tokenizer=str(tmp_path / "big.json"))
    assert (manifest["tokenizer"], manifest["dtype"], manifest["vocab_size"]) == ("big", "uint32", 70_002)
    tokens = all_tokens(tmp_path / "d")
    assert tokens.dtype == np.uint32 and len(tokens) == 120 * 101 - 1
    assert manifest["max_token_id"] == int(tokens.max()) > 65_535
    assert tokens[100] == 70_001 and tokens[0] == 1 + 0  # EOS between documents; "w0" is id 1
    x, y = TokenLoader(load_split(tmp_path / "d", "train"), 16, 2, 0, 1).next_batch()
    assert int(x.max()) > 255 and x.shape == y.shape == (2, 16)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"tokenizer": "{tmp}/nowhere"}, "--tokenizer: no tokenizer at "),
        (
            {"tokenizer": "{tmp}/garbage.json"},
            "--tokenizer: {tmp}/garbage.json: not a tokenizer.json the tokenizers library reads",
        ),
        ({"tokenizer": "{tmp}"}, "--tokenizer: {tmp}: no tokenizer.json"),
        ({"source": "{tmp}/missing.jsonl"}, "--source: no corpus file at "),
        ({"source": "{tmp}/empty.txt"}, "--source: no text in "),
        (
            {"source": "{tmp}/records.jsonl"},
            "--text-field: no record of {tmp}/records.jsonl has a string field 'text' (2 records)",
        ),
        ({"train_tokenizer": 100}, "--train-tokenizer: vocabulary size must be in [257, 1,048,576]"),
        ({"train_tokenizer": 10**9}, "--train-tokenizer: vocabulary size must be in"),
        (
            {"train_tokenizer": 300, "tokenizer": "{tmp}/garbage.json"},
            "--train-tokenizer: cannot be combined with --tokenizer",
        ),
        ({"train_tokenizer": 300, "source": "{tmp}/empty.txt"}, "--source: no text in "),
    ],
)
def test_bad_input_is_refused_before_writing(kwargs: dict, error: str, tmp_path: Path) -> None:
    (tmp_path / "garbage.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "records.jsonl", [{"title": "x"}, {"text": None}])
    args = {"source": str(tmp_path / "empty.txt" if "tokenizer" in kwargs else tmp_path / "records.jsonl"), **kwargs}
    args = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in args.items()}
    out = tmp_path / "out"
    with pytest.raises(ParameterError) as e:
        prepare_dataset(args.pop("source"), str(out), **args)
    assert str(e.value).startswith(error.format(tmp=tmp_path)), str(e.value)
    assert not out.exists()


def test_a_too_small_corpus_leaves_nothing_behind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_jsonl(tmp_path / "c.jsonl", [{"text": "tiny"}])
    code, _, err = cli(capsys, "--source", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "out"))
    assert (code, err) == (2, "rfsdp prepare-data: error: corpus too small: 4 tokens (need at least 10000)")
    assert not (tmp_path / "out").exists()
