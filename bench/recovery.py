"""Recovery time: the same fault at the same step, recovered four ways (2 real ranks, tiny model):

- ``inprocess``: our default stack (``rfsdp train``): NVRx ``inprocess.Wrapper`` inside ft_launcher
- ``ft_injob``: ft_launcher's in-job restart (``rfsdp train``; for an exception with
  ``--no-inprocess-restart`` so that the wrapper does not catch it)
- ``torchrun``: the same trainer under ``torchrun --max-restarts 3``
- ``cold``: the job has no restarts and fails; a new ``rfsdp train`` on the same run dir resumes it

Measured from the run's ``events.jsonl``, the same way for every method: from the ``fault`` event
to the first step completed after it, and the steps lost (completed before the fault, redone after).
A SIGKILL or a hang (a rank blocked inside C) cannot be handled in-process: their ``inprocess``
cells are absent, and ``ft_injob`` is then the default stack (``rfsdp train``), in-process
restart included. A hang has no ``torchrun`` cell: nothing there finds it, and the rank waiting
on the hung one holds the job until its collective's timeout (60 s at the default).
"""

from __future__ import annotations

from pathlib import Path

from bench.common import (
    fault_recoveries,
    fmt,
    fresh_dir,
    interleaved,
    median,
    median_stages,
    print_stages,
    print_table,
    print_targets,
    ratio,
    run_rfsdp,
    run_torchrun_trainer,
    target,
)
from trainer.events import Event, FaultFired, Restart, read_events, select
from trainer.rank.config import TrainConfig

METHODS = ("inprocess", "ft_injob", "torchrun", "cold")
FULL = {"faults": ("exception", "sigkill", "hang"), "reps": 2, "steps": 16, "ckpt_every": 5, "fault_step": 13}
QUICK = {"faults": ("exception",), "reps": 1, "steps": 8, "ckpt_every": 3, "fault_step": 6}
FAULT_RANK = 1  # rank 0 hosts the wrapper's store: losing it always needs the in-job layer


def applies(method: str, fault: str) -> bool:
    """In-process restart recovers soft faults only; torchrun finds no hang."""
    return not ((method == "inprocess" and fault in ("sigkill", "hang")) or (method == "torchrun" and fault == "hang"))


def measure_recovery(events: list[Event]) -> dict:
    """Recovery of the (single) fault in a run's events (see :func:`bench.common.fault_recoveries`),
    and the restarts before it.
    """
    fault = select(events, FaultFired)[0]
    return {
        **fault_recoveries(events)[0],
        # Restarts before the injected fault: a step so slow on a loaded machine that a timeout fired.
        "spurious_restarts": sum(e.time < fault.time for e in select(events, Restart)),
    }


def run_one(method: str, fault: str, run_dir: Path, data: Path, params: dict) -> dict:
    """One run with one fault, recovered by ``method``; returns its measured recovery."""
    fresh_dir(run_dir)
    cfg = TrainConfig(
        data=str(data),
        run_dir=str(run_dir),
        model="tiny",
        steps=params["steps"],
        ckpt_every=params["ckpt_every"],
        fault=f"{fault}@{params['fault_step']}:{FAULT_RANK}",
        # The wrapper would catch the exception before ft_launcher or torchrun could see it.
        inprocess_restart=method == "inprocess" or (method == "ft_injob" and fault != "exception"),
    )
    if method == "torchrun":
        code, _ = run_torchrun_trainer(cfg, max_restarts=3)
    elif method == "cold":
        code, _ = run_rfsdp(cfg, max_restarts=0)
        if code == 0 or not select(read_events(run_dir), FaultFired):
            raise RuntimeError(
                f"cold: the first job did not die of the injected {fault} (exit {code}); logs in {run_dir / 'logs'}"
            )
        code, _ = run_rfsdp(cfg, max_restarts=0)  # the user starts it again: it resumes
    else:
        code, _ = run_rfsdp(cfg, max_restarts=3)
    if code:
        raise RuntimeError(
            f"recovery benchmark: {method} with {fault} failed (exit {code}); logs in {run_dir / 'logs'}"
        )
    return measure_recovery(read_events(run_dir))


