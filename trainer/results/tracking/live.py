"""Logging a run to MLflow while it trains (:class:`LiveLogger`), into the MLflow run that
:func:`~trainer.results.tracking.runs.log_run` completes afterwards.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trainer.events import EVENTS_FILE, Event, EventTail, Step
from trainer.results.tracking.metrics import metric_points
from trainer.results.tracking.runs import (
    DEFAULT_EXPERIMENT,
    RUN_KEY_TAG,
    _client,
    find_or_create_run,
    log_points,
    run_key,
    source_tags,
)
from trainer.results.tracking.uri import (
    TrackingError,
    is_local_store,
    redact,
    resolve_tracking_uri,
    wait_for_server,
)

CLOSE_S = 10.0
"""The most a closing logger waits for its last attempt: a server that is down costs no more."""


class LiveLogger:
    """Logs a run to MLflow while it trains, from a background thread of the launching process,
    inside its ``with`` block:
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

    def __enter__(self) -> LiveLogger:
        """Start following the run."""
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Log what is left (one last attempt) and stop; never raises. A server gets at most
        :data:`CLOSE_S` (one that is down costs no more); a local store is waited for. Its first
        write makes and migrates the database, seconds on a busy machine: cut off by the
        process's exit, it left a half-made database that every later client failed to open.
        """
        self._stop.set()
        self._thread.join(None if is_local_store(self.uri) else CLOSE_S)

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
            start = int(self._waiting[0].time * 1000)
            # A new run is tagged as it is made (log_run finds it again by its key), never after.
            tags = {**source_tags(), **self.tags, "rfsdp.run_dir": str(self.run_dir.resolve())}
            self.run_id, _ = find_or_create_run(
                client,
                self.uri,
                self.experiment,
                RUN_KEY_TAG,
                key,
                run_name=self.run_name,
                start_time=start,
                tags=tags,
            )
        log_points(client, self.run_id, points)
        self._done_before = max([self._done_before, *(e.step for e in self._waiting if isinstance(e, Step))])
        self._waiting = []
