"""`rfsdp prepare-data` from and into S3 (moto's server) and streamed in bounded memory (the
peak RSS of a process of its own). The local formats: tests/unit/test_data_formats.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import boto3
from tokenizers import Tokenizer

from tests.unit import test_data_formats
from tests.unit.test_data_formats import all_tokens, documents, write_jsonl
from trainer.data.prepare import local_data, prepare_dataset
from trainer.data.shards import (
    MANIFEST,
    load_manifest,
    tokenizer_dir,
)
from trainer.storage.store import upload_tree

docs = test_data_formats.docs  # a fixture of the unit tests'
trained = test_data_formats.trained  # a fixture of the unit tests'


def test_s3_corpus_and_tokenizer_into_s3_and_the_run_cache(
    trained: Path, docs: list[str], s3_bucket: str, tmp_path: Path
) -> None:
    bucket = s3_bucket.removeprefix("s3://")
    s3 = boto3.client("s3")
    s3.put_object(
        Bucket=bucket,
        Key="corpus/part-0.jsonl",
        Body="".join(json.dumps({"text": d}) + "\n" for d in docs[:200]).encode(),
    )
    s3.put_object(Bucket=bucket, Key="corpus/part-1.txt", Body="\n\n".join(docs[200:]).encode())
    upload_tree(trained / "tokenizer", f"{s3_bucket}/tok")
    data = f"{s3_bucket}/data"
    manifest = prepare_dataset(f"{s3_bucket}/corpus", data, tokenizer=f"{s3_bucket}/tok")
    assert manifest["tokenizer"] == "tok" and manifest["documents"] == 201
    local = local_data(data, tmp_path / "run")  # the verified cache fetches the tokenizer too
    assert tokenizer_dir(local) == local / "tokenizer"
    assert {p.name for p in (local / "tokenizer").iterdir()} == set(manifest["tokenizer_files"])
    tok = Tokenizer.from_file(str(local / "tokenizer" / "tokenizer.json"))
    assert tok.decode(all_tokens(local).tolist(), skip_special_tokens=False).split("<|endoftext|>")[:200] == docs[:200]
    # A single tokenizer.json object as the tokenizer.
    s3.put_object(Bucket=bucket, Key="one/tokenizer.json", Body=(trained / "tokenizer" / "tokenizer.json").read_bytes())
    other = prepare_dataset(f"{s3_bucket}/corpus", str(tmp_path / "d"), tokenizer=f"{s3_bucket}/one/tokenizer.json")
    assert other["splits"] == manifest["splits"]


RSS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from trainer.data.prepare import prepare_dataset
    prepare_dataset(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3] or None)
    assert "transformers" not in sys.modules, "the tokenizer path imported transformers"
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """
)


def peak_rss_mib(source: Path, out: Path, tokenizer: str = "") -> int:
    proc = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(source), str(out), tokenizer],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_a_corpus_larger_than_the_memory_bound_streams(trained: Path, tmp_path: Path) -> None:
    """Peak RSS on a 150 MB JSON lines corpus stays within 60 MiB of the same run on a tiny one
    (reading it whole would take 150 MB of text and 300 MB of tokens)."""
    block = "".join(json.dumps({"text": d}) + "\n" for d in documents(2000, seed=1)).encode()
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        for _ in range((150 << 20) // len(block) + 1):
            f.write(block)
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": d} for d in documents(300)])
    base = peak_rss_mib(small, tmp_path / "small")
    peak = peak_rss_mib(big, tmp_path / "big")
    assert peak - base < 60, (
        f"peak RSS {peak} MiB on {big.stat().st_size >> 20} MiB of JSON lines vs {base} MiB on a tiny corpus"
    )
    assert load_manifest(tmp_path / "big")["splits"]["val"]["tokens"] > 5_000_000
    os.remove(big)
    # A Hugging Face tokenizer goes through `tokenizers` alone (transformers is not imported).
    peak_rss_mib(small, tmp_path / "hf", str(trained / "tokenizer"))
    assert (tmp_path / "hf" / MANIFEST).is_file()
