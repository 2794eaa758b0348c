"""Checkpoint validation: prove that a published checkpoint is usable, not just present.

Six checks, each reported by name with what it measured:

``complete``  every file of the manifest (DCP shards, ``.metadata``, each rank's state file) is
              present with its recorded size, every shard file the DCP ``.metadata`` reads from is
              in the manifest and long enough, and ``latest`` names the checkpoint (when the
              latest is validated).
``intact``    every file's SHA-256 matches the one recorded at save time.
``loadable``  loads into a freshly built model + optimizer in one process with no process group,
              and into a real gloo job of a different world size that shards the model with
              ``fully_shard`` and loads it with ``dcp.load``; the resharded state must equal the
              single-process one bit for bit.
``finite``    every parameter and optimizer tensor is finite; parameter norms are reported.
``quality``   the eval loss on the data's ``val`` split is below the loss at initialization by
              ``quality_margin``.
``replays``   the real trainer (``launch_local``, original world size) resumes from a copy of the
              checkpoint in a scratch run dir, and its losses equal the run's logged ones bit for
              bit. A run's last checkpoint has no logged steps after it: then the trainer reproduces
              it from the newest earlier checkpoint (or from initialization), and both the losses
              and the checkpoint it writes (tensors, data position, RNG) must equal the validated ones.

A check whose prerequisite failed is reported as skipped (``replays`` runs only when all the
others passed). ``rfsdp validate`` is the command line;
the pipeline's ``validate_checkpoint`` component calls :func:`validate_run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException

from trainer.checkpoint import (
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    latest_is_corrupt,
    open_checkpoint,
    published_checkpoints,
    rank_state_file,
    read_full_state,
    read_rank_state,
    step_dir_name,
    verify_checkpoint,
)
from trainer.data.prepare import local_data
from trainer.data.shards import DataError, TokenLoader, load_manifest, load_split, verify_shards
from trainer.events import RunStart, final_losses, read_events, select
from trainer.launch.local import launch_local
from trainer.launch.spec import LaunchSpec
from trainer.models.spec import ModelSpec
from trainer.rank.config import TrainConfig
from trainer.rank.identity import RUN_CONFIG
from trainer.rank.runtime import build_unsharded
from trainer.results.states import differences, load_resharded, tensors
from trainer.storage.store import StorageError

CHECKS = ("complete", "intact", "loadable", "finite", "quality", "replays")
# What each check needs to have passed before it can say anything. The replay is a real
# training job, by far the dearest check: it runs only for a checkpoint every other check accepted.
REQUIRES = {
    "intact": ("complete",),
    "loadable": ("intact",),
    "finite": ("loadable",),
    "quality": ("loadable",),
    "replays": ("complete", "intact", "loadable", "finite", "quality"),
}
EVAL_BATCHES = 16
"""Batches of the val split the quality check evaluates (``batch_size`` x ``seq_len`` tokens each)."""
TRAJECTORY_RANK_STATE = ("step", "loader", "rng")


class ValidationError(ValueError):
    """Validation could not run (exit code 2): no checkpoint, another model config, unreadable data."""


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
class ValidationReport:
    """The verdict on one checkpoint of a run (with ``fallback``: on the newest valid one)."""

    valid: bool
    step: int | None
    checks: list[Check]
    run_dir: str = ""
    checkpoint: str = ""
    """Path of the checkpoint the verdict is about."""
    rejected: list[dict] = field(default_factory=list)
    """With ``fallback``: newer checkpoints found invalid first, as ``{step, failed, detail}``."""

    @property
    def failed(self) -> list[str]:
        """Names of the checks that ran and failed."""
        return [c.name for c in self.checks if not c.passed and not c.skipped]

    @property
    def skipped(self) -> list[str]:
        """Names of the checks that could not run because a prerequisite failed."""
        return [c.name for c in self.checks if c.skipped]

    def summary(self) -> str:
        """One line: the verdict and the first failing check's detail."""
        name = Path(self.checkpoint).name if self.checkpoint else "checkpoint"
        if self.valid:
            fell_back = (
                f" (newer ones invalid: {', '.join(step_dir_name(r['step']) for r in self.rejected)})"
                if self.rejected
                else ""
            )
            return f"{name} is valid: {', '.join(c.name for c in self.checks)} passed{fell_back}"
        first = next(c for c in self.checks if c.name in self.failed)
        return f"{name} is invalid: {', '.join(self.failed)} failed ({first.detail})"

    def to_dict(self) -> dict:
        """The JSON verdict (non-finite numbers become strings so that the JSON stays standard)."""
        return _json_safe(
            {
                "valid": self.valid,
                "step": self.step,
                "checkpoint": self.checkpoint,
                "run_dir": self.run_dir,
                "failed": self.failed,
                "skipped": self.skipped,
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "rejected": self.rejected,
            }
        )

    def to_markdown(self) -> str:
        """A Markdown table of the checks (the pipeline's Markdown artifact)."""
        verdict = "**valid**" if self.valid else "**invalid**"
        lines = [f"### Checkpoint `{Path(self.checkpoint).name}` of `{self.run_dir}`: {verdict}", ""]
        for r in self.rejected:
            lines.append(
                f"- `{step_dir_name(r['step'])}` rejected first: {', '.join(r['failed'])} failed ({r['detail']})"
            )
        if self.rejected:
            lines.append("")
        lines += ["| check | result | measured | detail |", "|---|---|---|---|"]
        for c in self.checks:
            result = "skipped" if c.skipped else "pass" if c.passed else "**FAIL**"
            measured = ", ".join(f"{k} {_fmt(v)}" for k, v in c.values.items() if _is_scalar(v))
            lines.append(f"| {c.name} | {result} | {measured} | {c.detail.replace('|', '/')} |")
        return "\n".join(lines) + "\n"

    def metrics(self) -> dict[str, float]:
        """Flat numeric metrics (``valid``, ``step``, ``<check>_passed``, ``<check>_<value>``) for
        KFP ``Metrics`` and MLflow; non-finite numbers are left out.
        """
        out = {"valid": float(self.valid)}
        if self.step is not None:
            out["step"] = float(self.step)
        for c in self.checks:
            out[f"{c.name}_passed"] = float(c.passed)
            for key, value in c.values.items():
                if isinstance(value, bool | int | float) and math.isfinite(value):
                    out[f"{c.name}_{key}"] = float(value)
        return out


