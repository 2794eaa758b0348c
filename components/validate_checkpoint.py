from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def validate_checkpoint(run: Input[Artifact], data: Input[Dataset], metrics: Output[Metrics], report: Output[Markdown]) -> dict:
    """Check the run's newest checkpoint in a single process; fail the pipeline when it is invalid.

    Args:
        run: the run dir from the train step.
        data: the prepared data set (held-out split for evaluation).
        metrics: the validation metrics (shown in the Kubeflow UI).
        report: the verdict and every check as Markdown.

    Returns:
        The validation report as a dict (handed to the MLflow step).
    """
    from pathlib import Path

    from trainer.results.validate import validate_run

    result = validate_run(Path(run.path), data=Path(data.path))
    for name, value in result.metrics().items():
        metrics.log_metric(name, value)
    Path(report.path).write_text(result.to_markdown())
    if not result.valid:
        raise RuntimeError(f"checkpoint at step {result.step} is invalid: failed check(s): {', '.join(result.failed)}")
    return result.to_dict()
