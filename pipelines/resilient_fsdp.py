"""The ``resilient_fsdp_training`` pipeline: prepare data -> train -> validate checkpoint -> log to MLflow.

Compile, run locally with ``kfp.local`` or upload and submit to a Kubeflow Pipelines server::

    rfsdp pipeline compile --out work/resilient_fsdp_training.yaml
    rfsdp pipeline run-local --set fault=exception@15:1,sigkill@30:0
    rfsdp pipeline submit --host https://kfp.example.com --set backend=kubernetes --set run_name=exp-1
    rfsdp pipeline manifest --set nnodes=2 --set gpus=true     # the PyTorchJob the train step would create

Parameters are checked (``check_parameters``) before anything is compiled, submitted or started;
the train step checks them again before it starts a process or creates a job, which covers runs
started from the Kubeflow UI.
"""

# No `from __future__ import annotations` here: KFP reads the real types of the pipeline signature.
import inspect
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kfp import compiler, dsl, kubernetes
from kfp.dsl import Artifact, Markdown, Metrics

from components import IMAGE
from components.log_to_mlflow import log_to_mlflow
from components.prepare_data import prepare_data
from components.train import train
from components.validate_checkpoint import validate_checkpoint
from trainer.data import BUILTIN_CORPUS
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_MOUNT
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import config_defaults
from trainer.results.tracking import DEFAULT_EXPERIMENT

PIPELINE_NAME = "resilient-fsdp-training"
TRAIN = config_defaults()  # the pipeline's defaults are the config's and the launch spec's own
LAUNCH = LaunchSpec()


class Outputs(NamedTuple):
    """What a run of the pipeline produces."""

    run: Artifact
    metrics: Metrics
    report: Markdown
    mlflow_run_id: str


@dsl.pipeline(
    name=PIPELINE_NAME,
    description="Resilient FSDP training: NVRx async checkpoints, in-process and in-job restart; validated checkpoint, MLflow run.",
)
def resilient_fsdp_training(
    steps: int = TRAIN["steps"],
    ckpt_every: int = TRAIN["ckpt_every"],
    ckpt_mode: str = TRAIN["ckpt_mode"],
    nnodes: int = LAUNCH.nnodes,
    nproc_per_node: int = LAUNCH.nproc_per_node,
    max_restarts: int = LAUNCH.max_restarts,
    inprocess_restart: bool = TRAIN["inprocess_restart"],
    fault: str = TRAIN["fault"],
    model: str = TRAIN["model"],
    seed: int = TRAIN["seed"],
    hang_timeout: float = TRAIN["hang_timeout"],
    backend: str = "local",
    run_name: str = "rfsdp-run",
    image: str = IMAGE,
    namespace: str = "",
    gpus: bool = False,
    cpu: str = "4",
    memory: str = "16Gi",
    source: str = BUILTIN_CORPUS,
    pvc_name: str = "rfsdp-workspace",
    checkpoint_uri: str = TRAIN["checkpoint_uri"],
    tracking_uri: str = "",
    experiment: str = DEFAULT_EXPERIMENT,
) -> Outputs:
    """Train a transformer with FSDP that survives faults, validate its checkpoint, log it to MLflow.

    Args:
        steps: Total optimizer steps of the run.
        ckpt_every: Checkpoint interval in steps (the last step is always checkpointed).
        ckpt_mode: Checkpoint writer: async (NVRx background writer) or sync (blocking baseline).
        nnodes: Replicas: PyTorchJob Worker pods (kubernetes) or ft_launcher processes (local).
        nproc_per_node: Worker processes per replica (one per GPU with gpus=true).
        max_restarts: In-job restarts ft_launcher may do before the job fails.
        inprocess_restart: Recover soft faults (exceptions, stuck Python) inside the running processes.
        fault: Fault schedule KIND@STEP[:RANK],... KIND: exception, sigkill, hang, exit, sigterm (preemption), corrupt-event ("" none).
        model: Model size: tiny, small, base, large or 1b.
        seed: Seed of initialization and data order.
        hang_timeout: Seconds without a heartbeat before a rank counts as hung (the other timeouts derive from it).
        backend: Where training runs: local (processes in the train step) or kubernetes (a PyTorchJob).
        run_name: DNS-1035 name of the run: the PyTorchJob's name and its directory on the shared volume (a rerun resumes).
        image: Container image of every step and worker (built from the project's Dockerfile).
        namespace: Namespace of the PyTorchJob ("" = the pipeline's namespace).
        gpus: Request one NVIDIA GPU per worker process (kubernetes).
        cpu: CPU request and limit per worker pod (kubernetes), e.g. 4 or 500m.
        memory: Memory request and limit per worker pod (kubernetes), e.g. 16Gi.
        source: Training corpus: a file or directory path, or builtin:python-docs.
        pvc_name: ReadWriteMany PersistentVolumeClaim mounted at /mnt/rfsdp for the data and run dirs (kubernetes).
        checkpoint_uri: Remote location (s3://bucket/prefix) durable checkpoints are mirrored to ("" none).
        tracking_uri: MLflow tracking URI ("" = MLFLOW_TRACKING_URI or MLflow's default local store).
        experiment: MLflow experiment name.
    """
    data = prepare_data(source=source).set_display_name("prepare data")
    trained = train(
        data=data.outputs["data"],
        steps=steps,
        ckpt_every=ckpt_every,
        ckpt_mode=ckpt_mode,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        inprocess_restart=inprocess_restart,
        fault=fault,
        model=model,
        seed=seed,
        hang_timeout=hang_timeout,
        checkpoint_uri=checkpoint_uri,
        backend=backend,
        run_name=run_name,
        image=image,
        namespace=namespace,
        pvc_name=pvc_name,
        gpus=gpus,
        cpu=cpu,
        memory=memory,
    ).set_display_name("train")
    checked = validate_checkpoint(run=trained.outputs["run"], data=data.outputs["data"]).set_display_name("validate checkpoint")
    logged = log_to_mlflow(
        run=trained.outputs["run"],
        validation=checked.outputs["Output"],
        tracking_uri=tracking_uri,
        experiment=experiment,
        run_name=run_name,
        backend=backend,
        pipeline_job=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
    ).set_display_name("log to MLflow")
    # The train step must really run each time (it resumes its run dir); the others are cheap.
    for task in (trained, checked, logged):
        task.set_caching_options(False)
    for task in (data, trained, checked, logged):
        task.set_container_image(image)
        for secret, keys in CREDENTIAL_SECRETS.items():
            kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env={k: k for k in keys}, optional=True)
    # The train step hands data and run dir to the PyTorchJob's workers through this volume.
    kubernetes.mount_pvc(trained, pvc_name=pvc_name, mount_path=WORKSPACE_MOUNT)
    return Outputs(
        run=trained.outputs["run"], metrics=checked.outputs["metrics"], report=checked.outputs["report"], mlflow_run_id=logged.output
    )


