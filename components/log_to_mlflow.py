from kfp import dsl
from kfp.dsl import Artifact, Input

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def log_to_mlflow(
    run: Input[Artifact], validation: dict, tracking_uri: str, experiment: str, run_name: str, backend: str, pipeline_job: str
) -> str:
    """Log the run (config, per-step losses, checkpoints, faults, restarts, validation) to MLflow.

    Args:
        run: the run dir from the train step.
        validation: the validation report of the run's checkpoint.
        tracking_uri: MLflow tracking URI ("" = ``MLFLOW_TRACKING_URI`` or MLflow's default store).
        experiment: MLflow experiment name.
        run_name: the pipeline's run name (a tag).
        backend: where the train step ran (a tag and a param).
        pipeline_job: the KFP pipeline job that produced the run (a tag).

    Returns:
        The MLflow run id (the same one when the step is repeated for the same run).
    """
    from pathlib import Path

    from trainer.results.tracking import log_run

    tags = {"run_name": run_name, "backend": backend, "kfp_pipeline_job": pipeline_job}
    run_id = log_run(Path(run.path), tracking_uri=tracking_uri or None, experiment=experiment, tags=tags, validation=validation)
    print(f"MLflow run {run_id} in experiment {experiment!r}")
    return run_id
