"""MLflow tracking: one MLflow run per run directory, built from its ``events.jsonl``.

This is the only module that talks to MLflow. The summary figures come from
:func:`trainer.events.summarize` and the table builders here are pure functions;
:mod:`trainer.results.compare` reuses both on events it downloads back from MLflow, so the logged
summary metrics and the comparison notebook can never disagree.

Where runs go (first match wins): the ``tracking_uri`` argument, ``MLFLOW_TRACKING_URI``, else a
local store in the project: ``sqlite:///<project>/work/mlflow/mlflow.db`` with artifacts in
``<project>/work/mlflow/artifacts/`` (``<project>`` is the nearest directory at or above the
working directory that holds a ``pyproject.toml``, else the working directory).

A tracking URI may carry credentials (``https://user:token@mlflow``, ``?token=...``): MLflow's
client sends them, but nothing here shows them. Every message, URL, tag and report that names the
URI goes through :func:`redact_uri` or :func:`redact`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

from trainer.errors import ParameterError
from trainer.events import (
    EVENTS_FILE,
    Checkpoint,
    CheckpointFailed,
    Event,
    EventTail,
    FaultFired,
    Restart,
    RunStart,
    Step,
    SystemSample,
    first_run_start_line,
    read_events,
    restarts_with_faults,
    select,
    session_finished,
    summarize,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

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
_STORE_SCHEMES = ("http", "https", "sqlite", "file", "databricks", "postgresql", "mysql", "mssql")
# Config fields that describe one invocation rather than the run (a resumed run may differ).
_SESSION_FIELDS = ("stop_at_step",)
_MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_TIER_PREFIX = {"durable": "", "local": "local_"}  # ckpt_* stays the durable tier's (as summarize's figures)


class TrackingError(RuntimeError):
    """The tracking store could not be reached or refused the run; nothing in the run dir changed."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a pipeline run failed: the step that failed and its reason."""

    step: str
    reason: str


# --------------------------------------------------------------------------- pure: events -> figures


def restart_table(events: list[Event]) -> dict[str, list]:
    """One row per ``restart`` event, with the ``fault`` that caused it (if one was injected).

    Returns:
        Column name -> values (the shape ``MlflowClient.log_table`` takes).
    """
    pairs = restarts_with_faults(events)
    return {
        "time": [r.time for r, _ in pairs],
        "layer": [r.layer for r, _ in pairs],
        "attempt": [r.attempt for r, _ in pairs],
        "resumed_from_step": [r.resumed_from_step for r, _ in pairs],
        "lost_steps": [r.lost_steps for r, _ in pairs],
        "recovery_s": [r.recovery_s for r, _ in pairs],
        "fault_kind": [f.kind if f else None for _, f in pairs],
        "fault_step": [f.step if f else None for _, f in pairs],
        "fault_rank": [f.rank if f else None for _, f in pairs],
        "source": [r.source for r, _ in pairs],
    }


def checkpoint_table(events: list[Event]) -> dict[str, list]:
    """One row per published checkpoint and complete local snapshot (``checkpoint`` event, its
    ``tier``), with its write throughput.
    """
    ckpts = select(events, Checkpoint)
    return {
        "time": [c.time for c in ckpts],
        "step": [c.step for c in ckpts],
        "tier": [c.tier for c in ckpts],
        "mode": [c.mode for c in ckpts],
        "blocking_s": [c.blocking_s for c in ckpts],
        "total_s": [c.total_s for c in ckpts],
        "bytes": [c.bytes for c in ckpts],
        "write_mb_s": [c.write_mb_s for c in ckpts],
    }