@dataclass(slots=True)
class _Target:
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


def validate_run(
    run_dir: Path,
    *,
    step: int | None = None,
    data: Path | None = None,
    fallback: bool = False,
    quality_margin: float = 0.5,
    replay_steps: int = 3,
) -> ValidationReport:
    """Validate a run's latest checkpoint (or ``step``'s) with every check.

    Args:
        run_dir: the training run directory.
        step: validate this published checkpoint instead of the latest.
        data: prepared data directory (default: the one recorded in the run's ``run_start`` event).
        fallback: when the checkpoint is invalid, validate older published ones and report the
            newest valid one (the invalid ones are listed in ``rejected``).
        quality_margin: how far the eval loss must be below the loss at initialization.
        replay_steps: steps the replay check resumes for (when the run logged that many after it).

    Returns:
        The report; ``valid`` is False when a check failed (the report names it).

    Raises:
        ValidationError: validation could not run (no such run dir or checkpoint, a checkpoint
            of another training config, unreadable data, bad arguments).
    """
    run_dir = Path(run_dir)
    if not math.isfinite(quality_margin) or quality_margin < 0:
        raise ValidationError(f"--quality-margin must be a finite number >= 0, got {quality_margin}")
    if replay_steps < 1:
        raise ValidationError(f"--replay-steps must be at least 1, got {replay_steps}")
    if not run_dir.is_dir():
        raise ValidationError(f"--run-dir {run_dir} does not exist")
    cfg = run_config(run_dir, data)
    published = published_checkpoints(run_dir / CHECKPOINTS)
    if not published:
        raise ValidationError(f"--run-dir {run_dir} has no published checkpoint (nothing in {run_dir / CHECKPOINTS})")
    steps = [s for s, _ in published]
    if step is not None and step not in steps:
        raise ValidationError(
            f"--step {step}: {run_dir} has no published checkpoint {step_dir_name(step)} (published: {steps})"
        )
    _check_data(cfg)
    newest = steps[-1] if step is None else step
    candidates = [(s, p) for s, p in reversed(published) if s <= newest]
    if not fallback:
        candidates = candidates[:1]
    rejected: list[dict] = []
    first: ValidationReport | None = None
    for s, path in candidates:
        target = _Target(
            cfg,
            path,
            s,
            is_latest=step is None and s == steps[-1],
            quality_margin=quality_margin,
            replay_steps=replay_steps,
        )
        report = _validate_checkpoint(target, run_dir)
        if report.valid:
            report.rejected = rejected
            return report
        first = first or report
        bad = next(c for c in report.checks if c.name in report.failed)
        rejected.append({"step": s, "failed": report.failed, "detail": bad.detail})
    first.rejected = rejected[1:]
    return first


