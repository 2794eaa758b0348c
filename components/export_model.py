from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def export_model(
    run: Input[Artifact],
    data: Input[Dataset],
    training_run: str,
    pipeline_job_id: str,
    export_uri: str,
    registered_model: str,
) -> None:
    """Export the validated checkpoint as a model directory (``rfsdp export``) to ``export_uri``;
    nothing to do when it is "". The exit handler logs it to MLflow as the run's model.

    Args:
        run: the train step's reference to the run on the shared volume and its latest checkpoint
            (the one the validation step found valid: this step runs only after it passed).
        data: the prepared data set (its tokenizer goes with the model).
        training_run: the training run's name (where the export is recorded).
        pipeline_job_id: the KFP run (tags the record).
        export_uri: an empty s3://bucket/prefix or absolute directory ("" = no export).
        registered_model: the MLflow registered model the exit handler registers it under ("" none).
    """
    from pathlib import Path

    from components.runs import EXPORT_STEP, handed_on_run, record_export, recorded
    from trainer.errors import ParameterError

    if not export_uri:
        print("export_uri is empty: no export")
        return
    with recorded(training_run, pipeline_job_id, EXPORT_STEP):
        from trainer.results.export import export_run

        run_dir, step = handed_on_run(Path(run.path))
        try:
            result = export_run(run_dir, export_uri, step=step or None, data=Path(data.path))
        except ParameterError as e:  # the destination is this step's parameter, not the CLI's --out
            raise ParameterError("export_uri" if e.field == "out" else e.field, e.problem, style="parameter") from None
        record_export(training_run, pipeline_job_id, result.to_dict(), registered_model)
        print(
            f"exported step {result.step} ({result.kind}, {len(result.files)} files, {result.bytes:,} bytes) "
            f"to {export_uri}"
        )
