"""The local launcher's replicas (``trainer.launch.local``), with stand-in launcher processes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from trainer.launch.local import _Replica, stop_replicas

PEER = r"""
import pathlib, signal, sys, time
me, peer = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def on_term(*_):
    me.touch()
    while not peer.exists():  # as a launcher whose ranks ended waits in the exit barrier for its peer's
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(f"{me}.ready").touch()
while True:
    time.sleep(1)
"""
"""A launcher that, once signalled, ends only after its peer was signalled too."""


def test_a_stopped_jobs_launchers_are_signalled_together(tmp_path: Path) -> None:
    """Each stand-in ends on SIGTERM only once the other has had one. Signalled one at a time,
    the first would wait out the grace period and be killed (a preempted 2-node job took 55 s to
    end); together, both end by themselves.
    """
    marks = [tmp_path / "a", tmp_path / "b"]
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        replicas = [
            _Replica(
                [sys.executable, "-c", PEER, str(me), str(peer)],
                dict(os.environ),
                tmp_path / f"{me.name}.log",
                keep_fd=fd,
            )
            for me, peer in (marks, marks[::-1])
        ]
        for replica in replicas:
            replica.start()
        deadline = time.monotonic() + 60
        while not all(Path(f"{m}.ready").exists() for m in marks):
            assert time.monotonic() < deadline, "the stand-ins did not start"
            time.sleep(0.05)
        stop_replicas(replicas, grace_s=120)
    finally:
        os.close(fd)
    assert [r.poll() for r in replicas] == [0, 0]  # not -9: neither waited for the grace period's end