def run_config(run_dir: Path, data: Path | None) -> TrainConfig:
    """The run's training config: its last ``run_start`` event's, with ``config.json``'s
    trajectory fields on top (the ones a resume must match), this run dir and ``data``.
    """
    starts = select(read_events(run_dir), RunStart)
    recorded = dict(starts[-1].config) if starts else {}
    if (run_dir / RUN_CONFIG).is_file():
        try:
            recorded.update(json.loads((run_dir / RUN_CONFIG).read_text()))
        except json.JSONDecodeError as e:
            raise ValidationError(f"--run-dir {run_dir}: {RUN_CONFIG} is not valid JSON ({e})") from None
    if not recorded:
        raise ValidationError(
            f"--run-dir {run_dir} has no {RUN_CONFIG} and no run_start event: not a training run directory"
        )
    data = data or recorded.get("data")
    if not data:
        raise ValidationError(f"--data: {run_dir} records no data directory; pass --data DIR")
    try:
        data = local_data(str(data), run_dir)  # an s3:// data set: the run dir's verified cache, as in training
    except StorageError as e:
        raise ValidationError(f"--data {data}: {e}") from None
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"faults"}
    fields = {k: v for k, v in recorded.items() if k in names}
    # The validation's own runs never inject the run's faults, stop where it stopped, nor write to
    # its checkpoint mirror (a replay would overwrite the production run's events and config there).
    fields.update(data=str(data), run_dir=str(run_dir), fault="", stop_at_step=0, checkpoint_uri="")
    try:
        return TrainConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"--run-dir {run_dir}: its recorded training config is unusable ({e})") from None


def _check_data(cfg: TrainConfig) -> None:
    try:
        manifest = load_manifest(Path(cfg.data))
        verify_shards(Path(cfg.data), manifest)
        if "val" not in manifest["splits"]:
            raise DataError(f"{cfg.data} has no 'val' split")
        if manifest["splits"]["val"]["tokens"] < cfg.seq_len + 2:
            raise DataError(f"the val split of {cfg.data} is shorter than one sequence of {cfg.seq_len} tokens")
    except (DataError, OSError, KeyError) as e:
        raise ValidationError(f"--data {cfg.data}: {e}") from None


