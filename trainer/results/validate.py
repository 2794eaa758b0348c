"""Checkpoint validation: prove that a published checkpoint is usable, not just present.

Six checks, each reported by name with what it measured:

``complete``  every file of the manifest (DCP shards, ``.metadata``, each rank's state file) is
              present with its recorded size, every shard file the DCP ``.metadata`` reads from is
              in the manifest and long enough, and ``latest`` names the checkpoint (when the
              latest is validated).
``intact``    every file's SHA-256 matches the one recorded at save time, and every shard the ranks
              recorded a digest of holds what its rank was asked to save (a checkpoint saved
              before digests were kept is reported as not audited).
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

This module picks the checkpoints, runs the checks in order and reports; the first five checks
are :mod:`trainer.results.checks`, the replay is :mod:`trainer.results.replay`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from trainer.checkpoint import CHECKPOINTS, MANIFEST, published_checkpoints, step_dir_name
from trainer.data.prepare import local_data
from trainer.data.shards import DataError, load_manifest, verify_shards
from trainer.events import RunStart, read_events, select
from trainer.rank.config import TrainConfig
from trainer.rank.identity import RUN_CONFIG
from trainer.results.checks import (
    Check,
    Target,
    check_complete,
    check_finite,
    check_intact,
    check_loadable,
    check_quality,
)
from trainer.results.replay import check_replays
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


class ValidationError(ValueError):
    """Validation could not run (exit code 2): no checkpoint, another model config, unreadable data."""


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
        target = Target(
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


def _validate_checkpoint(target: Target, run_dir: Path) -> ValidationReport:
    target.manifest = _read_manifest(target.path)
    fingerprint = (target.manifest or {}).get("fingerprint")
    if fingerprint is not None and fingerprint != target.cfg.trajectory_hash():
        cfg = target.cfg
        raise ValidationError(
            f"{target.path.name} was written by another training config than {run_dir}'s (model {cfg.model!r}, "
            f"world size {cfg.world_size}, seed {cfg.seed}, steps {cfg.steps}, ...): fingerprint {fingerprint}, "
            f"expected {cfg.trajectory_hash()}"
        )
    runners: dict[str, Callable[[Target], Check]] = {
        "complete": check_complete,
        "intact": check_intact,
        "loadable": check_loadable,
        "finite": check_finite,
        "quality": check_quality,
        "replays": check_replays,
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
