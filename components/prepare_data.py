from kfp import dsl
from kfp.dsl import Dataset, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def prepare_data(
    data: Output[Dataset],
    training_run: str,
    pipeline_job_id: str,
    source: str = "builtin:python-docs",
    tokenizer: str = "",
    text_field: str = "text",
) -> None:
    """Tokenize a corpus into checksummed token shards.

    Args:
        data: the prepared data set (train/val shards and ``manifest.json``).
        training_run: the training run's name (where a failure is recorded).
        pipeline_job_id: the KFP run (tags the failure record).
        source: corpus: text, .jsonl or .parquet file, directory or s3:// prefix, or ``builtin:python-docs``.
        tokenizer: Hugging Face tokenizer directory or tokenizer.json, local or s3:// ("" = byte-level).
        text_field: the JSON lines field or Parquet column holding a record's text.
    """
    from components.runs import PREPARE_STEP, recorded
    from trainer.data.prepare import prepare_dataset

    with recorded(training_run, pipeline_job_id, PREPARE_STEP):
        manifest = prepare_dataset(source, data.path, tokenizer=tokenizer or None, text_field=text_field)
    data.metadata.update(
        {
            "source": source,
            "tokenizer": manifest["tokenizer"],
            "vocab_size": manifest["vocab_size"],
            **{f"{k}_tokens": v["tokens"] for k, v in manifest["splits"].items()},
        }
    )
