"""Goodput under one fault schedule (several faults of each kind, 2 real ranks):

- ``resilient``: our stack (``rfsdp train``: async NVRx checkpoints, in-process restart for
  exceptions, ft_launcher in-job restart for kills and hangs)
- ``baseline``: what a user would otherwise run: the same trainer under ``torchrun
  --max-restarts`` with synchronous DCP checkpoints and no in-process restart
- ``resilient_local`` (the soak's third method): our stack with the local tier as well
  (``--local-ckpt-every 1``); the other two have it off, whatever the default

Goodput = the time of the steps that survive into the final trajectory (each step's last
``step_time_s``) / the job's wall time; a method whose steps are slower gains goodput by it, so
the wall times of the same steps and faults are compared beside it (``wall_ratio``). ETTR
(effective training time ratio) = the wall time in which the job made progress it kept (between
consecutive completions of surviving steps, so the loop's own bookkeeping and checkpoint stalls
count; start-up, recovery and redone steps do not) / the job's wall time. Both runs must
complete every step. :func:`compare` is shared with ``bench.soak``, which runs the same
comparison under a longer, calibrated schedule.
"""

from __future__ import annotations

from pathlib import Path

from bench.audit import audit_run
from bench.common import (
    fault_recoveries,
    fmt,
    fresh_dir,
    interleaved,
    median,
    print_table,
    print_targets,
    ratio,
    run_rfsdp,
    run_torchrun_trainer,
    target,
)
from trainer.events import (
    Event,
    FaultFired,
    Restart,
    RunEnd,
    RunStart,
    Step,
    final_steps,
    read_events,
    select,
    summarize,
)
from trainer.rank.config import TrainConfig

METHODS = ("resilient", "baseline")
LOCAL_EVERY = {"resilient": 0, "resilient_local": 1, "baseline": 0}
"""Each method's local tier (``--local-ckpt-every``; 0: off)."""
FULL = {
    "model": "small",
    "steps": 100,
    "ckpt_every": 10,
    "fault": "exception@14:1,sigkill@27:1,hang@41:1,exception@56:0,sigkill@72:0,hang@87:0",
    "reps": 1,
}
QUICK = {"model": "tiny", "steps": 16, "ckpt_every": 4, "fault": "exception@6:1,sigkill@11:1", "reps": 1}
CONFIG_PARAMS = ("model", "steps", "ckpt_every", "seed", "hang_timeout", "keep_last")
"""The ``params`` entries that are passed on to the trainer (the same for both methods)."""


def step_wall_times(events: list[Event]) -> tuple[float, float]:
    """Wall seconds spent in steps, as ``(kept, lost)``: kept for the steps of the final trajectory
    (each step's last ``step`` event), lost for the steps done before a fault and redone after it.

    A step's wall time is the time since the step completed just before it, when that was the
    previous step of the same attempt; the first step of a start or of a recovery (after a
    ``fault`` or ``run_start``; ``restart`` is written just after its first step) has no such
    predecessor and counts its own ``step_time_s``.
    """
    final = {id(e) for e in final_steps(events).values()}
    entries: list[list] = []  # [step event, first of its attempt]
    fresh = True
    for e in events:
        if isinstance(e, FaultFired | RunStart):
            fresh = True
        elif isinstance(e, Restart) and entries:
            entries[-1][1] = True
        elif isinstance(e, Step):
            entries.append([e, fresh])
            fresh = False
    kept = lost = 0.0
    for i, (e, first) in enumerate(entries):
        prev = entries[i - 1][0] if i else None
        t = e.step_time_s if first or prev is None or prev.step != e.step - 1 else e.time - prev.time
        if id(e) in final:
            kept += t
        else:
            lost += t
    return kept, lost


def measure_goodput(events: list[Event], wall_s: float) -> dict:
    """Goodput of a finished run: its useful time (``trainer.events.summarize``) over the wall
    time of the whole command (start-up included, the same clock for both methods); its ETTR
    (kept step wall time, :func:`step_wall_times`, over the same wall time); each fault's recovery
    and lost steps; and where the wall time went (``*_s``: kept and lost step time, recovering
    from faults, start-up + exit, and what none of them covers).
    """
    s = summarize(events)
    restarts = select(events, Restart)
    per_fault = fault_recoveries(events)
    kept, lost = step_wall_times(events)
    steps = select(events, Step)
    recovering = sum(f["recovery_s"] for f in per_fault)
    # Outside the events' span: the command's start (launcher, interpreters, imports, model
    # build) before the first step began, and its exit after the last event.
    start_exit = wall_s - (max(e.time for e in events) - (steps[0].time - steps[0].step_time_s))
    return {
        "goodput": s["useful_time_s"] / wall_s,
        "ettr": kept / wall_s,
        "useful_s": s["useful_time_s"],
        "wall_s": wall_s,
        "steps": len(final_steps(events)),
        "executed_steps": s["steps_executed"],
        "faults": s["faults"],
        "restarts": {layer: sum(r.layer == layer for r in restarts) for layer in sorted({r.layer for r in restarts})},
        "recovery_s": sum(r.recovery_s for r in restarts),
        "lost_steps": sum(f["lost_steps"] for f in per_fault),
        "per_fault": per_fault,
        "checkpoint_stall_s": s["ckpt_blocking_s_total"],
        "kept_step_s": kept,
        "lost_step_s": lost,
        "recovering_s": recovering,
        "start_exit_s": start_exit,
        "other_s": wall_s - kept - lost - recovering - start_exit,
    }


