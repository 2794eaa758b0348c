"""Goodput under one fault schedule (several faults of each kind, 2 real ranks):

- ``resilient``: our stack (``rfsdp train``: async NVRx checkpoints, in-process restart for
  exceptions, ft_launcher in-job restart for kills and hangs)
- ``baseline``: what a user would otherwise run: the same trainer under ``torchrun
  --max-restarts`` with synchronous DCP checkpoints and no in-process restart

Goodput = the time of the steps that survive into the final trajectory (each step's last
``step_time_s``) / the job's wall time. Both runs must complete every step.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import fmt, fresh_dir, interleaved, median, print_table, print_targets, ratio, run_rfsdp, run_torchrun_trainer, target
from trainer.events import Event, Restart, RunEnd, final_steps, read_events, select, summarize
from trainer.rank.config import TrainConfig

METHODS = ("resilient", "baseline")
FULL = {
    "model": "small",
    "steps": 100,
    "ckpt_every": 10,
    "fault": "exception@14:1,sigkill@27:1,hang@41:1,exception@56:0,sigkill@72:0,hang@87:0",
    "reps": 1,
}
QUICK = {"model": "tiny", "steps": 16, "ckpt_every": 4, "fault": "exception@6:1,sigkill@11:1", "reps": 1}


def measure_goodput(events: list[Event], wall_s: float) -> dict:
    """Goodput of a finished run: its useful time (``trainer.events.summarize``) over the wall
    time of the whole command (start-up included, the same clock for both methods)."""
    s = summarize(events)
    restarts = select(events, Restart)
    return {
        "goodput": s["useful_time_s"] / wall_s,
        "useful_s": s["useful_time_s"],
        "wall_s": wall_s,
        "steps": len(final_steps(events)),
        "executed_steps": s["steps_executed"],
        "faults": s["faults"],
        "restarts": {layer: sum(r.layer == layer for r in restarts) for layer in sorted({r.layer for r in restarts})},
        "recovery_s": sum(r.recovery_s for r in restarts),
        "checkpoint_stall_s": s["ckpt_blocking_s_total"],
    }


def run_one(method: str, run_dir: Path, data: Path, params: dict) -> dict:
    """One run of the fault schedule with ``method``; its goodput figures."""
    fresh_dir(run_dir)
    common = {
        "data": str(data),
        "run_dir": str(run_dir),
        "model": params["model"],
        "steps": params["steps"],
        "ckpt_every": params["ckpt_every"],
    }
    if method == "resilient":
        cfg = TrainConfig(**common, fault=params["fault"])
        hard_faults = sum(f.kind != "exception" for f in cfg.faults)  # the ones in-process restart leaves to ft_launcher
        code, wall = run_rfsdp(cfg, max_restarts=hard_faults + 1)
    else:  # every fault is a process failure for torchrun
        cfg = TrainConfig(**common, fault=params["fault"], ckpt_mode="sync", inprocess_restart=False)
        code, wall = run_torchrun_trainer(cfg, max_restarts=len(cfg.faults) + 1)
    events = read_events(run_dir)
    if code or not any(e.status == "completed" for e in select(events, RunEnd)):
        raise RuntimeError(f"goodput benchmark: the {method} run did not complete (exit {code}); logs in {run_dir / 'logs'}")
    return measure_goodput(events, wall)


def run(quick: bool, work: Path, data: Path) -> dict:
    """Both methods under the same fault schedule, interleaved repetitions."""
    params = QUICK if quick else FULL
    work = fresh_dir(work / "goodput")
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for rep, method in interleaved(METHODS, params["reps"]):
        runs[method].append(run_one(method, work / f"{method}_{rep}", data, params))
    methods = {
        m: {
            "goodput": median([r["goodput"] for r in rs]),
            "wall_s": median([r["wall_s"] for r in rs]),
            "useful_s": median([r["useful_s"] for r in rs]),
            "recovery_s": median([r["recovery_s"] for r in rs]),
            "checkpoint_stall_s": median([r["checkpoint_stall_s"] for r in rs]),
            "runs": rs,
        }
        for m, rs in runs.items()
    }
    for m in methods.values():
        m["ratio"] = ratio(m["goodput"], methods["baseline"]["goodput"])
    return {
        "benchmark": "goodput",
        "params": {**params, "ranks": 2},
        "methods": methods,
        "targets": [target("goodput resilient / baseline >= 1.2", methods["resilient"]["ratio"], 1.2, at_least=True)],
    }


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    rows = []
    for name, m in result["methods"].items():
        r = m["runs"][0]
        restarts = ", ".join(f"{k} {v}" for k, v in r["restarts"].items()) or "-"
        rows.append(
            [
                name,
                fmt(m["goodput"], digits=3),
                fmt(m["ratio"], "x", 2),
                fmt(m["wall_s"], " s", 1),
                fmt(m["useful_s"], " s", 1),
                fmt(m["recovery_s"], " s", 1),
                fmt(m["checkpoint_stall_s"], " s", 2),
                restarts,
            ]
        )
    title = f"goodput: {p['model']} model, {p['steps']} steps, checkpoint every {p['ckpt_every']}, faults {p['fault']}"
    print_table(title, ["method", "goodput", "ratio", "wall", "useful", "recovering", "ckpt stall", "restarts"], rows)
    print_targets(result["targets"])
