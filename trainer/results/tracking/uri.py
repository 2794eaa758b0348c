"""Where runs go and how a tracking URI is shown: resolving and checking the URI, redacting its
credentials, reaching the server.

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
import fcntl
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

from trainer.errors import ParameterError

if TYPE_CHECKING:
    from mlflow import MlflowClient

_STORE_SCHEMES = ("http", "https", "sqlite", "file", "databricks", "postgresql", "mysql", "mssql")


class TrackingError(RuntimeError):
    """The tracking store could not be reached or refused the run; nothing in the run dir changed."""


def client_of(tracking_uri: str) -> MlflowClient:
    """A client of ``tracking_uri``; a sqlite store is created first if new, one process at a time.

    MLflow serializes a new database's migrations with a lock file in the temp folder, which two
    processes do not share when their ``/tmp`` differs (a pod's, a pipeline step's): both then
    migrate the same file and one fails ("table _alembic_tmp_experiments already exists"). The
    lock here lives beside the database, which every process that uses it shares.
    """
    from mlflow import MlflowClient

    if urlparse(tracking_uri).scheme != "sqlite":
        return MlflowClient(tracking_uri=tracking_uri)
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(f"{db.name}.init-lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=tracking_uri)  # makes (and migrates) the store, cached per URI
    return client


def project_dir(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding a ``pyproject.toml``."""
    here = (start or Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / "pyproject.toml").is_file()), here)


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
    query = "&".join(
        f"{k}={REDACTED}" if v and _SECRET_QUERY_KEY.search(unquote(k)) else f"{k}{eq}{v}" for k, eq, v in pairs
    )
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
        raise ParameterError(
            "tracking_uri", f"{shown!r} is not an MLflow tracking URI (scheme one of {', '.join(_STORE_SCHEMES)})"
        )
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
    experiment_id = client_of(tracking_uri).get_run(run_id).info.experiment_id
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
