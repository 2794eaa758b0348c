"""The ``resilient_fsdp_training`` pipeline: check -> prepare data -> train -> validate checkpoint,
inside an exit handler that logs every run to MLflow (failed ones with the failing step and why)
and shows its headline figures and report in the Kubeflow UI.

Compile, run locally with ``kfp.local`` or upload and submit to a Kubeflow Pipelines server
(``pipelines.run``)::

    rfsdp pipeline compile --out resilient_fsdp_training.yaml
    rfsdp pipeline run-local --set fault=exception@15:1,sigkill@30:0
    rfsdp pipeline submit --host https://kfp.example.com --set tracking_uri=http://mlflow.ns:5000
    rfsdp pipeline manifest --set nnodes=2 --set gpus=true     # the PyTorchJob the train step would create

The defaults are those of a person starting a run from the Kubeflow UI: training runs as a
PyTorchJob, the MLflow server comes from ``tracking_uri`` or the MLflow secret, and the training
run's name is derived from the KFP run (an explicit ``training_run`` resumes that run).
``run_local`` passes the local overrides itself. Parameters are checked (``check_parameters``)
before anything is compiled, submitted or started; the first step checks them again, which
covers runs started from the UI.
"""

# No `from __future__ import annotations` here: KFP reads the real types of the pipeline signature.
import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kfp import dsl, kubernetes
from kfp.dsl import Markdown, Metrics

from components import IMAGE
from components.check_run import check_run
from components.export_model import export_model
from components.log_to_mlflow import log_to_mlflow
from components.prepare_data import prepare_data
from components.runs import PREVIEW_RUN
from components.runs import check_parameters as check_run_parameters
from components.train import train
from components.validate_checkpoint import validate_checkpoint
from trainer.data import BUILTIN_CORPUS
from trainer.faults import NODE_KINDS, RANK_KINDS
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_MOUNT
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import config_defaults
from trainer.results.tracking import DEFAULT_EXPERIMENT

if TYPE_CHECKING:
    pass

PIPELINE_NAME = "resilient-fsdp-training"
TRAIN = config_defaults()  # the pipeline's defaults are the config's and the launch spec's own
LAUNCH = LaunchSpec()
LOCAL_OVERRIDES = {"backend": "local"}
"""What ``run_local`` sets unless told otherwise (besides a local ``tracking_uri``)."""
STEPS_LOG = "steps.log"
"""The steps' output of a quiet ``run_local``, in its root."""
DEFAULT_NAMESPACE = "default"
"""The namespace of a job whose ``job_namespace`` is "" outside a pod (``TrainingClient``'s)."""


class Outputs(NamedTuple):
    """What a run of the pipeline shows: the headline figures, the report, the MLflow run."""

    metrics: Metrics
    report: Markdown
    mlflow_run_id: str
    mlflow_url: str
    training_run: str


def _fault_kinds() -> str:
    """The fault kinds for the ``fault`` parameter's description (KFP reads it from the docstring)."""
    kinds = "; ".join(f"{kind}: {what}" for kind, what in RANK_KINDS.items())
    return f"{kinds}. {' and '.join(NODE_KINDS)} are refused: they need rfsdp train --netns"


def _with_fault_kinds(func: Callable) -> Callable:
    """Fill the fault kinds into ``func``'s docstring before ``dsl.pipeline`` reads the descriptions."""
    func.__doc__ = func.__doc__.replace("{FAULT_KINDS}", _fault_kinds())
    return func


