"""MLflow tracking: one MLflow run per run directory, built from its ``events.jsonl``.

This is the only module that talks to MLflow. :func:`summarize` (events -> summary dict) and the
table builders are pure functions; :mod:`trainer.results.compare` reuses them on events it downloads back
from MLflow, so the logged summary metrics and the comparison notebook can never disagree.

Where runs go (first match wins): the ``tracking_uri`` argument, ``MLFLOW_TRACKING_URI``, else a
local store in the project: ``sqlite:///<project>/work/mlflow/mlflow.db`` with artifacts in
``<project>/work/mlflow/artifacts/`` (``<project>`` is the nearest directory at or above the
working directory that holds a ``pyproject.toml``, else the working directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from trainer.events import EVENTS_FILE, final_losses, read_events

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
RESTART_LAYERS = ("in_process", "in_job")
# Config fields that describe one invocation rather than the run (a resumed run may differ).
_SESSION_FIELDS = ("stop_at_step",)
_MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class TrackingError(RuntimeError):
    """The tracking store could not be reached or refused the run; nothing in the run dir changed."""


# --------------------------------------------------------------------------- pure: events -> figures


def sessions(events: list[dict]) -> list[list[dict]]:
    """Split events into sessions: each starts at a ``run_start`` (a fresh start or a resume).

    In-process and in-job restarts stay inside their session (they write no ``run_start``).
    Events before the first ``run_start`` (none are written by the trainer) are dropped.
    """
    out: list[list[dict]] = []
    for e in events:
        if e["event"] == "run_start":
            out.append([e])
        elif out:
            out[-1].append(e)
    return out


def final_steps(events: list[dict]) -> dict[int, dict]:
    """The final trajectory: each step's last ``step`` line (re-executed steps log again)."""
    return {e["step"]: e for e in events if e["event"] == "step"}


def summarize(events: list[dict]) -> dict[str, float | int | None]:
    """Summary figures of a run from its events (pure; ``None`` where a figure is undefined).

    Definitions:
        * ``wall_time_s``: summed over sessions, the time from a session's ``run_start`` to its
          last event (gaps between a stopped run and its resume are not wall time of the job).
        * ``useful_time_s``: the sum of ``step_time_s`` over the final trajectory, i.e. over each
          step's *last* ``step`` line; steps lost to a fault and re-executed count once.
        * ``goodput``: ``useful_time_s / wall_time_s``. It excludes startup, checkpoint stalls,
          lost work and recovery, and also the small per-step bookkeeping outside the timed
          step, so even a fault-free run stays a little below 1.
        * ``ckpt_overhead``: the summed ``blocking_s`` of published checkpoints / ``wall_time_s``
          (the share of wall time the training loop was stopped for checkpointing).
        * ``restarts_<layer>``, ``recovery_s_mean|p50|max`` (fault to first completed step
          after it) and ``lost_steps`` (summed) from the ``restart`` events.
        * ``ckpt_write_mb_s_mean``: mean over checkpoints of ``bytes / total_s`` in MB/s
          (from the start of a save until it was published).
        * ``tokens_per_s``: tokens of the final trajectory / ``useful_time_s``.
        * ``final_step`` / ``final_loss``: the last step of the final trajectory and its loss.

    Args:
        events: the run's events in file order (see ``trainer.events.read_events``).

    Returns:
        Figure name -> value.
    """
    steps = final_steps(events)
    losses = final_losses(events)
    restarts = [e for e in events if e["event"] == "restart"]
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    recovery = [e["recovery_s"] for e in restarts]
    blocking = [e["blocking_s"] for e in ckpts]
    wall = sum(s[-1]["time"] - s[0]["time"] for s in sessions(events))
    useful = sum(e["step_time_s"] for e in steps.values())
    tokens = sum(e.get("tokens", 0) for e in steps.values())
    last = max(steps, default=None)
    summary: dict[str, float | int | None] = {
        "steps_executed": sum(e["event"] == "step" for e in events),
        "final_step": last,
        "final_loss": losses[last] if last is not None else None,
        "faults": sum(e["event"] == "fault" for e in events),
        "restarts": len(restarts),
        **{f"restarts_{layer}": sum(e["layer"] == layer for e in restarts) for layer in RESTART_LAYERS},
        "recovery_s_mean": statistics.fmean(recovery) if recovery else None,
        "recovery_s_p50": statistics.median(recovery) if recovery else None,
        "recovery_s_max": max(recovery, default=None),
        "lost_steps": sum(e["lost_steps"] for e in restarts),
        "checkpoints": len(ckpts),
        "checkpoints_failed": sum(e["event"] == "checkpoint_failed" for e in events),
        "ckpt_blocking_s_total": sum(blocking),
        "ckpt_blocking_s_mean": statistics.fmean(blocking) if blocking else None,
        "ckpt_blocking_s_p50": statistics.median(blocking) if blocking else None,
        "ckpt_blocking_s_max": max(blocking, default=None),
        "ckpt_total_s_mean": statistics.fmean(e["total_s"] for e in ckpts) if ckpts else None,
        "ckpt_write_mb_s_mean": statistics.fmean(_write_mb_s(e) for e in ckpts) if ckpts else None,
        "wall_time_s": wall,
        "useful_time_s": useful,
        "goodput": useful / wall if wall > 0 else None,
        "ckpt_overhead": sum(blocking) / wall if wall > 0 else None,
        "tokens_per_s": tokens / useful if useful > 0 else None,
    }
    return summary


