from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def validate_checkpoint(run: Input[Artifact], data: Input[Dataset], training_run: str, pipeline_job_id: str) -> None:
    """Check the run's newest checkpoint in a single process; fail the pipeline when it is invalid.

    The verdict goes into the run's record for the exit handler, which shows it in the run's
    report and logs it to MLflow; here only its one-line summary is printed.

    Args:
        run: the train step's reference to the run on the shared volume and its latest checkpoint.
        data: the prepared data set (held-out split for evaluation).
        training_run: the training run's name (where the verdict is recorded).
        pipeline_job_id: the KFP run (tags the record).
    """
    from pathlib import Path

    from components.runs import VALIDATE_STEP, handed_on_run, record_validation, recorded
    from trainer.results.validate import validate_run

    with recorded(training_run, pipeline_job_id, VALIDATE_STEP):
        run_dir, step = handed_on_run(Path(run.path))  # on the shared volume: nothing was copied
        result = validate_run(run_dir, step=step or None, data=Path(data.path))
        record_validation(training_run, pipeline_job_id, result.to_dict(), result.to_markdown())
        print(result.summary())
        if not result.valid:
            raise RuntimeError(
                f"checkpoint at step {result.step} is invalid: failed check(s): {', '.join(result.failed)}"
            )