@dsl.pipeline(
    name=PIPELINE_NAME,
    description=(
        "Resilient FSDP training: NVRx async checkpoints, in-process and in-job restart; "
        "a validated checkpoint; MLflow."
    ),
)
@_with_fault_kinds
def resilient_fsdp_training(
    steps: int = TRAIN["steps"],
    ckpt_every: int = TRAIN["ckpt_every"],
    ckpt_mode: str = TRAIN["ckpt_mode"],
    local_ckpt_every: int = TRAIN["local_ckpt_every"],
    local_replicas: int = TRAIN["local_replicas"],
    nnodes: int = LAUNCH.nnodes,
    nproc_per_node: int = LAUNCH.nproc_per_node,
    max_restarts: int = LAUNCH.max_restarts,
    inprocess_restart: bool = TRAIN["inprocess_restart"],
    max_bug_retries: int = TRAIN["max_bug_retries"],
    fault: str = TRAIN["fault"],
    model: str = TRAIN["model"],
    seq_len: int = TRAIN["seq_len"],
    grad_accum_steps: int = TRAIN["grad_accum_steps"],
    activation_checkpointing: bool = TRAIN["activation_checkpointing"],
    seed: int = TRAIN["seed"],
    hang_timeout: float = TRAIN["hang_timeout"],
    grace_period: float = TRAIN["grace_period"],
    system_metrics_every: float = TRAIN["system_metrics_every"],
    backend: str = "kubernetes",
    training_run: str = "",
    image: str = IMAGE,
    job_namespace: str = "",
    gpus: bool = False,
    cpu: str = "4",
    memory: str = "16Gi",
    source: str = BUILTIN_CORPUS,
    tokenizer: str = "",
    text_field: str = "text",
    pvc_name: str = "rfsdp-workspace",
    checkpoint_uri: str = TRAIN["checkpoint_uri"],
    tracking_uri: str = "",
    experiment: str = DEFAULT_EXPERIMENT,
    export_uri: str = "",
    registered_model: str = "",
) -> Outputs:
    """Train a transformer with FSDP that survives faults, validate its checkpoint, log every run to MLflow.

    Args:
        steps: Total optimizer steps of the run.
        ckpt_every: Checkpoint interval in steps (the last step is always checkpointed).
        ckpt_mode: Checkpoint writer: async (NVRx background writer) or sync (blocking baseline).
        local_ckpt_every: Local snapshot interval in steps: each rank's state also goes to its node's memory (/dev/shm,
            sized for it), and a recovery resumes from it when it is newer than the durable checkpoint (0 = off;
            -1 = every step for the models up to small, off for larger ones).
        local_replicas: Peer copies of each rank's local snapshots, held on other nodes, so that a replaced node's state
            comes back from a peer (-1 = 1 when nnodes > 1 and local_ckpt_every is on, else 0; fewer than nnodes).
        nnodes: Replicas: PyTorchJob Worker pods (kubernetes) or ft_launcher processes (local).
        nproc_per_node: Worker processes per replica (one per GPU with gpus=true).
        max_restarts: In-job restarts ft_launcher may do before the job fails.
        inprocess_restart: Recover soft faults (exceptions, stuck Python) inside the running processes.
        max_bug_retries: Retries of a suspected bug: the same exception, from the same line of project or user code,
            at the same step (or a loss that turns NaN or Inf). One more occurrence ends the job with a fatal event
            (reason bug) that no restart retries; infrastructure faults keep the restart budgets (docs/recovery.md).
        fault: Fault schedule KIND@STEP[:RANK],..., at most one per step ("" none). KIND: {FAULT_KINDS}.
        model: The model: a built-in size (tiny, small, base, large, 1b), hf:PATH (a Hugging Face causal LM: a directory
            on the shared volume, an s3:// prefix or a hub id, with config.json and optionally safetensors weights to
            continue from) or py:package.module:factory (a module of your own in the image). The check step checks it
            before anything starts; rfsdp pipeline manifest checks only an hf: model at a local path (an s3:// one
            needs the bucket), and the train step checks its vocabulary against the data's before any worker starts.
        seq_len: Tokens per sequence (0 = the model's default: a built-in size's own, an hf: model's
            max_position_embeddings up to 1024).
        grad_accum_steps: Micro-batches per optimizer step: gradients are accumulated and synchronized once.
        activation_checkpointing: Recompute each FSDP unit's activations in backward instead of keeping them (less
            memory, about a third more compute).
        seed: Seed of initialization and data order.
        hang_timeout: Seconds without a heartbeat before a rank counts as hung (the other timeouts derive from it).
        grace_period: Seconds a preempted or evicted worker has to checkpoint its step and exit (the PyTorchJob's
            terminationGracePeriodSeconds is this plus 15).
        system_metrics_every: Seconds between samples of each node's CPU, memory, /dev/shm, network and GPU use, logged
            to MLflow as system/node_N/... (0 = off).
        backend: Where training runs: kubernetes (a PyTorchJob) or local (processes inside the train step's pod).
        training_run: Name of the training run ("" = derived from this KFP run, so every run starts afresh). A DNS-1035
            name names the PyTorchJob and the run's folder on the shared volume: a rerun under it resumes the run.
        image: Container image of every step and worker (built from the project's Dockerfile).
        job_namespace: Namespace of the PyTorchJob ("" = the namespace the pipeline runs in).
        gpus: Request one NVIDIA GPU per worker process (kubernetes).
        cpu: CPU request and limit per worker pod (kubernetes), e.g. 4 or 500m.
        memory: Memory request and limit per worker pod (kubernetes), e.g. 16Gi.
        source: Training corpus: a text, .jsonl or .parquet file, a directory or s3:// prefix of them, or
            builtin:python-docs.
        tokenizer: Hugging Face tokenizer (a directory or tokenizer.json, local or s3://) the corpus is tokenized with
            ("" = byte-level UTF-8). The model's vocabulary must cover it; it is exported with the model.
        text_field: The JSON lines field or Parquet column holding a record's text.
        pvc_name: ReadWriteMany PersistentVolumeClaim mounted at /mnt/rfsdp in every step and worker: data, run dirs and
            their records.
        checkpoint_uri: Remote location (s3://bucket/prefix) durable checkpoints are mirrored to ("" none).
        tracking_uri: MLflow tracking server, e.g. http://mlflow.NS:5000 ("" = the MLFLOW_TRACKING_URI key of the
            rfsdp-mlflow secret; a kubernetes run with neither is refused).
        experiment: MLflow experiment name.
        export_uri: Where the validated checkpoint is exported as a model directory once validation passes: an empty
            s3://bucket/prefix or an absolute path, e.g. on the shared volume (Hugging Face safetensors + config +
            tokenizer for an hf: model; docs/models.md). It is logged to MLflow as the run's model (under model/).
            "" = no export.
        registered_model: Register the exported model in the MLflow model registry under this name (a new version
            per export; needs export_uri; "" = not registered).
    """
    # Every parameter, once: the check step checks them and hands the later steps one run spec.
    run_parameters = dict(locals())
    kfp_run = {"pipeline_job": dsl.PIPELINE_JOB_NAME_PLACEHOLDER, "pipeline_job_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER}
    logged = log_to_mlflow(
        training_run=training_run,
        backend=backend,
        tracking_uri=tracking_uri,
        experiment=experiment,
        image=image,
        **kfp_run,
    ).set_display_name("log to MLflow")
    with dsl.ExitHandler(logged, name="run"):
        checked = check_run(**run_parameters, **kfp_run).set_display_name("check parameters")
        name = checked.outputs["Output"]
        job_id = kfp_run["pipeline_job_id"]
        data = prepare_data(
            source=source, tokenizer=tokenizer, text_field=text_field, training_run=name, pipeline_job_id=job_id
        ).set_display_name("prepare data")
        trained = train(data=data.outputs["data"], run_spec=checked.outputs["run_spec"]).set_display_name("train")
        checked_ckpt = validate_checkpoint(
            run=trained.outputs["run"], data=data.outputs["data"], training_run=name, pipeline_job_id=job_id
        ).set_display_name("validate checkpoint")
        # It loads the whole state in one process and starts the run's world size (+1) of CPU ranks
        # to reshard and replay it: a worker pod's resources, not a default step's.
        checked_ckpt.set_cpu_request(cpu).set_memory_request(memory)
        # Only a checkpoint the validation passed is exported (it reads the whole model in one process).
        exported = (
            export_model(
                run=trained.outputs["run"],
                data=data.outputs["data"],
                training_run=name,
                pipeline_job_id=job_id,
                export_uri=export_uri,
                registered_model=registered_model,
            )
            .set_display_name("export model")
            .after(checked_ckpt)
        )
        exported.set_cpu_request(cpu).set_memory_request(memory)
    tasks = (checked, data, trained, checked_ckpt, exported, logged)
    # The run resumes under its name and the record is rewritten each time: nothing may come from a cache.
    for task in tasks:
        task.set_caching_options(False)
        task.set_container_image(image)
        for secret, keys in CREDENTIAL_SECRETS.items():
            kubernetes.use_secret_as_env(
                task, secret_name=secret, secret_key_to_env={k: k for k in keys}, optional=True
            )
        # The run's data, run dir and record live on this volume (the workers mount it too).
        kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=WORKSPACE_MOUNT)
    return Outputs(
        metrics=logged.outputs["metrics"],
        report=logged.outputs["report"],
        mlflow_run_id=logged.outputs["mlflow_run_id"],
        mlflow_url=logged.outputs["mlflow_url"],
        training_run=logged.outputs["training_run"],
    )


