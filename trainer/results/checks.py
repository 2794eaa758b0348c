"""The checks that read a checkpoint without training: ``complete``, ``intact``, ``loadable``,
``finite`` and ``quality`` (what each proves: :mod:`trainer.results.validate`).

Each takes the :class:`Target` they share and returns its :class:`Check`; ``loadable`` leaves the
checkpoint's tensors and model on the target for the checks after it. The sixth check, the
replay, trains: :mod:`trainer.results.replay`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    audit_checkpoint,
    latest_checkpoint,
    latest_is_corrupt,
    open_checkpoint,
    rank_state_file,
    read_full_state,
    verify_checkpoint,
)
from trainer.data.loader import TokenLoader
from trainer.data.shards import load_split
from trainer.models.spec import ModelSpec
from trainer.rank.config import TrainConfig
from trainer.rank.runtime import build_unsharded
from trainer.results.states import differences, load_resharded, tensors

EVAL_BATCHES = 16
"""Batches of the val split the quality check evaluates (``batch_size`` x ``seq_len`` tokens each)."""


@dataclass(slots=True)
class Check:
    """The outcome of one check."""

    name: str
    passed: bool
    values: dict = field(default_factory=dict)
    """What the check measured (numbers, names, per-step losses)."""
    detail: str = ""
    """One line a person can act on."""
    skipped: bool = False
    """True when a prerequisite check failed, so this one could not run (it did not pass either)."""


@dataclass(slots=True)
class Target:
    """Everything the checks of one checkpoint share; filled in as they run."""

    cfg: TrainConfig
    path: Path
    step: int
    is_latest: bool
    quality_margin: float
    replay_steps: int
    manifest: dict | None = None
    state: dict | None = None
    """The checkpoint's full (unsharded) tensors, as ``read_full_state`` returns them."""
    model: ModelSpec | None = None


def check_complete(t: Target) -> Check:
    """Manifest files present with their sizes, DCP's shard files covered, ``latest`` pointing here
    (a corrupt ``latest``, which resume repairs, is only reported).
    """
    pointer = latest_checkpoint(t.path.parent.parent)
    values: dict = {"latest": pointer.name if pointer else None}
    if t.manifest is None:
        return Check("complete", False, values, f"{MANIFEST} is missing or unreadable")
    files = t.manifest["files"]
    values.update(
        files=len(files), bytes=sum(f["size"] for f in files.values()), world_size=t.manifest.get("world_size")
    )
    try:
        checkpoint = open_checkpoint(t.path, checksums=False)
    except CheckpointError as e:
        return Check("complete", False, values, str(e))
    expected = [".metadata"] + [rank_state_file(r) for r in range(t.manifest.get("world_size", 0))]
    absent = [name for name in expected if name not in files]
    if absent:
        return Check("complete", False, values, f"the manifest lacks {', '.join(absent)}")
    # The DCP metadata says which byte ranges of which files hold each tensor. It is read only
    # once its bytes match the manifest, and then with DCP's metadata classes allowed only.
    try:
        storage = checkpoint.metadata().storage_data
    except CheckpointError as e:
        return Check("complete", False, values, str(e))
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    values["shards"] = len(ends)
    for name, end in sorted(ends.items()):
        if name not in files:
            return Check("complete", False, values, f".metadata reads {name}, which the manifest does not list")
        if files[name]["size"] < end:
            return Check(
                "complete", False, values, f".metadata reads {name} up to byte {end}, but it has {files[name]['size']}"
            )
    corrupt = latest_is_corrupt(t.path.parent.parent)
    if t.is_latest and values["latest"] != t.path.name and not corrupt:
        return Check("complete", False, values, f"checkpoints/{LATEST} names {values['latest']}, not {t.path.name}")
    note = (
        f"; checkpoints/{LATEST} is corrupt (resuming the run repairs it to the newest that verifies)"
        if corrupt
        else ""
    )
    return Check(
        "complete", True, values, f"{len(files)} files, {values['bytes']:,} bytes, {len(ends)} shard file(s){note}"
    )


