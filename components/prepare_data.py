from kfp import dsl
from kfp.dsl import Dataset, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def prepare_data(data: Output[Dataset], source: str = "builtin:python-docs") -> None:
    """Tokenize a corpus into checksummed token shards.

    Args:
        data: the prepared data set (train/val shards and ``manifest.json``).
        source: corpus file or directory, or ``builtin:python-docs`` (the Python docs shipped with Python).
    """
    from pathlib import Path

    from trainer.cli import main
    from trainer.data import load_manifest

    if main(["prepare-data", "--source", source, "--out", data.path]) != 0:
        raise RuntimeError(f"prepare-data failed for source {source!r} (the reason is printed above)")
    manifest = load_manifest(Path(data.path))
    data.metadata.update(
        {"source": source, "tokenizer": manifest["tokenizer"], **{f"{k}_tokens": v["tokens"] for k, v in manifest["splits"].items()}}
    )
