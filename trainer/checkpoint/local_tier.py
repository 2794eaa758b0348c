"""The local tier's folders in node memory: each user's own root under /dev/shm, one folder per run."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

LOCAL_TIER_ROOT = Path("/dev/shm/rfsdp-local")
"""Node-local memory holding every run's local tier (``--local-ckpt-every``), one folder per run:
each user has a folder of their own beside it, ``rfsdp-local-UID`` (:func:`local_tier_root`)."""
LOCAL_TIER_ROOT_ENV = "RFSDP_LOCAL_TIER_ROOT"
"""Overrides ``LOCAL_TIER_ROOT``: the emulated hosts of ``--netns`` share this machine's /dev/shm,
so each gets a root of its own, which its node loss wipes (``trainer.emulation.netns``)."""


def local_tier_root() -> Path:
    """This node's folder of every run's local tier of this user (``LOCAL_TIER_ROOT_ENV``, else
    ``/dev/shm/rfsdp-local-UID``): /dev/shm is shared by every user, and one user's folder must
    never be in another's way.
    """
    return Path(
        os.environ.get(LOCAL_TIER_ROOT_ENV) or LOCAL_TIER_ROOT.with_name(f"{LOCAL_TIER_ROOT.name}-{os.geteuid()}")
    )


def private_local_tier_root() -> tuple[Path, str | None]:
    """:func:`local_tier_root`, made (0700) when missing, and why it cannot be used, if so (else
    None): it is not a folder of this user's, or others may write to it (the default root must
    be private: others may not even read it). Whoever can write there could replace a snapshot,
    so the tier then steps aside (its caller) and the run goes on with the durable tier.
    """
    root = local_tier_root()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(root)
    except OSError as e:
        return root, f"cannot make {root}: {e.strerror or e}"
    private = 0o022 if os.environ.get(LOCAL_TIER_ROOT_ENV) else 0o077
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & private:
        return root, f"{root} is not a private folder of this user's (uid {os.geteuid()})"
    return root, None


def local_tier_dir(run_dir: Path, fingerprint: str) -> Path:
    """This node's folder of a run's local snapshots: named by the run dir's identity (its real
    path, device and inode: a run dir removed and made again is another run) and the training
    config's ``fingerprint``, so two runs never share one.
    """
    run_dir = Path(run_dir).resolve()
    st = run_dir.stat()
    ident = f"{run_dir}\0{st.st_dev}\0{st.st_ino}\0{fingerprint}"
    return local_tier_root() / hashlib.sha256(ident.encode()).hexdigest()[:16]