def metric_points(
    events: list[Event], *, totals: bool = True, done_before: int = 0, origin: float | None = None
) -> list[tuple[str, float, int, int]]:
    """Every metric point of a run as ``(key, value, timestamp_ms, step)``, deterministic.

    Timestamps are the events' own times, so logging the same events twice yields identical
    points (which MLflow's SQL stores drop as duplicates). Per-step points use the training step
    (a re-executed step appears twice, at its two times); checkpoint points the checkpointed
    step (a local snapshot's keys start with ``local_``); restart points the restart attempt
    (``restart_lost_steps_<tier>``: the steps lost by each recovery from that tier); fault
    points their order; summary points step 0 at the time of the last event. A step done
    again after a recovery also gets a ``redone_step`` point (1.0) at its step. Without
    ``totals`` (a part of the log, while the run goes on) the points that need the whole log are
    left out: fault points and the summary; ``done_before`` is then the highest step of the part
    before, and ``origin`` the time of the run's first event. System samples are
    ``system/node_<N>/<name>`` points (MLflow's layout for several nodes) at the whole seconds
    since ``origin`` (default: the first event's time).
    """
    points: list[tuple[str, float, int, int]] = []
    origin = events[0].time if origin is None and events else origin
    n_faults = 0
    for e in events:
        ts = int(e.time * 1000)
        if isinstance(e, Step):
            points += [("loss", e.loss, ts, e.step), ("step_time_s", e.step_time_s, ts, e.step)]
            if e.step <= done_before:
                points.append(("redone_step", 1.0, ts, e.step))
            done_before = max(done_before, e.step)
            if e.step_time_s > 0 and e.tokens:
                points.append(("tokens_per_s", e.tokens / e.step_time_s, ts, e.step))
        elif isinstance(e, Checkpoint):
            for key, value in (("blocking_s", e.blocking_s), ("total_s", e.total_s), ("bytes", e.bytes), ("write_mb_s", e.write_mb_s)):
                points.append((f"{_TIER_PREFIX[e.tier]}ckpt_{key}", value, ts, e.step))
        elif isinstance(e, CheckpointFailed):
            points.append((f"{_TIER_PREFIX[e.tier]}ckpt_failed_step", e.step, ts, e.step))
        elif isinstance(e, FaultFired) and totals:
            n_faults += 1
            points.append(("fault_step", e.step, ts, n_faults))
        elif isinstance(e, Restart):
            for key, value in (("recovery_s", e.recovery_s), ("lost_steps", e.lost_steps), ("resumed_from_step", e.resumed_from_step)):
                points.append((f"restart_{key}", value, ts, e.attempt))
            points.append((f"restart_{e.layer}_recovery_s", e.recovery_s, ts, e.attempt))
            points.append((f"restart_lost_steps_{e.source}", e.lost_steps, ts, e.attempt))  # by the tier resumed from
        elif isinstance(e, SystemSample):
            points += [(f"system/node_{e.node}/{k}", v, ts, int(e.time - origin)) for k, v in e.metrics.items()]
    if events and totals:
        end = int(events[-1].time * 1000)
        points += [(k, float(v), end, 0) for k, v in summarize(events).items() if v is not None]
    return points


def run_params(events: list[Event], tags: dict[str, str] | None = None) -> dict[str, str]:
    """MLflow params: the first session's training config, fault schedule, backend, world size.

    Args:
        events: the run's events (the first ``run_start`` carries the config).
        tags: the pass-through tags; ``backend`` there names the job backend (the pipeline's
            ``local`` or ``kubernetes``); ``rfsdp train`` alone runs locally.
    """
    start = select(events, RunStart)[0]
    config = {k: v for k, v in start.config.items() if k not in _SESSION_FIELDS}
    return {
        **{k: str(v) for k, v in config.items()},
        "fault": config.get("fault") or "none",
        "world_size": str(start.world_size),
        "backend": (tags or {}).get("backend", "local"),
    }


# --------------------------------------------------------------------------- MLflow


