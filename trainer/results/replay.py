"""The ``replays`` check: the real trainer re-runs from a checkpoint, and must match the run.

It resumes from a copy of the checkpoint in a scratch run dir, on the original world size (each
rank forked from this process: :func:`trainer.launch.forked.run_forked`), and compares its losses
with the run's logged ones bit for bit. A run's last checkpoint has no logged steps after it:
then the trainer reproduces it from the newest earlier checkpoint (or from initialization), and
the checkpoint it writes (tensors, data position, RNG) must equal the validated one too. The only
check that trains, so the dearest: validation runs it last, and only for a checkpoint the others
(:mod:`trainer.results.checks`) accepted.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from trainer.checkpoint import (
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    published_checkpoints,
    rank_state_file,
    read_full_state,
    read_rank_state,
    step_dir_name,
    verify_checkpoint,
)
from trainer.events import final_losses, read_events
from trainer.launch.forked import run_forked
from trainer.rank.identity import RUN_CONFIG
from trainer.results.checks import Check, Target, few
from trainer.results.states import differences

TRAJECTORY_RANK_STATE = ("step", "loader", "rng")
START_S = 300
"""What the replay's ranks may take to start, build the model and resume, beyond the run's hang
timeout per step: no launcher watches them, so a hung replay fails the check at this deadline."""


def check_replays(t: Target) -> Check:
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
            "replays", False, values, f"the run logged no loss for step(s) {few(unlogged)}: nothing to compare with"
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
        world, log = t.manifest["world_size"], scratch / "logs" / "replay.log"
        try:
            code = run_forked(cfg, world, log, timeout_s=START_S + cfg.hang_timeout * len(compare))
        except ValueError as e:
            return Check("replays", False, values, f"could not replay on the original world size {world}: {e}")
        if code:
            tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
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
                f"replayed from step {base}, the state at step {t.step} differs in {few(diffs)}",
            )
    return Check(
        "replays",
        True,
        values,
        f"reproduced from step {base}: losses of {len(compare)} steps and the checkpoint's state equal bit for bit",
    )


def _earlier_checkpoint(t: Target) -> tuple[int, Path | None]:
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
