"""What the pipeline's steps share (a helper module, not a component).

- The checks every run passes before anything starts, for the CLI (before compiling, submitting
  or running) and for the first step (which covers runs started from the Kubeflow UI).
- The run's record on the shared volume, ``WORKSPACE/<training run>/``: beside the data and the
  run dir, the step that failed and why, and the validation verdict, each tagged with the KFP run
  that wrote it. The exit handler cannot take the other steps' outputs (KFP runs it whatever
  happened), so it finds the run by its name and logs it to MLflow, failed runs included.

Imports stay light here: compiling the pipeline must not load torch or the Kubernetes client.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from trainer.launch import workspace

FAILURE_FILE = "failure.json"
VALIDATION_FILE = "validation.json"
EXPORT_FILE = "export.json"
CHECK_STEP, PREPARE_STEP, TRAIN_STEP, VALIDATE_STEP = "check parameters", "prepare data", "train", "validate checkpoint"
EXPORT_STEP = "export model"
BEFORE_TRAINING = (CHECK_STEP, PREPARE_STEP)
"""Steps whose failure leaves a run dir of the same name (an earlier run's) as it was."""
PREVIEW_RUN = "rfsdp-preview"
"""Stands in for the run-unique name outside a KFP run (checks, ``rfsdp pipeline manifest``)."""


def check_parameters(
    params: Mapping[str, Any], name: str, *, tracking_uri_env: str, steps_run_here: bool, model_check: str = "local"
) -> None:
    """Refuse a run that cannot work, before anything starts.

    Args:
        params: every pipeline parameter.
        name: the training run's name (``trainer.launch.spec.resolve_run_name``).
        tracking_uri_env: the ``MLFLOW_TRACKING_URI`` the logging step will see ("" none: a
            submitter cannot see the cluster's secret).
        steps_run_here: the steps run on this machine (``kfp.local``), so a local MLflow store
            outlives them; in a cluster it would be a file in a pod.
        model_check: how far ``model`` is checked without the data (path, config, weights'
            shapes, factory): ``all`` (the check step, where the steps run: an ``s3://`` model's
            config is fetched, a ``py:`` factory imported), ``local`` (only an ``hf:`` model at a
            local path: ``rfsdp pipeline manifest`` and ``run-local``) or ``none`` (a submitter,
            whose paths are not the cluster's). Its vocabulary against the data's is the train step's.

    Raises:
        ParameterError: naming the pipeline parameter.
    """
    from trainer.errors import ParameterError, as_pipeline_parameters
    from trainer.launch import WORKSPACE_MOUNT
    from trainer.launch.k8s import build_pytorchjob, cluster_options, shared_paths
    from trainer.launch.local import BACKENDS, job_from_parameters
    from trainer.launch.spec import check_run_name
    from trainer.results.tracking import check_tracking_uri, is_local_store, redact_uri

    def refuse(param: str, problem: str) -> ParameterError:
        return ParameterError(param, problem, style="parameter")

    if params["backend"] not in BACKENDS:
        raise refuse("backend", f"{params['backend']!r} is not one of {', '.join(BACKENDS)}")
    if not params["experiment"].strip():
        raise refuse("experiment", "must not be empty")
    if params["checkpoint_uri"] and not params["checkpoint_uri"].startswith("s3://"):
        raise refuse(
            "checkpoint_uri",
            f"{params['checkpoint_uri']!r} is not s3://bucket/prefix (the pipeline mirrors to object storage)",
        )
    if not params["text_field"].strip():
        raise refuse("text_field", "must not be empty")
    export_uri, registered = params["export_uri"], params["registered_model"]
    if export_uri and not (export_uri.startswith("s3://") or export_uri.startswith("/")):
        raise refuse(
            "export_uri",
            f"{export_uri!r} is not s3://bucket/prefix nor an absolute path (e.g. {WORKSPACE_MOUNT}/models/NAME)",
        )
    if registered and not export_uri:
        raise refuse("registered_model", f"{registered!r} needs a model to register: set export_uri")
    if registered and (registered != registered.strip() or any(c in registered for c in "'\"\n\\/")):
        raise refuse(
            "registered_model", f"{registered!r} is not a model name (no quotes, slashes or surrounding spaces)"
        )
    with as_pipeline_parameters():
        check_run_name(name)
        data, run_dir = shared_paths(name)
        cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
        if params["tracking_uri"]:
            check_tracking_uri(params["tracking_uri"])
        uri = params["tracking_uri"] or tracking_uri_env
        if params["backend"] == "kubernetes":
            if not uri:
                raise refuse(
                    "tracking_uri",
                    "a kubernetes run needs an MLflow tracking server the cluster reaches: set tracking_uri, or the "
                    "MLFLOW_TRACKING_URI key of the rfsdp-mlflow secret (read by runs started in the Kubeflow UI)",
                )
            if (
                not steps_run_here
                and is_local_store(uri)
                and not uri.removeprefix("sqlite:///").removeprefix("file://").startswith(WORKSPACE_MOUNT + "/")
            ):
                shown = redact_uri(uri)
                raise refuse(
                    "tracking_uri",
                    f"{shown!r} is a file in the logging step's pod, lost with it: use a tracking server",
                )
        build_pytorchjob(
            cfg, spec, cluster_options({**params, "training_run": name})
        )  # image, resources: checked on every backend
        if _model_checked_here(params["model"], model_check):
            from trainer.models import check_model

            check_model(params["model"])


def write_run_spec(path: str | Path, params: Mapping[str, Any], name: str) -> None:
    """Write the checked run spec the check step hands on (a JSON file, the step's ``run_spec``
    artifact): every parameter it checked, the KFP run's job name and id, and ``training_run`` as
    the name it resolved. The later steps read their parameters from it (``read_run_spec``) instead
    of taking each one again. An artifact, not a string parameter: KFP logs a parameter on one line.
    """
    Path(path).write_text(json.dumps({**params, "training_run": name}, indent=1, sort_keys=True) + "\n")


def read_run_spec(path: str | Path) -> dict[str, Any]:
    """The parameters of a run spec ``write_run_spec`` wrote."""
    return json.loads(Path(path).read_text())


def _model_checked_here(model: str, model_check: str) -> bool:
    """Whether ``check_parameters`` checks ``model`` (see its ``model_check``)."""
    from trainer.models import MODEL_SIZES

    if model in MODEL_SIZES or model_check == "none":
        return False  # (a built-in size is checked by the config)
    if model_check == "all":
        return True
    path = model.removeprefix("hf:")
    if not model.startswith("hf:") or path.startswith("s3://"):
        return False  # a factory in the image, a model in a bucket: the check step's
    local = Path(path.removeprefix("file://")).expanduser()
    return local.exists() or path.startswith((".", "/", "~", "file://")) or path.count("/") != 1  # not a hub id


# ------------------------------------------------------------------ the run's record
def run_root(name: str) -> Path:
    """The training run's folder on the shared volume (data, run dir and record)."""
    return workspace() / name


def run_descriptor(name: str, run_dir: Path) -> dict:
    """What the train step hands on: where the run is (relative to the shared volume), and its
    latest checkpoint with that checkpoint's manifest.
    """
    from trainer.checkpoint import MANIFEST, latest_checkpoint

    latest = latest_checkpoint(run_dir)
    manifest = json.loads((latest / MANIFEST).read_text()) if latest else {}
    return {
        "training_run": name,
        "run": str(run_dir.relative_to(workspace())),
        "latest_checkpoint": latest.name if latest else "",
        "step": manifest.get("step", 0),
        "world_size": manifest.get("world_size", 0),
        "manifest": manifest,
    }


def check_training_completed(name: str, run_dir: Path) -> None:
    """Refuse a job that ended without finishing the run: the train step succeeds only on the
    latest session's ``run_end completed``, whatever the backend said. A preempted job's ranks
    all exit 0, and one succeeded worker completes an elastic PyTorchJob: without this check a
    partly trained run would be validated and logged as finished, and never resumed.

    Raises:
        RuntimeError: "preempted at step N; start a run with training_run=NAME to resume" (or
            how else the run ended), which the step records for the exit handler.
    """
    from trainer.events import RunEnd, RunStart, latest_end, read_events

    end = latest_end(read_events(run_dir, [RunStart, RunEnd]))
    if end is not None and end.status == "completed":
        return
    resume = f"start a run with training_run={name} to resume"
    if end is None:
        raise RuntimeError(f"training ended without a run_end event in {run_dir}; {resume}")
    at = f" at step {end.step}" if end.step is not None else ""
    raise RuntimeError(f"{end.status}{at}; {resume}")


def handed_on_run(descriptor: Path) -> tuple[Path, int]:
    """The run dir (on this step's view of the shared volume) and checkpoint step a descriptor names."""
    described = json.loads(Path(descriptor).read_text())
    return workspace() / described["run"], int(described["step"])


@contextlib.contextmanager
def recorded(name: str, kfp_run: str, step: str) -> Iterator[None]:
    """Inside, an exception (or a cancellation) is recorded as this step's failure, then raised."""
    try:
        yield
    except BaseException as e:
        reason = "cancelled" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        _write(name, FAILURE_FILE, {"kfp_run": kfp_run, "step": step, "reason": reason})
        raise


def record_validation(name: str, kfp_run: str, report: dict, markdown: str) -> None:
    """Keep the validation verdict (as JSON and as its Markdown table) for the exit handler."""
    _write(name, VALIDATION_FILE, {"kfp_run": kfp_run, "report": report, "markdown": markdown})


def record_export(name: str, kfp_run: str, export: dict, registered_model: str) -> None:
    """Keep what the export step wrote (``ExportResult.to_dict()``) for the exit handler, which
    logs it to MLflow as the run's model and registers it under ``registered_model`` ("" not).
    """
    _write(name, EXPORT_FILE, {"kfp_run": kfp_run, "export": export, "registered_model": registered_model})


def read_export(name: str, kfp_run: str) -> dict | None:
    """The export ``kfp_run`` recorded (None: it exported nothing)."""
    path = run_root(name) / EXPORT_FILE
    record = json.loads(path.read_text()) if path.is_file() else None
    return record if record and record["kfp_run"] == kfp_run else None


def log_exported_model(record: dict, run_id: str, tracking_uri: str) -> str:
    """Log the recorded export to MLflow run ``run_id`` as its model (an ``s3://`` one fetched
    first) and register it where the record says; returns a line that says what was done.
    """
    import tempfile

    from trainer.results.tracking import log_model, redact_uri
    from trainer.storage.store import is_remote, open_storage

    export, registered = record["export"], record["registered_model"]
    with tempfile.TemporaryDirectory(prefix="rfsdp-model-") as tmp:
        local = Path(export["out"])
        if is_remote(export["out"]):
            store, local = open_storage(export["out"]), Path(tmp) / "model"
            for key in export["files"]:
                store.download(key, local / key)
        shown = redact_uri(export["out"])
        version = log_model(
            run_id,
            local,
            tracking_uri=tracking_uri,
            step=export["step"],
            exported_to=shown,
            registered_model=registered,
        )
    where = f"; registered as {registered} version {version}" if version else ""
    return f"model of step {export['step']} exported to {export['out']}, logged to MLflow under model/{where}"


def read_record(name: str, kfp_run: str) -> tuple[dict | None, dict | None]:
    """The failure and the validation that ``kfp_run`` recorded (None where it recorded none)."""
    found = []
    for file in (FAILURE_FILE, VALIDATION_FILE):
        path = run_root(name) / file
        record = json.loads(path.read_text()) if path.is_file() else None
        found.append(
            record if record and record["kfp_run"] == kfp_run else None
        )  # an earlier KFP run's: not this one's
    return found[0], found[1]


def _write(name: str, file: str, record: dict) -> None:
    from trainer.fsutil import atomic_write_text

    root = run_root(name)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / file, json.dumps(record, indent=1))