def _write_mb_s(ckpt: dict) -> float:
    return ckpt["bytes"] / ckpt["total_s"] / 1e6 if ckpt["total_s"] > 0 else 0.0


def restart_table(events: list[dict]) -> dict[str, list]:
    """One row per ``restart`` event, with the ``fault`` that caused it (if one was injected).

    Returns:
        Column name -> values (the shape ``MlflowClient.log_table`` takes).
    """
    restart_fields = ("time", "layer", "attempt", "resumed_from_step", "lost_steps", "recovery_s")
    cols: dict[str, list] = {k: [] for k in (*restart_fields, "fault_kind", "fault_step", "fault_rank")}
    fault = None
    for e in events:
        if e["event"] == "fault":
            fault = e
        elif e["event"] == "restart":
            for k in restart_fields:
                cols[k].append(e[k])
            cols["fault_kind"].append(fault["kind"] if fault else None)
            cols["fault_step"].append(fault["step"] if fault else None)
            cols["fault_rank"].append(fault["rank"] if fault else None)
            fault = None
    return cols


def checkpoint_table(events: list[dict]) -> dict[str, list]:
    """One row per published checkpoint (``checkpoint`` event), with its write throughput."""
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    return {
        "time": [e["time"] for e in ckpts],
        "step": [e["step"] for e in ckpts],
        "mode": [e["mode"] for e in ckpts],
        "blocking_s": [e["blocking_s"] for e in ckpts],
        "total_s": [e["total_s"] for e in ckpts],
        "bytes": [e["bytes"] for e in ckpts],
        "write_mb_s": [_write_mb_s(e) for e in ckpts],
    }


def metric_points(events: list[dict]) -> list[tuple[str, float, int, int]]:
    """Every metric point of a run as ``(key, value, timestamp_ms, step)``, deterministic.

    Timestamps are the events' own times, so logging the same events twice yields identical
    points (which MLflow's SQL stores drop as duplicates). Per-step points use the training step
    (a re-executed step appears twice, at its two times); checkpoint points the checkpointed
    step; restart points the restart attempt; fault points their order; summary points step 0 at
    the time of the last event.
    """
    points: list[tuple[str, float, int, int]] = []
    n_faults = 0
    for e in events:
        ts = int(e["time"] * 1000)
        kind = e["event"]
        if kind == "step":
            points += [("loss", e["loss"], ts, e["step"]), ("step_time_s", e["step_time_s"], ts, e["step"])]
            if e["step_time_s"] > 0 and "tokens" in e:
                points.append(("tokens_per_s", e["tokens"] / e["step_time_s"], ts, e["step"]))
        elif kind == "checkpoint":
            for key, value in (("blocking_s", e["blocking_s"]), ("total_s", e["total_s"]), ("bytes", e["bytes"])):
                points.append((f"ckpt_{key}", value, ts, e["step"]))
            points.append(("ckpt_write_mb_s", _write_mb_s(e), ts, e["step"]))
        elif kind == "checkpoint_failed":
            points.append(("ckpt_failed_step", e["step"], ts, e["step"]))
        elif kind == "fault":
            n_faults += 1
            points.append(("fault_step", e["step"], ts, n_faults))
        elif kind == "restart":
            for key in ("recovery_s", "lost_steps", "resumed_from_step"):
                points.append((f"restart_{key}", e[key], ts, e["attempt"]))
            points.append((f"restart_{e['layer']}_recovery_s", e["recovery_s"], ts, e["attempt"]))
    if events:
        end = int(events[-1]["time"] * 1000)
        points += [(k, float(v), end, 0) for k, v in summarize(events).items() if v is not None]
    return points


