"""Logging a finished or failed run to MLflow: one MLflow run per run directory, built from its
``events.jsonl`` (:func:`log_run`), or per pipeline run that failed before training wrote any
event (:func:`log_failed_attempt`); its exported model (:func:`log_model`); and reading the
logged runs back (:func:`logged_runs`). Each finds its MLflow run again by a tag
(:func:`find_or_create_run`), so repeating a call reuses the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.events import EVENTS_FILE, Event, first_run_start_line, read_events, session_finished
from trainer.results.tracking.metrics import checkpoint_table, metric_points, restart_table, run_params
from trainer.results.tracking.uri import (
    TrackingError,
    artifact_location,
    client_of,
    redact,
    redact_uri,
    resolve_tracking_uri,
    wait_for_server,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

DEFAULT_EXPERIMENT = "resilient-fsdp"
RUN_KEY_TAG = "rfsdp.run_key"
"""Tag holding the run directory's identity (a hash of its first ``run_start`` line)."""
EVENTS_HASH_TAG = "rfsdp.events_sha256"
"""Tag holding a hash of the events last logged completely: equal means nothing new to log."""
VALIDATION_HASH_TAG = "rfsdp.validation_sha256"
"""Tag holding a hash of the validation report last logged."""
RESTARTS_TABLE = "restarts.json"
CHECKPOINTS_TABLE = "checkpoints.json"
VALIDATION_ARTIFACT = "validation.json"
FAILED_STEP_TAG = "rfsdp.failed_step"
"""Tag naming the pipeline step that failed (absent once the run succeeds)."""
FAILURE_REASON_TAG = "rfsdp.failure_reason"
"""Tag holding why that step failed."""
ATTEMPT_TAG = "rfsdp.kfp_run"
"""Tag identifying a pipeline run that failed before training wrote any event."""
GIT_COMMIT_TAG = "mlflow.source.git.commit"
"""MLflow's own tag for the source revision (its UI shows it with the run)."""
VERSION_TAG = "rfsdp.version"
GIT_COMMIT_ENV = "RFSDP_GIT_COMMIT"
"""The revision an image was built from (the Dockerfile's ``GIT_COMMIT`` build argument)."""
_TAG_MAX = 5000  # MLflow's limit of a tag value (SQL stores)
_MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a pipeline run failed: the step that failed and its reason."""

    step: str
    reason: str


def source_tags() -> dict[str, str]:
    """What code logged a run: this package's version and the git commit it was built from
    (``RFSDP_GIT_COMMIT`` in an image, else the checkout the package runs from, if any).
    """
    import subprocess
    from importlib.metadata import version

    commit = os.environ.get(GIT_COMMIT_ENV, "")
    source = Path(__file__).resolve().parents[3]  # the checkout of an editable install, else site-packages
    if not commit and (source / ".git").exists():  # not a repository that merely holds a venv
        try:
            commit = subprocess.run(
                ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            commit = ""
    return {VERSION_TAG: version("resilient-fsdp"), **({GIT_COMMIT_TAG: commit} if commit else {})}


@dataclass(frozen=True, slots=True)
class LoggedRun:
    """A run :func:`log_run` logged, read back: its identity, params and events."""

    run_id: str
    name: str
    params: dict[str, str]
    events: list[Event]


def logged_runs(experiment: str = DEFAULT_EXPERIMENT, tracking_uri: str | None = None) -> list[LoggedRun]:
    """Every active run that :func:`log_run` logged into ``experiment``, oldest first, with the
    ``events.jsonl`` it logged (runs logged by other means are skipped).

    Raises:
        ValueError: no such experiment at that tracking URI.
    """
    uri = resolve_tracking_uri(tracking_uri or None)
    wait_for_server(uri)
    client = client_of(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None or found.lifecycle_stage == "deleted":
        raise ValueError(f"experiment: no MLflow experiment named {experiment!r} at {redact_uri(uri)}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"]):
            if RUN_KEY_TAG not in run.data.tags:
                continue
            dst = Path(tmp) / run.info.run_id
            dst.mkdir()
            client.download_artifacts(run.info.run_id, EVENTS_FILE, str(dst))
            runs.append(LoggedRun(run.info.run_id, run.info.run_name, dict(run.data.params), read_events(dst)))
    return runs


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_key(events_path: Path) -> str:
    """Identity of a run directory: a hash of its first ``run_start`` line (stable if moved)."""
    line = first_run_start_line(events_path)
    if line is not None:
        return hashlib.sha256(line).hexdigest()[:32]
    raise ValueError(f"--run-dir: {events_path} has no run_start event: nothing to log")


def log_run(
    run_dir: Path,
    *,
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    tags: dict[str, str] | None = None,
    validation: dict | None = None,
    failure: Failure | None = None,
    run_name: str | None = None,
    retries: int = 5,
    backoff_s: float = 1.0,
) -> str:
    """Log a run directory to MLflow as one run and return its run id (idempotent).

    The run is found again by the tag ``rfsdp.run_key`` (the identity of the run dir), so
    logging the same run dir twice reuses the run. If the events and validation report are
    unchanged since the last complete logging nothing is written; if the run went on (a
    resume), everything is logged again: each metric point carries its event's own timestamp,
    so points logged before are identical and the store drops them (no duplicates), new points
    are added, and the tables and artifacts are replaced.
    Params come from the first session's config. The events never leave the run dir, so after
    a failure the same call can simply be repeated.

    Args:
        run_dir: the run directory (``events.jsonl`` inside).
        tracking_uri: MLflow tracking URI (default: see the module docstring).
        experiment: MLflow experiment name (created when missing).
        tags: extra run tags, e.g. the KFP run id and URL; ``backend`` also becomes a param.
        validation: the ``rfsdp validate`` verdict, stored as ``validation.json``.
        failure: why the pipeline run failed: the run ends FAILED with the step and reason as
            tags. Without it the status follows the events, and the tags of an earlier failure
            are removed (the run was resumed to success).
        run_name: the MLflow run's name when it is created (default: the run dir's name).
        retries: attempts to reach an HTTP tracking server before giving up.
        backoff_s: first wait between attempts (doubles each time).

    Returns:
        The MLflow run id.

    Raises:
        ValueError: the run dir has no events to log.
        TrackingError: the tracking store is unreachable or failed (the message names the URI).
    """
    run_dir = Path(run_dir)
    events_path = run_dir / EVENTS_FILE
    if not events_path.is_file():
        raise ValueError(f"--run-dir: no {EVENTS_FILE} in {run_dir}")
    key = run_key(events_path)
    # Fingerprint before reading: lines appended in between are logged now and again next time
    # (harmless duplicates the store drops) instead of being skipped for good.
    hashes = {EVENTS_HASH_TAG: _sha256(events_path.read_bytes())}
    if validation is not None:  # without a report, the one logged before (if any) stays
        hashes[VALIDATION_HASH_TAG] = _sha256(json.dumps(validation, sort_keys=True).encode())
    events = read_events(run_dir)
    uri = resolve_tracking_uri(tracking_uri)
    again = f"The events stay unchanged in {events_path}: run `rfsdp log-mlflow --run-dir {run_dir}` again later."
    try:
        wait_for_server(uri, retries=retries, backoff_s=backoff_s)
    except TrackingError as e:
        raise TrackingError(f"{e}. {again}") from None

    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException

    try:
        return _log(
            run_dir,
            events_path,
            events,
            uri,
            experiment,
            key,
            hashes,
            tags or {},
            validation,
            failure,
            run_name or run_dir.name,
        )
    except (MlflowException, RequestException, OSError) as e:
        raise TrackingError(redact(f"logging {run_dir} to MLflow at {uri} failed: {e}. {again}", uri)) from None


def log_failed_attempt(
    attempt: str,
    failure: Failure,
    *,
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    tags: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    run_name: str,
    retries: int = 5,
) -> str:
    """Log a pipeline run that failed before training wrote any event (idempotent per ``attempt``).

    Args:
        attempt: identity of the pipeline run (the KFP run id); repeating it reuses the MLflow run.
        failure: the step that failed and why.
        tracking_uri: MLflow tracking URI (default: see the module docstring).
        experiment: MLflow experiment name (created when missing).
        tags: extra run tags.
        params: what the run was started with.
        run_name: the MLflow run's name.
        retries: attempts to reach an HTTP tracking server before giving up.

    Returns:
        The MLflow run id (status FAILED, the step and reason as tags).

    Raises:
        TrackingError: the tracking store is unreachable or failed.
    """
    uri = resolve_tracking_uri(tracking_uri)
    wait_for_server(uri, retries=retries)
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException

    try:
        client = _client(uri)
        run_id, found = find_or_create_run(client, uri, experiment, ATTEMPT_TAG, attempt, run_name=run_name)
        logged = found.data.params if found is not None else {}
        run_tags = {**source_tags(), **(tags or {}), ATTEMPT_TAG: attempt, **_failure_tags(failure)}
        client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in (params or {}).items() if k not in logged],
            tags=[RunTag(k, v) for k, v in run_tags.items()],
        )
        client.set_terminated(run_id, "FAILED")
        return run_id
    except (MlflowException, RequestException, OSError) as e:
        raise TrackingError(redact(f"logging the failed run {attempt} to MLflow at {uri} failed: {e}", uri)) from None


def _failure_tags(failure: Failure) -> dict[str, str]:
    return {
        FAILED_STEP_TAG: failure.step,
        FAILURE_REASON_TAG: failure.reason[-_TAG_MAX:],
    }  # the end of a reason says the most


def _client(uri: str) -> MlflowClient:
    """A client of ``uri`` (a new sqlite store is made first), credentials never printed."""
    if redact_uri(uri) != uri:  # MLflow prints "View run ... at: <the URI>" on stdout, credentials included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return client_of(uri)


def _log(
    run_dir: Path,
    events_path: Path,
    events: list[Event],
    uri: str,
    experiment: str,
    key: str,
    hashes: dict[str, str],
    tags: dict[str, str],
    validation: dict | None,
    failure: Failure | None,
    run_name: str,
) -> str:
    from mlflow.entities import Param, RunTag

    client = _client(uri)
    run_tags = {**source_tags(), **tags, RUN_KEY_TAG: key, "rfsdp.run_dir": str(run_dir.resolve())}
    if validation is not None and "valid" in validation:
        run_tags["rfsdp.valid"] = str(validation["valid"]).lower()
    if failure is not None:
        run_tags.update(_failure_tags(failure))
    status = "FAILED" if failure is not None or not session_finished(events) else "FINISHED"
    end_time = int(events[-1].time * 1000)
    start_time = int(events[0].time * 1000)
    run_id, run = find_or_create_run(
        client, uri, experiment, RUN_KEY_TAG, key, run_name=run_name, start_time=start_time
    )
    if run is not None:
        for stale in (FAILED_STEP_TAG, FAILURE_REASON_TAG):  # an earlier failure this run has got past
            if failure is None and stale in run.data.tags:
                client.delete_tag(run.info.run_id, stale)
        if all(run.data.tags.get(k) == v for k, v in hashes.items()):
            # Nothing new since the last complete logging; only tags that differ (e.g. a new KFP run) are set.
            changed = [RunTag(k, str(v)) for k, v in run_tags.items() if run.data.tags.get(k) != str(v)]
            if changed:
                client.log_batch(run.info.run_id, tags=changed)
            if run.info.status != status:
                client.set_terminated(run.info.run_id, status, end_time=end_time)
            return run.info.run_id

    params = run_params(events, tags)
    # Params are immutable in MLflow: only the ones not logged yet (a re-log writes the same).
    logged = client.get_run(run_id).data.params if run is not None else {}
    client.log_batch(
        run_id,
        params=[Param(k, v) for k, v in params.items() if k not in logged],
        tags=[RunTag(k, str(v)) for k, v in run_tags.items()],
    )
    log_points(client, run_id, metric_points(events))
    client.log_table(run_id, restart_table(events), RESTARTS_TABLE)
    client.log_table(run_id, checkpoint_table(events), CHECKPOINTS_TABLE)
    client.log_artifact(run_id, str(events_path))
    if validation is not None:
        client.log_dict(run_id, validation, VALIDATION_ARTIFACT)
    client.set_terminated(run_id, status, end_time=end_time)
    # Last: only a complete logging marks the run as up to date.
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in hashes.items()])
    return run_id


def _experiment_id(client: MlflowClient, uri: str, name: str) -> str:
    from mlflow.exceptions import MlflowException

    existing = client.get_experiment_by_name(name)
    if existing is not None:
        if existing.lifecycle_stage == "deleted":
            raise ValueError(
                f"--experiment: {name!r} is deleted in {redact_uri(uri)}; restore it or choose another name"
            )
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri, name))
    except MlflowException:  # created concurrently by another logger
        existing = client.get_experiment_by_name(name)
        if existing is None:
            raise
        return existing.experiment_id


PARENT_RUN_TAG = "mlflow.parentRunId"
"""MLflow's own tag of a nested run."""