def mlflow_run_name(training_run: str, pipeline_job: str) -> str:
    """What the MLflow run is called: the training run and the KFP run that started it (a derived
    training run's name is a digest; the KFP run's is the one a person knows from the UI).
    """
    return f"{training_run} @ {pipeline_job}" if pipeline_job else training_run


def mlflow_run_tags(
    training_run: str, *, backend: str, pipeline_job: str, pipeline_job_id: str, image: str
) -> dict[str, str]:
    """The tags a pipeline run puts on its MLflow run (while it trains and when it is logged)."""
    return {
        "training_run": training_run,
        "backend": backend,
        "kfp_pipeline_job": pipeline_job,
        "kfp_run_id": pipeline_job_id,
        "image": image,
    }


def tracking_uri_of(tracking_uri: str) -> str:
    """The pipeline's tracking URI: the parameter, else ``MLFLOW_TRACKING_URI`` (the MLflow secret on a cluster);
    "" neither.
    """
    import os

    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


@contextlib.contextmanager
def live_tracking(
    run_dir: Path,
    *,
    tracking_uri: str,
    experiment: str,
    training_run: str,
    backend: str,
    pipeline_job: str,
    pipeline_job_id: str,
    image: str,
) -> Iterator[None]:
    """Inside, MLflow follows the run as it trains: the run the exit handler completes later,
    under the same name and tags. A tracking server that is down costs the training nothing.

    Args:
        run_dir: the run dir (on this step's view of the shared volume).
        tracking_uri: the pipeline parameter ("" = ``MLFLOW_TRACKING_URI``, else the local store).
        experiment: MLflow experiment.
        training_run: the training run's name.
        backend: where the train step runs the job.
        pipeline_job: the KFP run's job name.
        pipeline_job_id: the KFP run's id.
        image: the image the steps and workers run.
    """
    from trainer.results.tracking import LiveLogger

    live = LiveLogger(
        run_dir,
        tracking_uri=tracking_uri_of(tracking_uri) or None,
        experiment=experiment,
        run_name=mlflow_run_name(training_run, pipeline_job),
        tags=mlflow_run_tags(
            training_run, backend=backend, pipeline_job=pipeline_job, pipeline_job_id=pipeline_job_id, image=image
        ),
    )
    try:
        with live:
            yield
    finally:
        if live.error:
            print(f"MLflow did not follow the training ({live.error}); the exit handler logs the whole run")