def check_intact(t: Target) -> Check:
    """SHA-256 of every file against the manifest; then, when the ranks recorded shard digests,
    every shard of the written tensors against what its rank was asked to save (the whole state
    read here is left on the target for ``loadable``).
    """
    values: dict = {
        "files_hashed": len(t.manifest["files"]),
        "bytes_hashed": sum(f["size"] for f in t.manifest["files"].values()),
    }
    try:
        verify_checkpoint(t.path, checksums=True)
    except CheckpointError as e:
        return Check("intact", False, values, str(e))

    def read(path: Path) -> dict:
        t.state = read_full_state(path)
        return t.state

    try:
        audit = audit_checkpoint(t.path, read)
    except CheckpointError as e:
        return Check("intact", False, values, str(e))
    values.update(audited=audit.audited, shards_audited=audit.shards, mismatches=len(audit.mismatches))
    hashed = f"SHA-256 of {values['files_hashed']} files match the manifest"
    if audit.mismatches:
        more = f" (and {len(audit.mismatches) - 1} more)" if len(audit.mismatches) > 1 else ""
        detail = f"stale or wrong shard written: {audit.mismatches[0]}{more}"
        return Check("intact", False, values | {"stale": list(audit.mismatches)}, detail)
    if not audit.audited:
        return Check("intact", True, values, f"{hashed}; not audited (no shard digests: saved before they were kept)")
    return Check(
        "intact", True, values, f"{hashed}; the {audit.shards} shards of {audit.ranks} ranks hold what each rank saved"
    )


def check_loadable(t: Target) -> Check:
    """Single-process load into a fresh model + optimizer, then a resharded load, compared."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = t.state if t.state is not None else read_full_state(t.path)  # (``intact`` read it to audit it)
    model = _build(t.cfg)
    optimizer = torch.optim.AdamW(model.module.parameters())
    set_state_dict(
        model.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )  # strict: keys and shapes
    t.state, t.model = state, model
    world = t.manifest["world_size"] + 1  # any other world size reshards; one more rank keeps it small
    resharded = load_resharded(t.path, t.cfg, world)
    diffs = differences(state, resharded)
    values = {
        "tensors": sum(1 for _ in tensors(state)),
        "parameters": sum(p.numel() for p in state["model"].values()),
        "saved_world_size": t.manifest["world_size"],
        "reshard_world_size": world,
        "reshard_mismatches": len(diffs),
    }
    if diffs:
        return Check(
            "loadable",
            False,
            values,
            f"loaded on {world} ranks it differs from the single-process load in {few(diffs)}",
        )
    return Check(
        "loadable",
        True,
        values,
        "loads into a fresh model + optimizer in one process, "
        f"and on {world} ranks (FSDP2 + dcp.load) bit-identical to it",
    )


def check_finite(t: Target) -> Check:
    """Every tensor finite; parameter norms."""
    bad = [
        name
        for name, tensor in tensors(t.state)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    norms = {name: float(p.float().norm()) for name, p in t.state["model"].items()}
    values = {
        "tensors": sum(1 for _ in tensors(t.state)),
        "nonfinite_tensors": len(bad),
        "param_norm": math.sqrt(sum(n * n for n in norms.values())),
        "param_norms": norms,
        "nonfinite": bad,
    }
    if bad:
        return Check("finite", False, values, f"non-finite values in {few(bad)}")
    return Check("finite", True, values, f"all {values['tensors']} model and optimizer tensors are finite")


def check_quality(t: Target) -> Check:
    """Eval loss on the val split against the same model at initialization."""
    val = load_split(Path(t.cfg.data), "val")
    initial = _build(t.cfg)  # the run's initialization, as build_fsdp_model makes it
    eval_loss, init_loss = _eval_loss(t.model, val, t.cfg), _eval_loss(initial, val, t.cfg)
    values = {
        "eval_loss": eval_loss,
        "init_loss": init_loss,
        "improvement": init_loss - eval_loss,
        "margin": t.quality_margin,
        "eval_tokens": EVAL_BATCHES * t.cfg.batch_size * (t.cfg.seq_len or t.model.seq_len),
    }
    passed = init_loss - eval_loss >= t.quality_margin  # False for a NaN loss as well
    relation = "at least" if passed else "less than"
    return Check(
        "quality",
        passed,
        values,
        f"eval loss {eval_loss:.4f} vs {init_loss:.4f} at initialization: {relation} {t.quality_margin} lower",
    )


def few(names: list, limit: int = 5) -> str:
    """The first ``limit`` of ``names`` and how many more, for a check's one-line detail."""
    shown = ", ".join(str(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _build(cfg: TrainConfig) -> ModelSpec:
    """The run's model at its initialization, whole, in this process."""
    return build_unsharded(cfg.model, cfg.seed, cache=Path(cfg.run_dir) / "model_cache")


def _eval_loss(model: ModelSpec, tokens, cfg: TrainConfig) -> float:
    """Mean loss over the first ``EVAL_BATCHES`` batches of a deterministic pass over ``tokens``."""
    loader = TokenLoader(tokens, cfg.seq_len or model.seq_len, cfg.batch_size, rank=0, world_size=1)
    model.module.eval()
    with torch.no_grad():
        losses = [float(model.loss(*loader.next_batch())) for _ in range(EVAL_BATCHES)]
    return sum(losses) / len(losses)