def find_or_create_run(
    client: MlflowClient,
    uri: str,
    experiment: str,
    tag: str,
    value: str,
    *,
    run_name: str,
    start_time: int | None = None,
    tags: dict[str, str] | None = None,
) -> tuple[str, Run | None]:
    """The run of ``experiment`` (created when missing) tagged ``tag`` = ``value``, else a new one
    named ``run_name`` that starts at ``start_time`` (ms; default: now). The new run carries the tag
    (and ``tags``) from its creation, in the same request: an outage before the caller's next
    request cannot leave a run that the next attempt fails to find (and duplicates), or one without
    its tags. Where the environment names an MLflow run (:func:`_parent_run`), the run is searched
    and made under it, in its experiment.

    Returns:
        The run id, and the run found (``None`` when it was created).
    """
    parent = _parent_run(client)
    experiment_id = parent.info.experiment_id if parent is not None else _experiment_id(client, uri, experiment)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1)
    if found:
        return found[0].info.run_id, found[0]
    tags = {**(tags or {}), tag: value, **({PARENT_RUN_TAG: parent.info.run_id} if parent is not None else {})}
    return client.create_run(experiment_id, start_time=start_time, tags=tags, run_name=run_name).info.run_id, None


def _parent_run(client: MlflowClient) -> Run | None:
    """The run to log under when the environment names one (``MLFLOW_RUN_ID``, MLflow's active
    run; Kubeflow Pipelines' MLflow integration sets it to each task's nested run): that run's
    own parent when it has one, so that every step of a KFP run nests under the pipeline run's
    MLflow run, in its experiment. None (log beside, in ``experiment``) when no run is named or
    this store does not hold it.
    """
    from mlflow.exceptions import MlflowException

    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
        above = run.data.tags.get(PARENT_RUN_TAG)
        return client.get_run(above) if above else run
    except MlflowException:
        return None