def run_one(method: str, run_dir: Path, data: Path, params: dict) -> dict:
    """One run of the fault schedule with ``method``; its goodput figures (with ``params``'
    ``audit``, also its checkpoints' audit: :func:`bench.audit.audit_run`)."""
    fresh_dir(run_dir)
    common = {k: params[k] for k in CONFIG_PARAMS if k in params} | {"local_ckpt_every": LOCAL_EVERY[method]}
    if method != "baseline":
        cfg = TrainConfig(data=str(data), run_dir=str(run_dir), **common, fault=params["fault"])
        hard_faults = sum(
            f.kind != "exception" for f in cfg.faults
        )  # the ones in-process restart leaves to ft_launcher
        code, wall = run_rfsdp(cfg, max_restarts=hard_faults + 1)
    else:  # every fault is a process failure for torchrun
        cfg = TrainConfig(
            data=str(data),
            run_dir=str(run_dir),
            **common,
            fault=params["fault"],
            ckpt_mode="sync",
            inprocess_restart=False,
        )
        code, wall = run_torchrun_trainer(cfg, max_restarts=len(cfg.faults) + 1, timeout=params.get("timeout_s", 1800))
    events = read_events(run_dir)
    if code or not any(e.status == "completed" for e in select(events, RunEnd)):
        raise RuntimeError(
            f"{params.get('benchmark', 'goodput')} benchmark: the {method} run did not complete (exit {code}); "
            f"logs in {run_dir / 'logs'}"
        )
    result = measure_goodput(events, wall)
    if params.get("audit"):  # after the run: the audit takes none of its time (bench.audit)
        result["audit"] = audit_run(run_dir)
    return result


def compare(params: dict, work: Path, data: Path, methods: tuple[str, ...] = METHODS) -> dict[str, dict]:
    """``methods`` under ``params``'s fault schedule in interleaved repetitions, run dirs under
    ``work``: per method the medians of the figures, the runs, and the goodput ratio to the baseline.
    """
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for rep, method in interleaved(methods, params["reps"]):
        runs[method].append(run_one(method, work / f"{method}_{rep}", data, params))
    figures = (
        "goodput",
        "ettr",
        "wall_s",
        "useful_s",
        "recovery_s",
        "lost_steps",
        "checkpoint_stall_s",
        "kept_step_s",
        "lost_step_s",
        "recovering_s",
        "start_exit_s",
        "other_s",
    )
    out = {m: {**{k: median([r[k] for r in rs]) for k in figures}, "runs": rs} for m, rs in runs.items()}
    for m in out.values():
        m["ratio"] = ratio(m["goodput"], out["baseline"]["goodput"])
        m["wall_ratio"] = ratio(
            out["baseline"]["wall_s"], m["wall_s"]
        )  # the same steps and faults: how much sooner it finished
    return out


def run(quick: bool, work: Path, data: Path) -> dict:
    """Both methods under the same fault schedule, interleaved repetitions."""
    params = QUICK if quick else FULL
    methods = compare(params, fresh_dir(work / "goodput"), data)
    return {
        "benchmark": "goodput",
        "params": {**params, "ranks": 2},
        "methods": methods,
        "targets": [target("goodput resilient / baseline >= 1.2", methods["resilient"]["ratio"], 1.2, at_least=True)],
    }


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    title = f"goodput: {p['model']} model, {p['steps']} steps, checkpoint every {p['ckpt_every']}, faults {p['fault']}"
    show_methods(title, result["methods"])
    print_targets(result["targets"])
    print_wall_ratios(result["methods"])


def print_wall_ratios(methods: dict[str, dict], *, against: str = "baseline") -> None:
    """Each method's wall time against ``against``'s for the same steps and faults, beside the
    goodput ratios: goodput counts each kept step's own time, so a method whose steps are slower
    (a background write beside them) gains goodput by it; the wall time is what a user waits.
    """
    ref = methods[against]
    for name, m in methods.items():
        if name != against:
            print(
                f"  same steps and faults: {name} finished in {fmt(m['wall_s'], ' s', 1)} against {against}'s "
                f"{fmt(ref['wall_s'], ' s', 1)}: {fmt(ratio(ref['wall_s'], m['wall_s']), 'x', 3)} sooner "
                f"(its kept steps took {fmt(m['kept_step_s'], ' s', 1)}, "
                f"{against}'s {fmt(ref['kept_step_s'], ' s', 1)})"
            )


def show_methods(title: str, methods: dict[str, dict]) -> None:
    """The per-method table of :func:`compare`'s result (the first run's restarts)."""
    rows = []
    for name, m in methods.items():
        r = m["runs"][0]
        restarts = ", ".join(f"{k} {v}" for k, v in r["restarts"].items()) or "-"
        rows.append(
            [
                name,
                fmt(m["goodput"], digits=3),
                fmt(m["ratio"], "x", 2),
                fmt(m["ettr"], digits=3),
                fmt(m["wall_s"], " s", 1),
                fmt(m["useful_s"], " s", 1),
                fmt(m["recovery_s"], " s", 1),
                fmt(m["lost_steps"], digits=0),
                fmt(m["checkpoint_stall_s"], " s", 2),
                restarts,
            ]
        )
    columns = [
        "method",
        "goodput",
        "ratio",
        "ETTR",
        "wall",
        "useful",
        "recovering",
        "steps redone",
        "ckpt stall",
        "restarts",
    ]
    print_table(title, columns, rows)
