"""A run's identity: its trajectory config and its data set, recorded in the run dir's
``config.json`` (and at its mirror location) before the first step, and checked by every start.

Every launcher checks it before any process starts (``rfsdp train``, the kubernetes train step),
and rank 0 checks it again as it starts: a PyTorchJob applied with ``kubectl`` has no launcher
of ours in front of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.data.prepare import local_data
from trainer.data.shards import MANIFEST as DATA_MANIFEST
from trainer.errors import ParameterError
from trainer.fsutil import create_text, file_sha256
from trainer.rank.config import TRAJECTORY_FIELDS, TrainConfig
from trainer.storage.store import StorageError, open_storage

RUN_CONFIG = "config.json"


DATA_IDENTITY = "data_manifest_sha256"
"""Key of the data set's identity (the SHA-256 of its manifest) in a run's recorded config."""


def run_identity(cfg: TrainConfig) -> dict[str, Any]:
    """What one run is: its trajectory config (``TRAJECTORY_FIELDS``) and the SHA-256 of its data
    set's manifest (None while the data set is not in place yet, e.g. before a cluster step copies it).
    """
    ident: dict[str, Any] = {k: getattr(cfg, k) for k in TRAJECTORY_FIELDS}
    try:
        manifest = local_data(cfg.data, Path(cfg.run_dir)) / DATA_MANIFEST
    except StorageError:
        manifest = None
    ident[DATA_IDENTITY] = file_sha256(manifest) if manifest is not None and manifest.is_file() else None
    return ident


def check_run_dir(cfg: TrainConfig) -> None:
    """Check, then record, the run's identity (:func:`run_identity`) in the run dir's ``config.json``
    and, with a ``checkpoint_uri``, at the mirror location (its ``config.json``): before any
    process or pod starts, on every backend (``launch_local`` through ``check_launch``; the
    kubernetes train step before it submits the PyTorchJob). A location that records another
    identity is refused, naming what differs, and nothing is written anywhere; one that records
    none gets this run's. So a rerun with another config, or another run (other data included)
    on the same mirror location, is refused before its first step.

    Raises:
        ParameterError: naming ``run_dir`` or ``checkpoint_uri``.
    """
    ident = run_identity(cfg)
    path = Path(cfg.run_dir) / RUN_CONFIG
    local = _read_identity(path) if path.exists() else None
    if local is not None and (detail := _other_identity(local, ident)):
        raise ParameterError("run_dir", f"{cfg.run_dir} belongs to another training config ({detail})")
    store = remote = None
    if cfg.checkpoint_uri:
        try:
            store = open_storage(cfg.checkpoint_uri)
            store.check()
            remote = json.loads(store.read_bytes(RUN_CONFIG)) if store.stat(RUN_CONFIG) is not None else None
        except (StorageError, json.JSONDecodeError) as e:
            raise ParameterError("checkpoint_uri", str(e)) from e
        if not isinstance(remote, dict | None):
            raise ParameterError("checkpoint_uri", f"{store.url(RUN_CONFIG)} is not a run's config")
        if remote is not None and (detail := _other_identity(remote, ident)):
            raise ParameterError("checkpoint_uri", f"{cfg.checkpoint_uri} mirrors another run ({detail})")
    record = json.dumps(ident, indent=2)
    if local is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Of two launches racing here, the first records its identity; the other is refused.
        if not create_text(path, record) and (detail := _other_identity(_read_identity(path), ident)):
            raise ParameterError("run_dir", f"{cfg.run_dir} belongs to another training config ({detail})")
    if store is not None and remote is None:
        try:
            store.write_bytes(RUN_CONFIG, record.encode())
        except StorageError as e:
            raise ParameterError("checkpoint_uri", str(e)) from e


def _read_identity(path: Path) -> dict:
    try:
        saved = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ParameterError("run_dir", f"{path} is not a run's config ({e})") from None
    if not isinstance(saved, dict):
        raise ParameterError("run_dir", f"{path} is not a run's config")
    return saved


def _other_identity(saved: dict, ident: dict) -> str:
    """How a recorded identity differs from ``ident`` ("" when it is the same; a data identity
    recorded by neither side, or by an older version, is not compared).
    """
    differ = [f"{k}: {saved.get(k)!r} there, {ident[k]!r} now" for k in TRAJECTORY_FIELDS if saved.get(k) != ident[k]]
    theirs, mine = saved.get(DATA_IDENTITY), ident[DATA_IDENTITY]
    if theirs is not None and mine is not None and theirs != mine:
        differ.append(f"data: manifest sha256 {str(theirs)[:12]}... there, {mine[:12]}... now")
    return ", ".join(differ)