class PipelineRunLog(NamedTuple):
    """What the exit handler logged and shows."""

    training_run: str
    mlflow_run_id: str
    mlflow_url: str
    headline: dict[str, float]
    markdown: str


def log_pipeline_run(
    *,
    state: str,
    error_message: str,
    training_run: str,
    backend: str,
    tracking_uri: str,
    experiment: str,
    pipeline_job: str,
    pipeline_job_id: str,
    image: str,
) -> PipelineRunLog:
    """Log a pipeline run to MLflow however it ended (the exit handler's work).

    A run whose training started is logged from its run dir (events, checkpoints, validation),
    FAILED with the failing step and reason when the pipeline failed. A run that failed before
    (or whose name was refused) becomes a FAILED MLflow run of its own, so an earlier run under
    the same name is left as it was.

    Args:
        state: the pipeline's final state (``PipelineTaskFinalStatus.state``).
        error_message: KFP's error message (used when no step recorded its failure).
        training_run: the pipeline parameter ("" = derived from the KFP run).
        backend: ``local`` or ``kubernetes``.
        tracking_uri: the pipeline parameter ("" = ``MLFLOW_TRACKING_URI``).
        experiment: MLflow experiment.
        pipeline_job: the KFP run's job name.
        pipeline_job_id: the KFP run's id.
        image: the image the steps and workers ran (a tag).

    Returns:
        The training run's name, the MLflow run's id and URL, the headline figures, and the run's
        Markdown report.

    Raises:
        ParameterError: a kubernetes run with no tracking URI (nothing is logged to a pod-local file).
        TrackingError: the tracking store failed.
    """
    from trainer.errors import ParameterError
    from trainer.events import EVENTS_FILE, read_events
    from trainer.launch.spec import resolve_run_name
    from trainer.results.summary import headline_metrics, run_report
    from trainer.results.tracking import Failure, log_failed_attempt, log_run, resolve_tracking_uri, run_url

    uri = tracking_uri_of(tracking_uri)
    if not uri and backend == "kubernetes":
        raise ParameterError(
            "tracking_uri",
            "no MLflow tracking URI (parameter or the rfsdp-mlflow secret): the run is not logged",
            style="parameter",
        )
    uri = resolve_tracking_uri(uri or None)
    try:
        # The check step's own rule: only a name it accepted leads to a run dir. A refused one
        # (``./victim``) may point at another run's folder, which is never read, logged or retagged.
        name = resolve_run_name(training_run, pipeline_job, pipeline_job_id)
    except ParameterError as e:  # refused by the check step, which could record nothing under it
        name, accepted = training_run, False
        failure, validation = {"step": CHECK_STEP, "reason": f"{type(e).__name__}: {e}"}, None
    else:
        accepted = True
        failure, validation = read_record(name, pipeline_job_id)
    if failure is None and state != "SUCCEEDED":  # a step that could not record (killed, or its pod never ran)
        failure = {"step": "unknown", "reason": error_message or f"the pipeline run ended {state}"}
    failed = Failure(failure["step"], failure["reason"]) if failure else None
    tags = mlflow_run_tags(
        name, backend=backend, pipeline_job=pipeline_job, pipeline_job_id=pipeline_job_id, image=image
    )
    run_name = mlflow_run_name(name, pipeline_job)
    run_dir = run_root(name) / "run"
    started = accepted and (run_dir / EVENTS_FILE).is_file() and not (failed and failed.step in BEFORE_TRAINING)
    events = read_events(run_dir) if started else []
    if started:
        report = validation["report"] if validation else None
        run_id = log_run(
            run_dir,
            tracking_uri=uri,
            experiment=experiment,
            tags=tags,
            validation=report,
            failure=failed,
            run_name=run_name,
        )
        exported = read_export(name, pipeline_job_id)
        if exported is not None:
            print(log_exported_model(exported, run_id, uri))
    else:
        run_id = log_failed_attempt(
            pipeline_job_id, failed, tracking_uri=uri, experiment=experiment, tags=tags, run_name=run_name
        )
    url = run_url(uri, run_id)
    headline = headline_metrics(events, validation["report"]["valid"] if validation else None)
    markdown = run_report(
        name,
        status=state,
        headline=headline,
        mlflow_url=url,
        failed_step=failed.step if failed else "",
        reason=failed.reason if failed else "",
        validation=validation["markdown"] if validation else "",
    )
    return PipelineRunLog(name, run_id, url, headline, markdown)
