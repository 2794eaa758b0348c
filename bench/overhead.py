"""Resilience overhead with no faults, explained: steps/s of the full stack (``rfsdp train``:
ft_launcher heartbeats, the in-process wrapper, async checkpoints at the default interval, event
logging) against a plain FSDP loop with no checkpoints (the same model, data, optimizer and step
function under torchrun), and beside them one component at a time, each turned on with a switch
the product already has, so that each cost is a measured row:

- ``plain``: the bare loop under torchrun (no events, no checkpoints, no monitoring)
- ``trainer``: the trainer itself under torchrun, no in-process restart, no checkpoint before the
  end: its event log and per-step bookkeeping (fault check, progress, the checkpointer's poll)
- ``async_ckpt`` / ``sync_ckpt``: ``trainer`` + a checkpoint every ``ckpt_every`` steps, NVRx async
  or blocking DCP
- ``ft_launcher``: ``trainer`` under ft_launcher (``rfsdp train --no-inprocess-restart``):
  its rank monitors and the per-step heartbeat
- ``wrapper``: ``ft_launcher`` + the in-process wrapper (``rfsdp train``, no checkpoint before the end)
- ``resilient``: everything (``rfsdp train`` with its default checkpoint interval)
- ``local_tier``: ``resilient`` + the local tier, a snapshot in memory every step
  (``--local-ckpt-every 1``; every other method runs without it); also the loop's stall per
  snapshot and the write beside the steps, medians of its ``checkpoint`` events
- ``resilient_loaded`` / ``plain_loaded``: those two with a competing busy process on the cores

Every method is compared with the plain loop (``ratio``) and with the method it adds one thing to
(``vs_base``). The event log alone, the heartbeat alone and the checkpointer's poll alone have no
switch of their own in the trainer, so they are measured together (``trainer``, ``ft_launcher``).
Throughput is taken between step completions on rank 0 after the first ``SKIP`` steps, so
process start-up (a one-time cost, different for each launcher) is left out of all of them; the
run's final checkpoint is taken after its last step and so is outside the measurement too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import (
    fmt,
    fresh_dir,
    interleaved,
    median,
    print_table,
    print_targets,
    ratio,
    run_rfsdp,
    run_torchrun,
    run_torchrun_trainer,
    target,
)
from trainer.data.loader import TokenLoader
from trainer.data.shards import load_split
from trainer.events import Checkpoint, Step, read_events, select
from trainer.models import MODEL_SIZES
from trainer.rank.config import TrainConfig
from trainer.rank.resilience import RankMonitor
from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group
from trainer.rank.state import TrainState
from trainer.rank.train import lr_at, train_step

BASE = {
    "resilient": "plain",
    "local_tier": "resilient",
    "plain": None,
    "trainer": "plain",
    "async_ckpt": "trainer",
    "sync_ckpt": "trainer",
    "ft_launcher": "trainer",
    "wrapper": "ft_launcher",
    "resilient_loaded": "plain_loaded",
    "plain_loaded": None,
}
"""Each method and the method it adds one component to (None: the reference)."""
LOADED = {"resilient_loaded": "resilient", "plain_loaded": "plain"}
"""Methods run again beside a competing busy process (at the primary model size only), and what they run."""
METHODS = tuple(BASE)
CKPT_EVERY = TrainConfig.__dataclass_fields__["ckpt_every"].default
FULL = {"models": {"small": 30, "tiny": 200}, "primary": "small", "reps": 2}
"""Steps per model size (the tiny model's steps are short: more of them for the same time)."""
QUICK = {"models": {"tiny": 12}, "primary": "tiny", "reps": 1}
SKIP = 2  # warm-up steps left out of the throughput
LOCAL_TIER_TARGETS = {"tiny": 1.03, "small": 1.01}
"""Step time with the local tier (a snapshot every step) at most this many times that without it."""


def user_model_shape(model: str) -> dict:
    """A user's model (not a built-in size) trains at batch 1 of 64 tokens here: CPU steps of a
    100M-parameter model at its own length would take minutes."""
    return {} if model in MODEL_SIZES else {"batch_size": 1, "seq_len": 64}


def _slug(model: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in model)[-40:]


def steps_per_s(times: list[float]) -> float:
    """Steps per second between the completion times of consecutive steps (after the warm-up)."""
    times = times[SKIP:]
    return (len(times) - 1) / (times[-1] - times[0])


def plain_worker(args: argparse.Namespace) -> None:
    """One rank of the plain loop: the trainer's step function, nothing else."""
    cfg = TrainConfig(
        data=args.data, run_dir=args.out, model=args.model, steps=args.steps, **user_model_shape(args.model)
    )
    rt = detect_runtime()
    init_process_group(rt, None, timeout_s=600)
    spec = build_fsdp_model(cfg.model, rt, cfg.seed)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    loader = TokenLoader(
        load_split(Path(cfg.data), "train"), cfg.seq_len or spec.seq_len, cfg.batch_size, rt.rank, rt.world_size
    )
    state = TrainState(spec, optimizer, loader, RankMonitor(), dist.group.WORLD)
    times = []
    for step in range(1, cfg.steps + 1):
        train_step(state, lr_at(cfg, step), cfg.grad_clip, rt.device)
        times.append(time.time())
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """While inside: (when ``on``) one process spinning on a core, as a competing job would."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run_method(method: str, model: str, steps: int, run_dir: Path, data: Path) -> list[float]:
    """One run of ``method``; the completion times of its steps on rank 0."""
    kind = LOADED.get(method, method)
    with busy_core(method in LOADED):
        if kind == "plain":
            out = run_dir.with_suffix(".json")
            argv = ["--data", str(data), "--model", model, "--steps", str(steps), "--out", str(out)]
            code, _ = run_torchrun("bench.overhead", argv, run_dir.with_suffix(".log"))
            return json.loads(out.read_text()) if out.exists() and not code else []
        fresh_dir(run_dir)
        # No checkpoint before the end unless the method is about checkpoints; the end's comes
        # after the last timed step.
        ckpt_every = CKPT_EVERY if kind in ("resilient", "local_tier", "async_ckpt", "sync_ckpt") else steps + 1
        cfg = TrainConfig(
            data=str(data),
            run_dir=str(run_dir),
            model=model,
            steps=steps,
            ckpt_every=ckpt_every,
            ckpt_mode="sync" if kind == "sync_ckpt" else "async",
            inprocess_restart=kind in ("resilient", "local_tier", "wrapper"),
            local_ckpt_every=int(kind == "local_tier"),
            **user_model_shape(model),
        )
        full_stack = kind in ("resilient", "local_tier", "wrapper", "ft_launcher")
        run = run_rfsdp if full_stack else lambda c: run_torchrun_trainer(c, max_restarts=0)
        code, _ = run(cfg)
        return [e.time for e in select(read_events(run_dir), Step)] if not code else []


HF_STEPS = {"full": 20, "quick": 6}
"""Steps of a ``--model`` of the user's (its steps are long on CPU: batch 1, 64 tokens)."""


def run(quick: bool, work: Path, data: Path, model: str = "") -> dict:
    """Every method at every model size in interleaved repetitions (the loaded ones at the
    primary size); median steps/s, ratios to the plain loop and to each method's base.
    ``model``: a ``--model`` of the user's instead of the built-in sizes, without the loaded runs.
    """
    params = QUICK if quick else FULL
    if model:
        params = {"models": {model: HF_STEPS["quick" if quick else "full"]}, "primary": model, "reps": 1}
    work = fresh_dir(work / "overhead")
    quiet = [m for m in METHODS if m not in LOADED]
    plan = [(size, quiet) for size in params["models"]] + ([] if model else [(params["primary"], list(LOADED))])
    rates: dict[tuple[str, str], list[float]] = {}
    snapshots: dict[str, list[Checkpoint]] = {}
    for size, methods in plan:
        steps = params["models"][size]
        for rep, method in interleaved(methods, params["reps"]):
            run_dir = work / f"{_slug(size)}_{method}_{rep}"
            times = run_method(method, size, steps, run_dir, data)
            if len(times) != steps:
                raise RuntimeError(f"overhead benchmark: the {method} run ({size}) failed; see {work}")
            rates.setdefault((method, size), []).append(steps_per_s(times))
            if method == "local_tier":
                snapshots.setdefault(size, []).extend(
                    e for e in select(read_events(run_dir), Checkpoint) if e.tier == "local"
                )
    methods: dict[str, dict] = {}
    for method in METHODS:
        base = BASE[method]
        plain = "plain_loaded" if method in LOADED else "plain"
        models = {}
        for size in params["models"]:
            if (method, size) in rates:
                sps = median(rates[(method, size)])
                models[size] = {
                    "steps_per_s": sps,
                    "ratio": ratio(sps, median(rates[(plain, size)])),
                    "vs_base": ratio(sps, median(rates[(base, size)])) if base else None,
                    "samples": rates[(method, size)],
                }
        if params["primary"] in models:  # (a user's model runs without the loaded methods)
            methods[method] = {**models[params["primary"]], "base": base, "models": models}
    for size, taken in snapshots.items():  # the loop's stall per snapshot, and the write beside it
        methods["local_tier"]["models"][size] |= {
            "stall_ms": 1e3 * median([e.blocking_s for e in taken]),
            "write_ms": 1e3 * median([e.phases.get("write", 0.0) for e in taken]),
        }
    ours, wrapper = methods["resilient"]["ratio"], methods["wrapper"]["ratio"]
    local = {size: m["vs_base"] for size, m in methods["local_tier"]["models"].items()}
    return {
        "benchmark": "overhead",
        "params": {**params, "ranks": 2, "ckpt_every": CKPT_EVERY, "skip": SKIP},
        "methods": methods,
        "overhead": 1 - ours,
        "targets": [
            target("resilience overhead (1 - resilient/plain steps/s) <= 0.02", 1 - ours, 0.02),
            target("stack without checkpoints (wrapper) / plain steps/s >= 0.98", wrapper, 0.98, at_least=True),
            target(
                f"stack with async checkpoints every {CKPT_EVERY} (resilient) / plain >= 0.95",
                ours,
                0.95,
                at_least=True,
            ),
            *(  # step time with the tier <= Nx without it, i.e. steps/s >= 1 / N
                target(
                    f"local tier every step, {size}: steps/s vs resilient >= {1 / limit:.3f} (step time <= {limit}x)",
                    local[size],
                    1 / limit,
                    at_least=True,
                )
                for size, limit in LOCAL_TIER_TARGETS.items()
                if size in local
            ),
        ],
    }


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    sizes = list(p["models"])
    rows = []
    for name, m in result["methods"].items():
        row = [name, m["base"] or "-"]
        for size in sizes:
            s = m["models"].get(size)
            row += (
                [fmt(s["steps_per_s"], digits=2), fmt(s["ratio"], digits=3), fmt(s["vs_base"], digits=3)]
                if s
                else ["", "", ""]
            )
        rows.append(row)
    columns = ["method", "adds to", *(f"{size} {c}" for size in sizes for c in ("steps/s", "vs plain", "vs base"))]
    runs = ", ".join(f"{s} model {n} steps" for s, n in p["models"].items())
    title = f"overhead: {runs}, checkpoint every {p['ckpt_every']}, {p['reps']} rep(s); *_loaded: beside a busy process"
    print_table(title, columns, rows)
    for size, s in result["methods"]["local_tier"]["models"].items():
        if "stall_ms" in s:
            print(
                f"local tier, {size}: the loop's stall {s['stall_ms']:.2f} ms a snapshot (median); "
                f"the write beside the steps {s['write_ms']:.1f} ms"
            )
    print_targets(result["targets"])


def main() -> None:
    """Plain-loop worker entry point (started by torchrun from :func:`run`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    plain_worker(parser.parse_args())


if __name__ == "__main__":
    main()
