"""Crossover: from which state size and checkpoint interval async checkpoints finish the same
work sooner than sync ones, on this machine (2 real ranks, no faults, the local tier off).

For each built-in model (its sharded state per rank grows with it) and each interval, the same
run with ``--ckpt-mode sync`` and ``--ckpt-mode async``. The measure is the training's own wall
time, from the first step's start to the run's end (its last checkpoint published), read from
each run's events; start-up is left out, as it is the same for both. ``async / sync`` below 1:
async finished sooner.

A sync save stalls the loop for its whole write. An async one stalls it only for its staging copy,
but its writer then competes with the ranks for the cores while the steps go on: on a machine
with no core to spare, async wins only where the write waits on the disk (a large state), not
where it is CPU work (serializing and checksumming a small one).
"""

from __future__ import annotations

from pathlib import Path

from bench.common import fmt, fresh_dir, interleaved, median, print_table, print_targets, ratio, run_rfsdp, target
from trainer.events import Checkpoint, RunEnd, RunStart, Step, read_events, select
from trainer.rank.config import TrainConfig

METHODS = ("sync", "async")
FULL = {"models": ("tiny", "small", "base"), "intervals": (2, 5), "steps": 10, "reps": 1}  # base: ~10 s a step
QUICK = {"models": ("tiny",), "intervals": (2,), "steps": 6, "reps": 1}


def measure(run_dir: Path) -> dict:
    """The training's wall time (first step's start to the run's end) and its checkpoints' size."""
    events = read_events(run_dir)
    steps, ends, starts = select(events, Step), select(events, RunEnd), select(events, RunStart)
    saves = [e for e in select(events, Checkpoint) if e.tier == "durable"]
    began = steps[0].time - steps[0].step_time_s
    return {
        "wall_s": ends[-1].time - began,
        "saves": len(saves),
        "stall_s": median([e.blocking_s for e in saves]),
        "bytes_per_rank": median([e.bytes for e in saves]) / starts[0].world_size if saves else None,  # even shards
        "step_s": median([e.step_time_s for e in steps]),
    }


def run_one(mode: str, model: str, every: int, run_dir: Path, data: Path, steps: int) -> dict:
    fresh_dir(run_dir)
    cfg = TrainConfig(
        data=str(data),
        run_dir=str(run_dir),
        model=model,
        steps=steps,
        ckpt_every=every,
        ckpt_mode=mode,
        local_ckpt_every=0,
    )
    code, _ = run_rfsdp(cfg, max_restarts=0)
    if code:
        raise RuntimeError(f"crossover: {mode} {model} every {every} failed (exit {code}); logs in {run_dir / 'logs'}")
    return measure(run_dir)


def _medians(runs: list[dict]) -> dict:
    return {k: median([r[k] for r in runs if r[k] is not None]) for k in runs[0]}


def crossover(cells: list[dict]) -> dict | None:
    """The smallest state per rank (then the shortest interval) where async finished sooner."""
    won = [c for c in cells if c["async_over_sync"] is not None and c["async_over_sync"] < 1]
    if not won:
        return None
    first = min(won, key=lambda c: (c["bytes_per_rank"] or 0, c["every"]))
    return {k: first[k] for k in ("model", "every", "bytes_per_rank", "async_over_sync")}


def run(quick: bool, work: Path, data: Path) -> dict:
    """Every (model, interval) with both modes, back to back in interleaved repetitions; medians per cell."""
    params = QUICK if quick else FULL
    work = fresh_dir(work / "crossover")
    samples: dict[tuple[str, int, str], list[dict]] = {}
    for model in params["models"]:
        for every in params["intervals"]:
            # The two modes of a cell back to back, their order rotated every repetition: a change
            # in the machine's load falls on both.
            for rep, mode in interleaved(METHODS, params["reps"]):
                run_dir = work / f"{model}_every{every}_{mode}_{rep}"
                samples.setdefault((model, every, mode), []).append(
                    run_one(mode, model, every, run_dir, data, params["steps"])
                )
    cells = []
    for model in params["models"]:
        for every in params["intervals"]:
            by_mode = {mode: _medians(samples[model, every, mode]) for mode in METHODS}
            cells.append(
                {
                    "model": model,
                    "every": every,
                    "bytes_per_rank": by_mode["sync"]["bytes_per_rank"],
                    "step_s": by_mode["sync"]["step_s"],
                    "sync": by_mode["sync"],
                    "async": by_mode["async"],
                    "async_over_sync": ratio(by_mode["async"]["wall_s"], by_mode["sync"]["wall_s"]),
                }
            )
    return {
        "benchmark": "crossover",
        "params": {**params, "ranks": 2, "local_tier": "off"},
        "cells": cells,
        "crossover": crossover(cells),
        "targets": [
            target(
                "async / sync wall time, the same work, < 1 in some cell measured",
                min((c["async_over_sync"] for c in cells if c["async_over_sync"] is not None), default=None),
                1.0,
            )
        ],
    }


def show(result: dict) -> None:
    """Print the cells as a table and the crossover under it."""
    p = result["params"]
    rows = [
        [
            c["model"],
            fmt(c["bytes_per_rank"] / 2**20 if c["bytes_per_rank"] else None, " MiB", 1),
            str(c["every"]),
            fmt(c["step_s"], " s", 3),
            fmt(c["sync"]["stall_s"], " s", 3),
            fmt(c["async"]["stall_s"], " s", 3),
            fmt(c["sync"]["wall_s"], " s", 1),
            fmt(c["async"]["wall_s"], " s", 1),
            fmt(c["async_over_sync"], digits=3),
        ]
        for c in result["cells"]
    ]
    print_table(
        f"crossover: sync vs async checkpoints, {p['steps']} steps, 2 ranks, no faults, {p['reps']} rep(s)",
        ["model", "state / rank", "every", "step", "sync stall", "async stall"]
        + ["sync wall", "async wall", "async / sync"],
        rows,
    )
    c = result["crossover"]
    if c is None:
        print("  crossover: async finished no sooner than sync in any cell measured here")
    else:
        state = fmt(c["bytes_per_rank"] / 2**20, " MiB", 1)
        print(
            f"  crossover: async finishes sooner from {state} of state per rank ({c['model']}), a checkpoint "
            f"every {c['every']} steps: {fmt(c['async_over_sync'], digits=3)} of sync's time"
        )
    print_targets(result["targets"])