def _validate_checkpoint(target: _Target, run_dir: Path) -> ValidationReport:
    target.manifest = _read_manifest(target.path)
    fingerprint = (target.manifest or {}).get("fingerprint")
    if fingerprint is not None and fingerprint != target.cfg.trajectory_hash():
        cfg = target.cfg
        raise ValidationError(
            f"{target.path.name} was written by another training config than {run_dir}'s (model {cfg.model!r}, "
            f"world size {cfg.world_size}, seed {cfg.seed}, steps {cfg.steps}, ...): fingerprint {fingerprint}, "
            f"expected {cfg.trajectory_hash()}"
        )
    runners: dict[str, Callable[[_Target], Check]] = {
        "complete": _check_complete,
        "intact": _check_intact,
        "loadable": _check_loadable,
        "finite": _check_finite,
        "quality": _check_quality,
        "replays": _check_replays,
    }
    checks: dict[str, Check] = {}
    for name in CHECKS:
        missing = [r for r in REQUIRES.get(name, ()) if not checks[r].passed]
        if missing:
            checks[name] = Check(name, False, detail=f"skipped: {', '.join(missing)} did not pass", skipped=True)
            continue
        t0 = time.perf_counter()
        try:
            checks[name] = runners[name](target)
        except (Exception, CheckpointException) as e:  # a check that breaks is a failed check, named with its cause
            # One line: a failed rank's exception arrives with its whole traceback, the cause last.
            cause = ([line for line in str(e).splitlines() if line.strip()] or [""])[-1]
            checks[name] = Check(name, False, detail=f"{type(e).__name__}: {cause}")
        checks[name].values["seconds"] = round(time.perf_counter() - t0, 3)
    ordered = [checks[n] for n in CHECKS]
    return ValidationReport(
        valid=all(c.passed for c in ordered),
        step=target.step,
        checks=ordered,
        run_dir=str(run_dir),
        checkpoint=str(target.path),
    )


def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


# ---------------------------------------------------------------------------------- checks
def _check_complete(t: _Target) -> Check:
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


def _check_intact(t: _Target) -> Check:
    """SHA-256 of every file against the manifest."""
    values = {
        "files_hashed": len(t.manifest["files"]),
        "bytes_hashed": sum(f["size"] for f in t.manifest["files"].values()),
    }
    try:
        verify_checkpoint(t.path, checksums=True)
    except CheckpointError as e:
        return Check("intact", False, values, str(e))
    return Check("intact", True, values, f"SHA-256 of {values['files_hashed']} files match the manifest")