def run_params(events: list[dict], tags: dict[str, str] | None = None) -> dict[str, str]:
    """MLflow params: the first session's training config, fault schedule, backend, world size.

    Args:
        events: the run's events (the first ``run_start`` carries the config).
        tags: the pass-through tags; ``backend`` there names the job backend (the pipeline's
            ``local`` or ``kubernetes``); ``rfsdp train`` alone runs locally.
    """
    start = next(e for e in events if e["event"] == "run_start")
    config = {k: v for k, v in start["config"].items() if k not in _SESSION_FIELDS}
    return {
        **{k: str(v) for k, v in config.items()},
        "fault": config.get("fault") or "none",
        "world_size": str(start.get("world_size", config.get("world_size"))),
        "backend": (tags or {}).get("backend", "local"),
    }


# --------------------------------------------------------------------------- MLflow


def project_dir(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding a ``pyproject.toml``."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / "pyproject.toml").is_file()), here)


def default_tracking_uri() -> str:
    """The local store used when nothing is configured: sqlite under ``<project>/work/mlflow``."""
    return f"sqlite:///{project_dir() / 'work' / 'mlflow' / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """``tracking_uri`` if given, else ``MLFLOW_TRACKING_URI``, else :func:`default_tracking_uri`."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


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
    if urlparse(tracking_uri).scheme not in ("http", "https"):
        return
    url = tracking_uri.rstrip("/") + "/health"
    t0, delay, error = time.monotonic(), backoff_s, ""
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
                error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as e:
            error = str(getattr(e, "reason", e))
        if attempt < retries:
            time.sleep(delay)
            delay *= 2
    raise TrackingError(
        f"MLflow tracking server {tracking_uri} did not answer after {retries} attempts over {time.monotonic() - t0:.1f} s ({error})"
    )


@dataclass(frozen=True, slots=True)
class LoggedRun:
    """A run :func:`log_run` logged, read back: its identity, params and events."""

    run_id: str
    name: str
    params: dict[str, str]
    events: list[dict]


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
        raise ValueError(f"experiment: no MLflow experiment named {experiment!r} at {uri}")
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
    with open(events_path, "rb") as f:
        for line in f:
            if b'"run_start"' in line:
                try:
                    if json.loads(line)["event"] == "run_start":
                        return hashlib.sha256(line).hexdigest()[:32]
                except json.JSONDecodeError:
                    continue
    raise ValueError(f"--run-dir: {events_path} has no run_start event: nothing to log")


def log_run(
    run_dir: Path,
    *,
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    tags: dict[str, str] | None = None,
    validation: dict | None = None,
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
        return _log(run_dir, events_path, events, uri, experiment, key, hashes, tags or {}, validation)
    except (MlflowException, RequestException, OSError) as e:
        raise TrackingError(f"logging {run_dir} to MLflow at {uri} failed: {e}. {again}") from e


def _log(
    run_dir: Path,
    events_path: Path,
    events: list[dict],
    uri: str,
    experiment: str,
    key: str,
    hashes: dict[str, str],
    tags: dict[str, str],
    validation: dict | None,
) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    if urlparse(uri).scheme == "sqlite":
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = _experiment_id(client, uri, experiment)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=2)
    run_tags = {**tags, RUN_KEY_TAG: key, "rfsdp.run_dir": str(run_dir.resolve())}
    if validation is not None and "valid" in validation:
        run_tags["rfsdp.valid"] = str(validation["valid"]).lower()
    if found:
        run = found[0]
        if all(run.data.tags.get(k) == v for k, v in hashes.items()):
            # Nothing new since the last complete logging; only tags that differ (e.g. a new KFP run) are set.
            changed = [RunTag(k, str(v)) for k, v in run_tags.items() if run.data.tags.get(k) != str(v)]
            if changed:
                client.log_batch(run.info.run_id, tags=changed)
            return run.info.run_id
        run_id = run.info.run_id
    else:
        run_id = client.create_run(experiment_id, start_time=int(events[0]["time"] * 1000), run_name=run_dir.name).info.run_id

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
    ends = [e for e in sessions(events)[-1] if e["event"] == "run_end"]  # how the latest session ended
    finished = bool(ends) and ends[-1]["status"] in ("completed", "stopped")
    client.set_terminated(run_id, "FINISHED" if finished else "FAILED", end_time=int(events[-1]["time"] * 1000))
    # Last: only a complete logging marks the run as up to date.
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in hashes.items()])
    return run_id


def _experiment_id(client: MlflowClient, uri: str, name: str) -> str:
    from mlflow.exceptions import MlflowException

    existing = client.get_experiment_by_name(name)
    if existing is not None:
        if existing.lifecycle_stage == "deleted":
            raise ValueError(f"--experiment: {name!r} is deleted in {uri}; restore it or choose another name")
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri, name))
    except MlflowException:  # created concurrently by another logger
        existing = client.get_experiment_by_name(name)
        if existing is None:
            raise
        return existing.experiment_id