def run(quick: bool, work: Path, data: Path) -> dict:
    """Every (fault, method) pair in interleaved repetitions; medians per pair."""
    params = QUICK if quick else FULL
    work = fresh_dir(work / "recovery")
    samples: dict[tuple[str, str], list[dict]] = {}
    for rep, method in interleaved(METHODS, params["reps"]):
        for fault in params["faults"]:
            if applies(method, fault):
                samples.setdefault((method, fault), []).append(
                    run_one(method, fault, work / f"{method}_{fault}_{rep}", data, params)
                )
    methods: dict[str, dict] = {m: {} for m in METHODS}
    for (method, fault), runs in samples.items():
        methods[method][fault] = {
            "recovery_s": median([r["recovery_s"] for r in runs]),
            "lost_steps": median([r["lost_steps"] for r in runs]),
            "layer": runs[0]["layer"],
            "spurious_restarts": sum(r["spurious_restarts"] for r in runs),
            "phases": median_stages([r["phases"] for r in runs]),  # when each stage of the recovery ended
            "runs": runs,
        }
    for fault in params["faults"]:
        cold = methods["cold"][fault]["recovery_s"]
        for method in METHODS:
            if fault in methods[method]:
                methods[method][fault]["ratio_vs_cold"] = ratio(methods[method][fault]["recovery_s"], cold)
    exc = {m: methods[m].get("exception", {}) for m in METHODS}
    targets = [
        target(
            "in-process / in-job recovery (exception) < 1",
            ratio(exc["inprocess"].get("recovery_s"), exc["ft_injob"].get("recovery_s")),
            1.0,
        ),
        target("in-process recovery / cold restart <= 0.25", exc["inprocess"].get("ratio_vs_cold"), 0.25),
    ]
    for fault in (f for f in params["faults"] if f != "hang"):  # a hang's cold restart waits for its watch too
        targets.append(
            target(
                f"in-job recovery / cold restart ({fault}) <= 0.25", methods["ft_injob"][fault]["ratio_vs_cold"], 0.25
            )
        )
    if "hang" in params["faults"]:  # found by the step watch at the run's pace (docs/recovery.md, "Hangs")
        hang = methods["ft_injob"]["hang"]
        targets.append(target("hang: fault -> next step <= 3 s (default stack)", hang["recovery_s"], 3.0))
        targets.append(target("hang: steps lost <= 1 (default stack)", hang["lost_steps"], 1.0))
    return {
        "benchmark": "recovery",
        "params": {**params, "model": "tiny", "ranks": 2, "fault_rank": FAULT_RANK, "ckpt_mode": "async"},
        "methods": methods,
        "targets": targets,
    }


def show(result: dict) -> None:
    """Print the result as a table and the targets under it."""
    p = result["params"]
    rows = []
    for fault in p["faults"]:
        for method, per_fault in result["methods"].items():
            if fault in per_fault:
                r = per_fault[fault]
                rows.append(
                    [
                        f"{fault}: {method}",
                        r["layer"],
                        fmt(r["recovery_s"], " s", 2),
                        fmt(r["ratio_vs_cold"], digits=2),
                        fmt(r["lost_steps"], digits=0),
                        str(r["spurious_restarts"]),
                    ]
                )
    title = (
        f"recovery: fault at step {p['fault_step']} on rank {p['fault_rank']}, checkpoint every {p['ckpt_every']}, "
        f"{p['reps']} rep(s)"
    )
    print_table(
        title, ["fault: method", "layer", "fault -> next step", "vs cold", "steps lost", "spurious restarts"], rows
    )
    timelines = [
        (f"{f}: {m}", per[f]["phases"])
        for f in p["faults"]
        for m, per in result["methods"].items()
        if per.get(f, {}).get("phases")
    ]
    print_stages("recovery: when each stage ended (s after the fault, median; rank 0's restart event)", timelines)
    print_targets(result["targets"])