# ------------------------------------------------------------------ parameters
class Parameter(NamedTuple):
    """A pipeline parameter as the Kubeflow UI shows it."""

    name: str
    type: str
    default: Any
    description: str


def parameters() -> list[Parameter]:
    """Every pipeline parameter with its KFP type, default and description (from the docstring)."""
    inputs = resilient_fsdp_training.component_spec.inputs
    return [
        Parameter(name, spec.type, spec.default, " ".join((spec.description or "").split()))
        for name, spec in inputs.items()
    ]


def parameter_defaults() -> dict[str, Any]:
    """Every pipeline parameter with its default (the pipeline function's signature)."""
    signature = inspect.signature(resilient_fsdp_training.pipeline_func)
    return {name: p.default for name, p in signature.parameters.items()}


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _typed(name: str, value: Any, where: str) -> Any:
    """``value`` as parameter ``name``'s type: text (``--set``) is parsed, a YAML value must fit.

    Raises:
        ValueError: unknown parameter or a value of the wrong type, naming ``where`` and the parameter.
    """
    defaults = parameter_defaults()
    if name not in defaults:
        raise ValueError(f"{where}: unknown parameter {name!r} (known: {', '.join(defaults)})")
    kind = type(defaults[name])
    if kind is str and value is None:  # `checkpoint_uri:` with nothing after it
        return ""
    if isinstance(value, str) and kind is bool and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, str) and kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # `cpu: 4` in YAML is the text "4"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is kind:
        return value
    raise ValueError(f"{where} {name}: {value!r} is not a valid {kind.__name__}")


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings (``--set``) -> typed parameter values; raises ValueError naming a bad one."""
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set: {item!r} is not NAME=VALUE")
        values[name.strip()] = _typed(name.strip(), raw, "--set")
    return values


def read_parameters_file(path: Path) -> dict[str, Any]:
    """A YAML mapping of parameter names to values (``--params``; ``rfsdp pipeline params --yaml``
    writes one) -> typed parameter values.

    Raises:
        ValueError: an unreadable file, not a mapping, an unknown key or a value of the wrong type,
            naming the file and the key.
    """
    import yaml

    where = f"--params {path}"
    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{where}: cannot read it ({e})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{where}: not a mapping of parameter names to values")
    return {str(name): _typed(str(name), value, where) for name, value in values.items()}


def parameters_yaml() -> str:
    """A parameters file with every parameter at its default, each under its description."""
    import textwrap

    import yaml

    lines = [
        f"# Parameters of the {PIPELINE_NAME} pipeline: rfsdp pipeline run-local|submit|manifest --params FILE.yaml"
    ]
    for p in parameters():
        lines += ["", *textwrap.wrap(p.description, 100, initial_indent="# ", subsequent_indent="# ")]
        lines.append(yaml.safe_dump({p.name: p.default}, default_flow_style=False).rstrip())
    return "\n".join(lines) + "\n"


def parameters_text() -> str:
    """The parameters for a terminal, as ``--help`` lists options: name, type and default, then the description."""
    import textwrap

    out = []
    for p in parameters():
        out.append(f"{p.name} ({p.type}, default {p.default!r})")
        out += textwrap.wrap(p.description, 96, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out) + "\n"


def check_parameters(
    overrides: Mapping[str, Any],
    *,
    tracking_uri_env: str = "",
    steps_run_here: bool = False,
    model_check: str = "local",
) -> dict[str, Any]:
    """All parameters (defaults + ``overrides``) after the checks the first step makes before
    anything starts: training config, launch spec, fault schedule, run name, image, resources,
    checkpoint and tracking URIs.

    Args:
        overrides: pipeline parameters that differ from the defaults.
        tracking_uri_env: the ``MLFLOW_TRACKING_URI`` the steps will see ("" for a cluster,
            whose secret cannot be seen from here).
        steps_run_here: the steps run on this machine (``run_local``), not in a cluster's pods.
        model_check: how far ``model`` is checked here (``components.runs.check_parameters``):
            ``all`` (the steps run here), ``local`` an ``hf:`` model at a local path, ``none`` not at
            all (a submitter's paths are the cluster's).

    Raises:
        ParameterError: naming the bad parameter.
    """
    defaults = parameter_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} (known: {', '.join(defaults)})")
    params = {**defaults, **overrides}
    name = params["training_run"] or PREVIEW_RUN
    check_run_parameters(
        params, name, tracking_uri_env=tracking_uri_env, steps_run_here=steps_run_here, model_check=model_check
    )
    return params


def pytorchjob_manifest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The PyTorchJob the train step creates with ``backend=kubernetes`` and these parameters
    (named ``PREVIEW_RUN`` unless ``training_run`` is set: a KFP run derives its own name).
    """
    from trainer.launch.k8s import build_pytorchjob, cluster_options, shared_paths, to_manifest
    from trainer.launch.local import job_from_parameters

    # Only the job is shown here: where the run will be logged does not change it.
    params = check_parameters({"tracking_uri": "http://mlflow.preview", **overrides})
    params["training_run"] = params["training_run"] or PREVIEW_RUN
    data, run_dir = shared_paths(params["training_run"])
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    return to_manifest(build_pytorchjob(cfg, spec, cluster_options(params)))