def _check_loadable(t: _Target) -> Check:
    """Single-process load into a fresh model + optimizer, then a resharded load, compared."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = read_full_state(t.path)
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
            f"loaded on {world} ranks it differs from the single-process load in {_few(diffs)}",
        )
    return Check(
        "loadable",
        True,
        values,
        "loads into a fresh model + optimizer in one process, "
        f"and on {world} ranks (FSDP2 + dcp.load) bit-identical to it",
    )


def _check_finite(t: _Target) -> Check:
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
        return Check("finite", False, values, f"non-finite values in {_few(bad)}")
    return Check("finite", True, values, f"all {values['tensors']} model and optimizer tensors are finite")


def _check_quality(t: _Target) -> Check:
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


def _check_replays(t: _Target) -> Check:
    """Re-run the real trainer from the checkpoint (or up to it) and compare with the run's log."""
    logged = final_losses(read_events(Path(t.cfg.run_dir)))
    ahead = 0
    while ahead < t.replay_steps and t.step + ahead + 1 in logged:
        ahead += 1
    if ahead:  # resume from the checkpoint itself
        base, base_path, stop = t.step, t.path, t.step + ahead
    else:  # the run's last checkpoint: reproduce it from an earlier one
        base, base_path = _earlier_checkpoint(t)
        stop = t.step
    compare = list(range(base + 1, stop + 1))
    unlogged = [s for s in compare if s not in logged]
    values: dict = {
        "mode": "resume" if ahead else "reproduce",
        "from_step": base,
        "to_step": stop,
        "steps": len(compare),
    }
    if unlogged:
        return Check(
            "replays", False, values, f"the run logged no loss for step(s) {_few(unlogged)}: nothing to compare with"
        )
    with tempfile.TemporaryDirectory(prefix="rfsdp-replay-") as tmp:
        scratch = Path(tmp) / "run"
        (scratch / CHECKPOINTS).mkdir(parents=True)
        if base_path is not None:
            shutil.copytree(base_path, scratch / CHECKPOINTS / base_path.name)
            (scratch / CHECKPOINTS / LATEST).write_text(base_path.name + "\n")
        if (Path(t.cfg.run_dir) / RUN_CONFIG).is_file():
            shutil.copy(Path(t.cfg.run_dir) / RUN_CONFIG, scratch / RUN_CONFIG)
        # Only the trajectory matters here: a blocking save, no local tier and no restart layers keep it short.
        no_tier = {"local_ckpt_every": 0, "local_replicas": 0}  # on one node: no peer could hold a replica either
        cfg = dataclasses.replace(
            t.cfg, run_dir=str(scratch), stop_at_step=stop, ckpt_mode="sync", inprocess_restart=False, **no_tier
        )
        world = t.manifest["world_size"]
        try:
            code = launch_local(cfg, LaunchSpec(nnodes=1, nproc_per_node=world, max_restarts=0), progress=False)
        except ValueError as e:
            return Check("replays", False, values, f"could not replay on the original world size {world}: {e}")
        if code:
            tail = " / ".join(
                (scratch / "logs" / "replica_0.log").read_text(errors="replace").strip().splitlines()[-3:]
            )
            return Check("replays", False, values, f"the replay failed (exit code {code}): {tail}")
        replayed = final_losses(read_events(scratch))
        values["losses"] = {s: {"logged": logged[s], "replayed": replayed.get(s)} for s in compare}
        differ = [s for s in compare if replayed.get(s) != logged[s]]
        values["mismatched_steps"] = len(differ)
        if differ:
            s = differ[0]
            detail = (
                f"step {s} replayed to loss {replayed.get(s)!r}, the run logged {logged[s]!r} "
                f"({len(differ)} of {len(compare)} differ)"
            )
            return Check("replays", False, values, detail)
        if ahead:
            return Check(
                "replays", True, values, f"resumed for {len(compare)} steps: losses equal the run's bit for bit"
            )
        # Reproduce mode: the checkpoint the replay wrote must be the validated one.
        produced = scratch / CHECKPOINTS / step_dir_name(t.step)
        diffs = differences(t.state, read_full_state(produced))
        for rank in range(world):
            ours, theirs = read_rank_state(t.path, rank), read_rank_state(produced, rank)
            diffs += [f"{rank_state_file(rank)}:{d}" for d in differences(_trajectory(ours), _trajectory(theirs))]
        values["state_mismatches"] = len(diffs)
        if diffs:
            return Check(
                "replays",
                False,
                values,
                f"replayed from step {base}, the state at step {t.step} differs in {_few(diffs)}",
            )
    return Check(
        "replays",
        True,
        values,
        f"reproduced from step {base}: losses of {len(compare)} steps and the checkpoint's state equal bit for bit",
    )


# --------------------------------------------------------------------------------- helpers
def _earlier_checkpoint(t: _Target) -> tuple[int, Path | None]:
    """The newest published checkpoint before ``t`` that verifies, else initialization (0, None)."""
    for s, path in reversed(published_checkpoints(t.path.parent)):
        if s >= t.step:
            continue
        try:
            verify_checkpoint(path, fingerprint=t.cfg.trajectory_hash(), world_size=t.manifest["world_size"])
        except CheckpointError:
            continue
        return s, path
    return 0, None


def _trajectory(rank_state: dict) -> dict:
    return {k: rank_state.get(k) for k in TRAJECTORY_RANK_STATE}


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


def _few(names: list, limit: int = 5) -> str:
    shown = ", ".join(str(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _json_safe(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    return value
