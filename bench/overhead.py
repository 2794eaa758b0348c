"""Resilience overhead with no faults: steps/s of the full stack (``rfsdp train``: ft_launcher
heartbeats, the in-process wrapper, async checkpoints at the default interval, event logging)
against a plain FSDP loop with no checkpoints (the same model, data, optimizer and step function
under torchrun), in interleaved repetitions.

Throughput is taken between step completions on rank 0 after the first ``SKIP`` steps, so process
start-up (a one-time cost, different for each launcher) is left out of both.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import fmt, fresh_dir, interleaved, median, print_table, print_targets, ratio, run_rfsdp, run_torchrun, target
from trainer.data.shards import TokenLoader, load_split
from trainer.events import Step, read_events, select
from trainer.rank.config import TrainConfig
from trainer.rank.resilience import RankMonitor
from trainer.rank.runtime import build_fsdp_model, detect_runtime, init_process_group
from trainer.rank.train import TrainState, lr_at, train_step

METHODS = ("resilient", "plain")
FULL = {"model": "small", "steps": 30, "reps": 3}
QUICK = {"model": "tiny", "steps": 12, "reps": 1}
SKIP = 2  # warm-up steps left out of the throughput


def steps_per_s(times: list[float]) -> float:
    """Steps per second between the completion times of consecutive steps (after the warm-up)."""
    times = times[SKIP:]
    return (len(times) - 1) / (times[-1] - times[0])


def plain_worker(args: argparse.Namespace) -> None:
    """One rank of the plain loop: the trainer's step function, nothing else."""
    cfg = TrainConfig(data=args.data, run_dir=args.out, model=args.model, steps=args.steps)
    rt = detect_runtime()
    init_process_group(rt, None, timeout_s=600)
    model = build_fsdp_model(cfg.size, rt, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    loader = TokenLoader(load_split(Path(cfg.data), "train"), cfg.size.seq_len, cfg.batch_size, rt.rank, rt.world_size)
    state = TrainState(model, optimizer, loader, RankMonitor(), dist.group.WORLD)
    times = []
    for step in range(1, cfg.steps + 1):
        train_step(state, lr_at(cfg, step), cfg.grad_clip, rt.device)
        times.append(time.time())
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run(quick: bool, work: Path, data: Path) -> dict:
    """Both methods in interleaved repetitions; median steps/s and their ratio."""
    params = QUICK if quick else FULL
    work = fresh_dir(work / "overhead")
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep, method in interleaved(METHODS, params["reps"]):
        if method == "resilient":
            cfg = TrainConfig(
                data=str(data), run_dir=str(fresh_dir(work / f"resilient_{rep}")), model=params["model"], steps=params["steps"]
            )
            code, _ = run_rfsdp(cfg)
            times = [e.time for e in select(read_events(Path(cfg.run_dir)), Step)]
        else:
            out = work / f"plain_{rep}.json"
            argv = ["--data", str(data), "--model", params["model"], "--steps", str(params["steps"]), "--out", str(out)]
            code, _ = run_torchrun("bench.overhead", argv, work / f"plain_{rep}.log")
            times = json.loads(out.read_text()) if out.exists() else []
        if code or len(times) != params["steps"]:
            raise RuntimeError(f"overhead benchmark: the {method} run failed (exit {code}); see {work}")
        rates[method].append(steps_per_s(times))
    ours, plain = median(rates["resilient"]), median(rates["plain"])
    overhead = 1 - ratio(ours, plain)
    methods = {
        "resilient": {"steps_per_s": ours, "ratio": ratio(ours, plain), "samples": rates["resilient"]},
        "plain": {"steps_per_s": plain, "ratio": 1.0, "samples": rates["plain"]},
    }
    return {
        "benchmark": "overhead",
        "params": {**params, "ranks": 2, "ckpt_every": TrainConfig.__dataclass_fields__["ckpt_every"].default, "skip": SKIP},
        "methods": methods,
        "overhead": overhead,
        "targets": [target("resilience overhead (1 - resilient/plain steps/s) <= 0.02", overhead, 0.02)],
    }


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    rows = [
        [name, fmt(m["steps_per_s"], digits=2), fmt(m["ratio"], digits=3), str(len(m["samples"]))] for name, m in result["methods"].items()
    ]
    title = f"overhead: {p['model']} model, {p['steps']} steps, async checkpoint every {p['ckpt_every']}, {p['reps']} rep(s)"
    print_table(title, ["method", "steps/s (median)", "vs plain", "runs"], rows)
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
