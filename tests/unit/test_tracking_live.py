"""Live logging's end (trainer.results.tracking.live): the rest, with real servers, is in
tests/integration/test_tracking.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest


@pytest.mark.parametrize(("uri", "waited"), [("sqlite", True), ("http://127.0.0.1:9", False)])
def test_a_closing_live_logger_waits_for_a_local_store_not_for_a_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str, waited: bool
) -> None:
    """A local store's last write (its first one makes and migrates the database) is never cut
    off by the process's exit; a server's gets at most ``CLOSE_S``."""
    from trainer.results.tracking import live

    if uri == "sqlite":
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done, release = threading.Event(), threading.Event()
    if waited:
        release.set()  # the local store's write ends on its own, after CLOSE_S
    # A server's write is held until after the check, so that the check holds at any speed.

    def slow_flush(self: live.LiveLogger) -> None:
        time.sleep(0.5)
        release.wait(60)
        done.set()

    monkeypatch.setattr(live, "CLOSE_S", 0.05)
    monkeypatch.setattr(live.LiveLogger, "_flush", slow_flush)
    with live.LiveLogger(tmp_path / "run", tracking_uri=uri, interval_s=60):
        pass
    assert done.is_set() == waited
    release.set()