def project_dir(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding a ``pyproject.toml``."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / "pyproject.toml").is_file()), here)


def source_tags() -> dict[str, str]:
    """What code logged a run: this package's version and the git commit it was built from
    (``RFSDP_GIT_COMMIT`` in an image, else the checkout the package runs from, if any).
    """
    import subprocess
    from importlib.metadata import version

    commit = os.environ.get(GIT_COMMIT_ENV, "")
    source = Path(__file__).resolve().parents[2]  # the checkout of an editable install, else site-packages
    if not commit and (source / ".git").exists():  # not a repository that merely holds a venv
        try:
            commit = subprocess.run(
                ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            commit = ""
    return {VERSION_TAG: version("resilient-fsdp"), **({GIT_COMMIT_TAG: commit} if commit else {})}


_SECRET_QUERY_KEY = re.compile(r"token|secret|passw|pwd|key|auth|credential|signature|sig$|session", re.IGNORECASE)
REDACTED = "***"


def redact_uri(uri: str) -> str:
    """``uri`` fit to show: its user info (``user:password@``) dropped and the value of every
    secret-looking query parameter (``token``, ``password``, ``api_key``, ``X-Amz-Signature``...)
    replaced by ``***``. A URI with neither is returned unchanged.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable tracking URI>"
    netloc = parts.netloc.rpartition("@")[2]
    pairs = [pair.partition("=") for pair in parts.query.split("&")] if parts.query else []
    query = "&".join(f"{k}={REDACTED}" if v and _SECRET_QUERY_KEY.search(unquote(k)) else f"{k}{eq}{v}" for k, eq, v in pairs)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _uri_secrets(uri: str) -> dict[str, str]:
    """What to replace in a message that may quote ``uri``'s secrets: ``userinfo@`` by nothing,
    ``key=value`` of a secret query parameter by ``key=***``, and (when long enough not to hit
    ordinary words) the password and secret values alone by ``***``; raw and percent-decoded.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return {uri: "<unparseable tracking URI>"}
    found: dict[str, str] = {}
    userinfo = parts.netloc.rpartition("@")[0]
    alone = []
    if userinfo:
        found[f"{userinfo}@"] = ""
        alone.append(userinfo.partition(":")[2] or userinfo)
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if value and _SECRET_QUERY_KEY.search(unquote(key)):
            found[pair] = f"{key}={REDACTED}"
            alone.append(value)
    for secret in alone:
        if len(secret) >= 6:
            found[secret] = REDACTED
    for old, new in list(found.items()):
        found.setdefault(unquote(old), new)
    return found


def redact(text: str, uri: str) -> str:
    """``text`` (an error message, a log line) with ``uri`` and its secrets redacted wherever they
    appear (MLflow's and requests' errors repeat the URL they called, credentials included).
    """
    text = text.replace(uri, redact_uri(uri))
    for old, new in sorted(_uri_secrets(uri).items(), key=lambda item: len(item[0]), reverse=True):
        text = text.replace(old, new)
    return text


def default_tracking_uri() -> str:
    """The local store used when nothing is configured: sqlite under ``<project>/work/mlflow``."""
    return f"sqlite:///{project_dir() / 'work' / 'mlflow' / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """``tracking_uri`` if given, else ``MLFLOW_TRACKING_URI``, else :func:`default_tracking_uri`."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def check_tracking_uri(tracking_uri: str) -> str:
    """``tracking_uri`` if MLflow can use it: a known scheme, a host for a server, a path for sqlite.

    Raises:
        ParameterError: naming ``tracking_uri``.
    """
    shown = redact_uri(tracking_uri)
    try:
        parsed = urlparse(tracking_uri)
        hostname = parsed.hostname
    except ValueError as e:  # a bad port, a bad IPv6 literal
        raise ParameterError("tracking_uri", f"{shown!r} is not a URI ({redact(str(e), tracking_uri)})") from None
    scheme = parsed.scheme.split("+")[0]  # postgresql+psycopg2://...
    if scheme not in _STORE_SCHEMES:
        raise ParameterError("tracking_uri", f"{shown!r} is not an MLflow tracking URI (scheme one of {', '.join(_STORE_SCHEMES)})")
    if scheme in ("http", "https") and not hostname:
        raise ParameterError("tracking_uri", f"{shown!r} names no host")
    if scheme == "sqlite" and not tracking_uri.startswith("sqlite:///"):
        raise ParameterError("tracking_uri", f"{shown!r} is not sqlite:///PATH")
    return tracking_uri


def is_local_store(tracking_uri: str) -> bool:
    """Whether the store is a file on the machine that logs (sqlite or a file store)."""
    return urlparse(tracking_uri).scheme in ("sqlite", "file")


def run_url(tracking_uri: str, run_id: str) -> str:
    """The MLflow UI's page of a run: on the tracking server, or on ``mlflow ui`` (its default
    address) for a local store.
    """
    from mlflow import MlflowClient

    experiment_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    server = urlsplit(tracking_uri)
    # A page to show: no credentials, and no query (a token there would end up in a browser's history).
    shown = urlunsplit((server.scheme, server.netloc.rpartition("@")[2], server.path, "", ""))
    base = shown.rstrip("/") if server.scheme in ("http", "https") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: beside a sqlite database; a server decides its own."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme != "sqlite":
        return None
    db = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return (db.parent / "artifacts" / experiment).as_uri()


def wait_for_server(tracking_uri: str, *, retries: int = 5, backoff_s: float = 1.0) -> None:
    """For an HTTP tracking server: poll ``/health`` with exponential backoff until it answers.

    Local stores (sqlite, file) need no server and return at once.

    Raises:
        TrackingError: the server did not answer after ``retries`` attempts (names the URI).
    """
    server = urlsplit(tracking_uri)
    if server.scheme not in ("http", "https"):
        return
    # urllib takes no credentials in a URL: send them as basic auth, as MLflow's client does.
    userinfo, _, host = server.netloc.rpartition("@")
    request = urllib.request.Request(urlunsplit((server.scheme, host, server.path.rstrip("/") + "/health", "", "")))
    if userinfo:
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    t0, delay, error = time.monotonic(), backoff_s, ""
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
                error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as e:
            error = redact(str(getattr(e, "reason", e)), tracking_uri)
        if attempt < retries:
            time.sleep(delay)
            delay *= 2
    raise TrackingError(
        f"MLflow tracking server {redact_uri(tracking_uri)} did not answer after {retries} attempts"
        f" over {time.monotonic() - t0:.1f} s ({error})"
    )


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
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(tracking_uri or None)
    wait_for_server(uri)
    client = MlflowClient(tracking_uri=uri)
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
        return _log(run_dir, events_path, events, uri, experiment, key, hashes, tags or {}, validation, failure, run_name or run_dir.name)
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
        experiment_id = _experiment_id(client, uri, experiment)
        found = client.search_runs([experiment_id], filter_string=f"tags.`{ATTEMPT_TAG}` = '{attempt}'", max_results=1)
        run_id = found[0].info.run_id if found else client.create_run(experiment_id, run_name=run_name).info.run_id
        logged = found[0].data.params if found else {}
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
    return {FAILED_STEP_TAG: failure.step, FAILURE_REASON_TAG: failure.reason[-_TAG_MAX:]}  # the end of a reason says the most


def _client(uri: str) -> MlflowClient:
    """A client of ``uri``; a sqlite store's folder is created first."""
    from mlflow import MlflowClient

    if urlparse(uri).scheme == "sqlite":
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if redact_uri(uri) != uri:  # MLflow prints "View run ... at: <the URI>" on stdout, credentials included
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return MlflowClient(tracking_uri=uri)


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
    from mlflow.entities import Metric, Param, RunTag

    client = _client(uri)
    experiment_id = _experiment_id(client, uri, experiment)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=2)
    run_tags = {**source_tags(), **tags, RUN_KEY_TAG: key, "rfsdp.run_dir": str(run_dir.resolve())}
    if validation is not None and "valid" in validation:
        run_tags["rfsdp.valid"] = str(validation["valid"]).lower()
    if failure is not None:
        run_tags.update(_failure_tags(failure))
    status = "FAILED" if failure is not None or not session_finished(events) else "FINISHED"
    end_time = int(events[-1].time * 1000)
    if found:
        run = found[0]
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
        run_id = run.info.run_id
    else:
        run_id = client.create_run(experiment_id, start_time=int(events[0].time * 1000), run_name=run_name).info.run_id

    params = run_params(events, tags)
    # Params are immutable in MLflow: only the ones not logged yet (a re-log writes the same).
    logged = client.get_run(run_id).data.params if found else {}
    client.log_batch(
        run_id,
        params=[Param(k, v) for k, v in params.items() if k not in logged],
        tags=[RunTag(k, str(v)) for k, v in run_tags.items()],
    )
    metrics = [Metric(k, v, ts, step) for k, v, ts, step in metric_points(events)]
    for i in range(0, len(metrics), _MAX_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + _MAX_BATCH])
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
            raise ValueError(f"--experiment: {name!r} is deleted in {redact_uri(uri)}; restore it or choose another name")
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri, name))
    except MlflowException:  # created concurrently by another logger
        existing = client.get_experiment_by_name(name)
        if existing is None:
            raise
        return existing.experiment_id


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


