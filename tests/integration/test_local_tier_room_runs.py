"""The local tier's node memory: each user's own root, and a full one.

Real jobs in a mount namespace of their own (root and ``unshare`` needed: the tests skip
elsewhere), so that nothing they make or fill is the machine's /dev/shm, which other tests use:

- /dev/shm is shared by every user: one user's folder there must not be in another user's way,
  and a folder this user did not make privately is not used;
- a local tier root with no room left turns the tier off with a ``warning`` naming the path, and
  training goes on with the durable tier.

The default root alone: tests/unit/test_local_tier_room.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import NOBODY, ROOT, as_unprivileged, need_a_mount_namespace
from trainer.checkpoint import LOCAL_TIER_ROOT_ENV
from trainer.events import Checkpoint, CheckpointFailed, Fatal, RunEnd, RunWarning, read_events

NOBODY_UID = 65534


def in_a_mount_namespace(script: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``sh -c script sh args...`` as root in a mount namespace of its own (skips where there is none)."""
    need_a_mount_namespace()
    env = {k: v for k, v in os.environ.items() if k != LOCAL_TIER_ROOT_ENV}
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# Runs inside the mount namespace, on a private tmpfs at /dev/shm. (a) root made the old shared
# root /dev/shm/rfsdp-local (0755, as a job of root's leaves it): nobody's local tier must not meet
# EACCES there. (A real run as nobody cannot start here: ft_launcher in the checkout's virtual
# environment is not nobody's to run; so nobody makes its tier's root and a run's folder in it, as
# a rank does.) (b) nobody made /dev/shm/rfsdp-local-0, root's own root, open to all: a real run
# of root's must not use it.
NOBODYS_TIER = """
import os, stat
from trainer.checkpoint import local_tier
root = local_tier.local_tier_root()
root, refused = getattr(local_tier, "private_local_tier_root", lambda: (root, None))()  # what a rank checks first
assert refused is None, refused
(root / "run" / "0").mkdir(parents=True)  # what a rank's tier makes: its run's folder, its own in it
print(root, oct(stat.S_IMODE(os.stat(root).st_mode)))
"""
USERS = r"""
import json, os, shutil, subprocess, sys
from pathlib import Path

data, out, nobody, nobodys_tier = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
Path("/dev/shm/rfsdp-local").mkdir(mode=0o755)
theirs = Path("/dev/shm/rfsdp-local-0")
theirs.mkdir()
os.chmod(theirs, 0o777)
os.chown(theirs, 65534, 65534)
result = {}
proc = subprocess.run([*nobody, sys.executable, "-c", nobodys_tier], capture_output=True, text=True, timeout=120)
result["nobody"] = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-3000:]}
run = out / "root"
proc = subprocess.run(
    [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", data, "--run-dir", str(run),
     "--steps", "12", "--ckpt-every", "6", "--local-ckpt-every", "1"],
    capture_output=True, text=True, timeout=600,
)
result["root"] = {"rc": proc.returncode, "stderr": proc.stderr[-3000:]}
result["roots"] = sorted(p.name for p in Path("/dev/shm").glob("rfsdp-local*"))
(out / "result.json").write_text(json.dumps(result))
"""


