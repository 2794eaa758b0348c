"""MLflow tracking: one MLflow run per run directory, built from its ``events.jsonl``.

This is the only package that talks to MLflow, one concern a module, each importing only those
listed after it:

- :mod:`~trainer.results.tracking.live`: logging a run while it trains (:class:`LiveLogger`);
- :mod:`~trainer.results.tracking.runs`: logging a finished or failed run, its model, and reading
  the logged runs back;
- :mod:`~trainer.results.tracking.uri`: where runs go, the URI's credentials redacted, reaching
  the server;
- :mod:`~trainer.results.tracking.metrics`: the pure transforms of events into tables, metric
  points and params (no MLflow).

The names below are the package's interface; importers use them from here.
"""

from __future__ import annotations

from trainer.results.tracking.live import LiveLogger
from trainer.results.tracking.metrics import checkpoint_table, metric_points, restart_table, run_params
from trainer.results.tracking.runs import (
    ATTEMPT_TAG,
    CHECKPOINTS_TABLE,
    DEFAULT_EXPERIMENT,
    EVENTS_HASH_TAG,
    FAILED_STEP_TAG,
    FAILURE_REASON_TAG,
    GIT_COMMIT_ENV,
    GIT_COMMIT_TAG,
    MODEL_ARTIFACTS,
    MODEL_STEP_TAG,
    MODEL_URI_TAG,
    RESTARTS_TABLE,
    RUN_KEY_TAG,
    VALIDATION_ARTIFACT,
    VALIDATION_HASH_TAG,
    VERSION_TAG,
    Failure,
    LoggedRun,
    log_failed_attempt,
    log_model,
    log_run,
    logged_runs,
    run_key,
    source_tags,
)
from trainer.results.tracking.uri import (
    REDACTED,
    TrackingError,
    artifact_location,
    check_tracking_uri,
    default_tracking_uri,
    is_local_store,
    project_dir,
    redact,
    redact_uri,
    resolve_tracking_uri,
    run_url,
    wait_for_server,
)

__all__ = [
    "ATTEMPT_TAG",
    "CHECKPOINTS_TABLE",
    "DEFAULT_EXPERIMENT",
    "EVENTS_HASH_TAG",
    "FAILED_STEP_TAG",
    "FAILURE_REASON_TAG",
    "GIT_COMMIT_ENV",
    "GIT_COMMIT_TAG",
    "MODEL_ARTIFACTS",
    "MODEL_STEP_TAG",
    "MODEL_URI_TAG",
    "REDACTED",
    "RESTARTS_TABLE",
    "RUN_KEY_TAG",
    "VALIDATION_ARTIFACT",
    "VALIDATION_HASH_TAG",
    "VERSION_TAG",
    "Failure",
    "LiveLogger",
    "LoggedRun",
    "TrackingError",
    "artifact_location",
    "check_tracking_uri",
    "checkpoint_table",
    "default_tracking_uri",
    "is_local_store",
    "log_failed_attempt",
    "log_model",
    "log_run",
    "logged_runs",
    "metric_points",
    "project_dir",
    "redact",
    "redact_uri",
    "resolve_tracking_uri",
    "restart_table",
    "run_key",
    "run_params",
    "run_url",
    "source_tags",
    "wait_for_server",
]