class LiveLogger:
    """Logs a run to MLflow while it trains, from a background thread of the launching process:
    every ``interval_s``, the step, checkpoint and restart points of the events written since
    (MLflow steps are training steps; a redone step is a second point at its own time). The
    MLflow run is the one :func:`log_run` finds again by the run dir's identity, shown RUNNING
    until ``log_run`` completes it. It never blocks or fails the training: while the server is
    unreachable, the points wait for the next attempt (``error`` says why).

    Args:
        run_dir: the run being trained.
        tracking_uri: where to log (see :func:`resolve_tracking_uri`).
        experiment: the MLflow experiment.
        interval_s: seconds between loggings.
        run_name: the MLflow run's name if this creates it (default: the run dir's name), as
            :func:`log_run` would name it.
        tags: extra tags of a run this creates (the pipeline's KFP run, image, backend).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tracking_uri: str | None = None,
        experiment: str = DEFAULT_EXPERIMENT,
        interval_s: float = 5.0,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self.interval_s = interval_s
        self.run_name = run_name or self.run_dir.name
        self.tags = tags or {}
        self._origin: float | None = None  # the run's first event: system points' steps count from it
        self.run_id: str | None = None
        self.error: str | None = None
        self._tail = EventTail(self.run_dir)
        self._waiting: list[Event] = []
        self._done_before = 0  # the highest step logged so far: a step at or below it is redone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlflow-live", daemon=True)

    def start(self) -> LiveLogger:
        """Start following the run."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Log what is left (one last attempt, at most ``timeout_s``) and stop."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        from mlflow.exceptions import MlflowException
        from requests.exceptions import RequestException

        while True:
            stopping = self._stop.wait(self.interval_s)
            self._waiting += self._tail.new()
            try:
                self._flush()
                self.error = None
            except (MlflowException, RequestException, OSError, ValueError, TrackingError) as e:
                self.error = redact(f"{type(e).__name__}: {e}", self.uri)  # caught up at the next attempt
            if stopping:
                return

    def _flush(self) -> None:
        from mlflow.entities import Metric, RunTag

        if self._origin is None and self._waiting:
            self._origin = self._waiting[0].time
        points = metric_points(self._waiting, totals=False, done_before=self._done_before, origin=self._origin)
        if not points:
            self._waiting = []
            return
        wait_for_server(self.uri, retries=1)  # a server that is down fails fast, not after the client's own retries
        client = _client(self.uri)
        if self.run_id is None:
            events_path = self.run_dir / EVENTS_FILE
            key = run_key(events_path)  # ValueError until the run_start is written: tried again
            experiment_id = _experiment_id(client, self.uri, self.experiment)
            found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
            if found:
                self.run_id = found[0].info.run_id
            else:
                start = int(self._waiting[0].time * 1000)
                self.run_id = client.create_run(experiment_id, start_time=start, run_name=self.run_name).info.run_id
                run_tags = {**source_tags(), **self.tags, RUN_KEY_TAG: key, "rfsdp.run_dir": str(self.run_dir.resolve())}
                client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in run_tags.items()])
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in points]
        for i in range(0, len(metrics), _MAX_BATCH):
            client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_BATCH])
        self._done_before = max([self._done_before, *(e.step for e in self._waiting if isinstance(e, Step))])
        self._waiting = []
