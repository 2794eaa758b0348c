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
    from trainer.data.prepare import prepare_dataset

    manifest = prepare_dataset(source, data.path)
    data.metadata.update(
        {"source": source, "tokenizer": manifest["tokenizer"], **{f"{k}_tokens": v["tokens"] for k, v in manifest["splits"].items()}}
    )