def log_points(client: MlflowClient, run_id: str, points: list[tuple[str, float, int, int]]) -> None:
    """Log metric points (as :func:`metric_points` makes them) in batches MLflow accepts."""
    from mlflow.entities import Metric

    metrics = [Metric(k, v, ts, step) for k, v, ts, step in points]
    for i in range(0, len(metrics), _MAX_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + _MAX_BATCH])


MODEL_ARTIFACTS = "model"
"""Where a run's exported model goes among its MLflow artifacts."""
MODEL_STEP_TAG = "rfsdp.step"
"""Tag of a registered model version: the checkpoint step it was exported from."""
MODEL_URI_TAG = "rfsdp.model_uri"
"""Tag of a run (and a model version): where its model was exported (``rfsdp export --out``)."""


def log_model(
    run_id: str,
    model_dir: Path,
    *,
    tracking_uri: str | None = None,
    step: int,
    exported_to: str,
    registered_model: str = "",
) -> str:
    """Log an exported model directory (``rfsdp export``) as the run's model, its files under
    ``model/``, and with ``registered_model`` register it in the model registry (idempotent: a
    version of this run and step is found again, not made twice).

    Args:
        run_id: the MLflow run (as :func:`log_run` returned it).
        model_dir: the exported model, local.
        tracking_uri: MLflow tracking URI (default: see the module docstring).
        step: the checkpoint's step (a tag of the version).
        exported_to: where the export was written (a tag; credentials redacted).
        registered_model: the registered model's name ("" = not registered).

    Returns:
        The registered model version ("" when not registered).

    Raises:
        TrackingError: the tracking store failed.
    """
    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException

    uri = resolve_tracking_uri(tracking_uri)
    try:
        client = _client(uri)
        client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACTS)
        client.log_batch(run_id, tags=[RunTag(MODEL_URI_TAG, exported_to)])
        if not registered_model:
            return ""
        try:
            client.create_registered_model(registered_model)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        found = client.search_model_versions(f"name = '{registered_model}' and run_id = '{run_id}'")
        for version in found:
            if version.tags.get(MODEL_STEP_TAG) == str(step):
                return str(version.version)
        tags = {MODEL_STEP_TAG: str(step), MODEL_URI_TAG: exported_to}
        source = f"runs:/{run_id}/{MODEL_ARTIFACTS}"
        return str(client.create_model_version(registered_model, source=source, run_id=run_id, tags=tags).version)
    except (MlflowException, RequestException, OSError) as e:
        raise TrackingError(redact(f"logging the model of run {run_id} to MLflow at {uri} failed: {e}", uri)) from None