def test_another_users_folder_in_dev_shm_does_not_break_a_run(data_dir: Path, tmp_path: Path) -> None:
    """Before: every user's tier lived in /dev/shm/rfsdp-local, so nobody's tier met EACCES in
    root's folder there, and root's run used a folder anyone could write to. Now each user has
    ``rfsdp-local-UID``, made 0700; one that is not a private folder of this user's is refused:
    the tier steps aside with a ``warning`` naming it, and the run completes."""
    nobody = as_unprivileged([]) or NOBODY
    out = tmp_path / "out"
    out.mkdir()
    script = 'mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && exec "$1" -c "$2" "$3" "$4" "$5" "$6"'
    proc = in_a_mount_namespace(
        script, sys.executable, USERS, str(data_dir), str(out), json.dumps(nobody), NOBODYS_TIER
    )
    assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["nobody"]["rc"] == 0, result["nobody"]["stderr"]
    assert result["nobody"]["stdout"].split() == [f"/dev/shm/rfsdp-local-{NOBODY_UID}", "0o700"]
    assert result["root"]["rc"] == 0, result["root"]["stderr"]
    events = read_events(out / "root")
    assert not [e for e in events if isinstance(e, Fatal)]
    assert isinstance(events[-1], RunEnd) and events[-1].status == "completed"
    off = [e for e in events if isinstance(e, RunWarning) and e.kind == "local_tier_off"]
    assert off and "/dev/shm/rfsdp-local-0" in off[0].reason and "not a private folder" in off[0].reason
    assert not [e for e in events if isinstance(e, Checkpoint) and e.tier == "local"]
    assert [e for e in events if isinstance(e, Checkpoint) and e.tier != "local"]  # the durable tier saved
    assert result["roots"] == ["rfsdp-local", "rfsdp-local-0", f"rfsdp-local-{NOBODY_UID}"]


# Runs inside the mount namespace, with a tmpfs at argv[1] as the local tier's root: starts a run,
# and fills the tmpfs once the launcher checked that it has room (it made the logs folder), long
# before a rank is up. (Later would be too late: two snapshots written, the tier's next ones reuse
# their memory.)
FULL = """
import json, subprocess, sys, time
from pathlib import Path

tier, data, run = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
train = subprocess.Popen(
    [sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", data, "--run-dir", str(run), "--steps", "30",
     "--ckpt-every", "10", "--local-ckpt-every", "1"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, \
env={**__import__("os").environ, "RFSDP_LOCAL_TIER_ROOT": str(tier)},
)
while train.poll() is None and not (run / "logs").is_dir():
    time.sleep(0.01)
assert not list(run.glob("events.jsonl")), "a rank was up before the tier's memory was filled"
filled = 0
with open(tier / "filler", "wb", buffering=0) as f:
    for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
        try:
            while True:
                filled += f.write(b"x" * chunk)
        except OSError:
            pass
stdout, stderr = train.communicate(timeout=600)
print(json.dumps({"rc": train.returncode, "stderr": stderr[-3000:], "filled": filled}))
"""


def test_a_full_local_tier_steps_aside_and_the_run_goes_on(data_dir: Path, tmp_path: Path) -> None:
    """The tier's root (a 64 MiB tmpfs: room for the launcher's check) fills once the launcher
    checked it. The first snapshot's write finds no room: the tier turns off on every rank with a ``warning``
    ``local_tier_off`` naming the path, its snapshots are removed, and the run completes on the
    durable tier, with no ``fatal`` (before: a ``checkpoint_failed`` at every step, no path)."""
    vol, run = tmp_path / "tier", tmp_path / "run"
    vol.mkdir()
    os.chmod(vol, 0o700)
    script = 'mount -t tmpfs -o size=64m,mode=0700 tmpfs "$1" && exec "$2" -c "$3" "$1" "$4" "$5"'
    proc = in_a_mount_namespace(script, str(vol), sys.executable, FULL, str(data_dir), str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["filled"] > 0 and result["rc"] == 0, result["stderr"]
    events = read_events(run)
    assert not [e for e in events if isinstance(e, Fatal)]
    assert isinstance(events[-1], RunEnd) and events[-1].status == "completed"
    off = [e for e in events if isinstance(e, RunWarning) and e.kind == "local_tier_off"]
    assert off and all(str(vol) in e.reason and "No space left on device" in e.reason for e in off), off
    step_off = min(e.step for e in off)
    assert not [e for e in events if isinstance(e, Checkpoint) and e.tier == "local" and e.step > step_off]
    assert not [e for e in events if isinstance(e, CheckpointFailed) and e.tier == "local" and e.step > step_off]
    assert {e.step for e in events if isinstance(e, Checkpoint) and e.tier != "local"} >= {10, 20, 30}