# ------------------------------------------------------------------ parameters
def parameter_defaults() -> dict[str, Any]:
    """Every pipeline parameter with its default (the pipeline function's signature)."""
    signature = inspect.signature(resilient_fsdp_training.pipeline_func)
    return {name: p.default for name, p in signature.parameters.items()}


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings (``--set``) -> typed parameter values; raises ValueError naming a bad one."""
    defaults = parameter_defaults()
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--set: {item!r} is not NAME=VALUE")
        if name not in defaults:
            raise ValueError(f"--set: unknown parameter {name!r} (known: {', '.join(defaults)})")
        kind = type(defaults[name])
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[name] = raw.lower() in ("true", "1", "yes")
            else:
                values[name] = kind(raw)
        except ValueError:
            raise ValueError(f"--set {name}: {raw!r} is not a valid {kind.__name__}") from None
    return values


def check_parameters(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """All parameters (defaults + ``overrides``) after the checks the train step makes before it
    starts anything: training config, launch spec, fault schedule, run name, image, resources.

    Raises:
        ValueError: naming the bad parameter.
    """
    from trainer.launch.k8s import build_pytorchjob, cluster_options, shared_paths
    from trainer.launch.local import BACKENDS, job_from_parameters

    defaults = parameter_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} (known: {', '.join(defaults)})")
    params = {**defaults, **overrides}
    if params["backend"] not in BACKENDS:
        raise ValueError(f"backend: {params['backend']!r} is not one of {', '.join(BACKENDS)}")
    if not params["experiment"].strip():
        raise ValueError("experiment: must not be empty")
    data, run_dir = shared_paths(params["run_name"])
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    build_pytorchjob(cfg, spec, cluster_options(params))  # run name, image, resources: checked on every backend
    return params


def pytorchjob_manifest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The PyTorchJob the train step creates with ``backend=kubernetes`` and these parameters."""
    from trainer.launch.k8s import build_pytorchjob, cluster_options, shared_paths, to_manifest
    from trainer.launch.local import job_from_parameters

    params = check_parameters(overrides)
    data, run_dir = shared_paths(params["run_name"])
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    return to_manifest(build_pytorchjob(cfg, spec, cluster_options(params)))


