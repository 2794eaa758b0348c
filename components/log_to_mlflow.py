from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Markdown, Metrics, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def log_to_mlflow(
    status: dsl.PipelineTaskFinalStatus,
    training_run: str,
    backend: str,
    tracking_uri: str,
    experiment: str,
    pipeline_job: str,
    pipeline_job_id: str,
    image: str,
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> NamedTuple("Logged", [("mlflow_run_id", str), ("mlflow_url", str), ("training_run", str)]):
    """The exit handler: log the run to MLflow however the pipeline ended, and show its headline.

    Args:
        status: how the steps ended (KFP fills it in).
        training_run: the pipeline parameter ("" = derived from the KFP run).
        backend: where the train step ran (a tag and a param).
        tracking_uri: MLflow tracking URI ("" = ``MLFLOW_TRACKING_URI``, from the MLflow secret on a cluster).
        experiment: MLflow experiment name.
        pipeline_job: the KFP run's job name (a tag).
        pipeline_job_id: the KFP run's id (a tag).
        image: the image the steps and workers ran (a tag).
        metrics: the headline figures (goodput, restarts, recovery, checkpoint stall and overhead, loss, verdict).
        report: the run summary, the validation table and the MLflow run's URL.

    Returns:
        The MLflow run's id and URL, and the training run's name.
    """
    from pathlib import Path

    from components.runs import log_pipeline_run

    logged = log_pipeline_run(
        state=status.state,
        error_message=status.error_message or "",
        training_run=training_run,
        backend=backend,
        tracking_uri=tracking_uri,
        experiment=experiment,
        pipeline_job=pipeline_job,
        pipeline_job_id=pipeline_job_id,
        image=image,
    )
    for name, value in logged.headline.items():
        metrics.log_metric(name, value)
    Path(report.path).write_text(logged.markdown)
    print(f"pipeline {status.state}; training run {logged.training_run}; MLflow run {logged.mlflow_url}")
    return logged.mlflow_run_id, logged.mlflow_url, logged.training_run
