from kfp import dsl
from kfp.dsl import Artifact, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def check_run(
    run_spec: Output[Artifact],
    steps: int,
    ckpt_every: int,
    ckpt_mode: str,
    local_ckpt_every: int,
    local_replicas: int,
    nnodes: int,
    nproc_per_node: int,
    max_restarts: int,
    inprocess_restart: bool,
    max_bug_retries: int,
    fault: str,
    model: str,
    seq_len: int,
    grad_accum_steps: int,
    activation_checkpointing: bool,
    seed: int,
    hang_timeout: float,
    grace_period: float,
    system_metrics_every: float,
    backend: str,
    training_run: str,
    image: str,
    job_namespace: str,
    gpus: bool,
    cpu: str,
    memory: str,
    source: str,
    tokenizer: str,
    text_field: str,
    pvc_name: str,
    checkpoint_uri: str,
    tracking_uri: str,
    experiment: str,
    export_uri: str,
    registered_model: str,
    pipeline_job: str,
    pipeline_job_id: str,
) -> str:
    """Refuse a run that cannot work before anything starts, name the training run, and hand on
    the checked parameters as one run spec.

    Runs started from the Kubeflow UI never pass the CLI's checks: this step makes them. The
    tracking URI may come from the ``MLFLOW_TRACKING_URI`` key of the MLflow secret (an env
    variable of this pod). Each parameter is described on the pipeline.

    It writes the checked run spec to ``run_spec`` (a JSON file, ``components.runs.write_run_spec``):
    every parameter, the KFP run's, and the training run's name; the later steps read it instead of
    taking each parameter again.

    Returns:
        The training run's name: ``training_run``, or one derived from this KFP run.
    """
    params = dict(locals())  # the parameters, taken before anything else is defined here
    del params["run_spec"]  # (the output)
    import os

    from components.runs import CHECK_STEP, check_parameters, recorded, write_run_spec
    from trainer.launch import WORKSPACE_ENV
    from trainer.launch.spec import resolve_run_name

    name = resolve_run_name(training_run, pipeline_job, pipeline_job_id)  # a bad name: nowhere to record
    with recorded(name, pipeline_job_id, CHECK_STEP):
        env = os.environ
        here = WORKSPACE_ENV in env
        # Here, in the image and with the cluster's credentials, a model is checked wherever it is.
        check_parameters(
            params, name, tracking_uri_env=env.get("MLFLOW_TRACKING_URI", ""), steps_run_here=here, model_check="all"
        )
        write_run_spec(run_spec.path, params, name)
    print(f"training run {name}: parameters checked")
    return name