# ------------------------------------------------------------------ compile / run / submit
def compile_pipeline(out: Path) -> Path:
    """Compile the pipeline to KFP IR YAML (with the kubernetes platform document)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_func=resilient_fsdp_training, package_path=str(out))
    return out


def run_local(overrides: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """Run the whole pipeline with ``kfp.local`` (SubprocessRunner, this interpreter).

    Args:
        overrides: pipeline parameters that differ from the defaults.
        root: working directory: the pipeline root (artifacts) lives under it.

    Returns:
        ``run_dir``, ``metrics`` (dict), ``report`` (path) and ``mlflow_run_id``.

    Raises:
        ValueError: a bad parameter (nothing was started).
        RuntimeError: a step failed (kfp.local names it).
    """
    import kfp.local

    check_parameters(overrides)
    root.mkdir(parents=True, exist_ok=True)
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root.resolve() / "pipeline_root"), raise_on_error=True
    )
    try:
        task = resilient_fsdp_training(**overrides)
    finally:
        kfp.local.config.LocalExecutionConfig.instance = None  # the next run configures its own
    out = task.outputs
    return {
        "run_dir": out["run"].path,
        "metrics": dict(out["metrics"].metadata),
        "report": out["report"].path,
        "mlflow_run_id": out["mlflow_run_id"],
    }


def submit(
    host: str,
    overrides: Mapping[str, Any],
    *,
    kfp_experiment: str = "resilient-fsdp",
    namespace: str | None = None,
    service_account: str | None = None,
    existing_token: str | None = None,
    package: Path | None = None,
) -> dict[str, str]:
    """Compile, upload (a new pipeline or a new version of it) and start a run on a KFP server.

    Returns:
        ``pipeline_id``, ``version_id``, ``experiment_id`` and ``run_id``.
    """
    import tempfile

    import kfp

    params = check_parameters(overrides)
    client = kfp.Client(host=host, namespace=namespace or "kubeflow", existing_token=existing_token)
    with tempfile.TemporaryDirectory() as tmp:
        path = compile_pipeline(package or Path(tmp) / "pipeline.yaml")
        pipeline_id = client.get_pipeline_id(PIPELINE_NAME)
        if pipeline_id is None:  # first upload: the pipeline and its first version
            pipeline_id = client.upload_pipeline(str(path), pipeline_name=PIPELINE_NAME, namespace=namespace).pipeline_id
            versions = client.list_pipeline_versions(pipeline_id, page_size=1, sort_by="created_at desc").pipeline_versions
            version_id = versions[0].pipeline_version_id
        else:
            name = f"{PIPELINE_NAME}-{time.strftime('%Y%m%d-%H%M%S')}"
            version_id = client.upload_pipeline_version(str(path), name, pipeline_id=pipeline_id).pipeline_version_id
    experiment = client.create_experiment(kfp_experiment, namespace=namespace)
    run = client.run_pipeline(
        experiment_id=experiment.experiment_id,
        job_name=f"{params['run_name']}-{time.strftime('%Y%m%d-%H%M%S')}",
        params=dict(overrides),
        pipeline_id=pipeline_id,
        version_id=version_id,
        service_account=service_account,
    )
    return {"pipeline_id": pipeline_id, "version_id": version_id, "experiment_id": experiment.experiment_id, "run_id": run.run_id}


def print_local_result(result: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Show what a local pipeline run did: the run's tables, the verdict, where everything is."""
    from rich.console import Console
    from rich.table import Table

    from trainer.events import EVENTS_FILE
    from trainer.results.summary import print_run_summary
    from trainer.results.tracking import resolve_tracking_uri

    run_dir = Path(result["run_dir"])
    print_run_summary(run_dir)
    metrics = result["metrics"]
    checks = sorted(k.removesuffix("_passed") for k in metrics if k.endswith("_passed"))
    table = Table(title=f"validation of step {int(metrics.get('step', 0))}: valid")
    for column in ("check", "result", "seconds"):
        table.add_column(column)
    for check in checks:
        table.add_row(check, "pass" if metrics[f"{check}_passed"] else "FAIL", f"{metrics.get(f'{check}_seconds', 0):.1f}")
    Console().print(table)
    # Plain lines, not a table: paths must not be cut to the terminal's width.
    print(f"run dir:           {run_dir}")
    print(f"events:            {run_dir / EVENTS_FILE}")
    print(f"validation report: {result['report']}")
    print(f"MLflow run id:     {result['mlflow_run_id']}")
    print(f"MLflow UI:         mlflow ui --backend-store-uri {resolve_tracking_uri(overrides.get('tracking_uri') or None)}")
