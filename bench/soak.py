"""Goodput soak: a long run under a fault every ~T seconds (exception, SIGKILL, hang in turn, on
ranks 0 and 1 alternately; tiny model, 2 real ranks), our stack against the baseline, the same
comparison as ``bench.goodput`` (:func:`bench.goodput.compare`: ``resilient`` = ``rfsdp train``,
``baseline`` = torchrun + synchronous DCP, no in-process restart) with the same seed and the same
fault schedule in steps, and a third method, ``resilient_local``: our stack with the local tier
(a snapshot in memory every step), whose goodput is held against the single-tier stack's.

Faults are scheduled by step, so T is turned into a step interval by measurement: a calibration
run of our stack without faults (checkpointing only at its end) gives the wall time per step
(between consecutive step completions in its events, after a warm-up), and the interval is
T / that, rounded to a whole number of checkpoint intervals (``CKPTS_PER_INTERVAL`` by default:
fewer model a schedule where durable checkpoints are dear, as at scale), and each fault fires in
the middle of a checkpoint interval (the expected loss of a fault at a random time), both the same
for both methods. Per method: goodput, ETTR, lost steps per fault, restarts by layer, wall time
and where it went; per fault kind: recovery time and the recovery's stages (from ``restart``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench.audit import combine, keep_every_save
from bench.common import (
    fmt,
    fresh_dir,
    median_stages,
    print_stages,
    print_table,
    print_targets,
    ratio,
    run_rfsdp,
    target,
)
from bench.goodput import compare, print_wall_ratios, show_methods
from trainer.events import Step, read_events, select
from trainer.rank.config import TrainConfig

KINDS = ("exception", "sigkill", "hang")
METHODS = ("resilient", "resilient_local", "baseline")
CKPTS_PER_INTERVAL = 12
"""Durable checkpoints per fault interval by default (every 5 s at a fault every 60 s)."""
SKIP = 5
"""Warm-up steps of the calibration run left out of the step time."""
FULL = {"model": "tiny", "fault_every_s": 60.0, "faults": 6, "calibration_steps": 300, "seed": 0, "reps": 1}
QUICK = {"model": "tiny", "fault_every_s": 1.0, "faults": 2, "calibration_steps": 60, "seed": 0, "reps": 1}
MIN_FAULT_EVERY_S = 1.0


def check_fault_every(seconds: float) -> float:
    """``seconds`` if it is a usable fault interval.

    Raises:
        ValueError: not a finite number of at least ``MIN_FAULT_EVERY_S`` seconds.
    """
    if not (math.isfinite(seconds) and seconds >= MIN_FAULT_EVERY_S):
        raise ValueError(f"must be a number of seconds >= {MIN_FAULT_EVERY_S:g}, got {seconds:g}")
    return seconds


def check_ckpts_per_fault(count: int) -> int:
    """``count`` if it is a usable number of durable checkpoints per fault interval.

    Raises:
        ValueError: less than 1.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"must be a whole number >= 1, got {count}")
    return count


def schedule(interval: int, ckpt_every: int, faults: int) -> tuple[int, str]:
    """The run's length in steps and its fault spec: fault ``i`` (from 1) at step
    ``i * interval + ckpt_every // 2``, its kind ``KINDS`` in turn, on rank 0, 1, 0, ...
    """
    items = [f"{KINDS[i % len(KINDS)]}@{(i + 1) * interval + ckpt_every // 2}:{i % 2}" for i in range(faults)]
    return (faults + 1) * interval, ",".join(items)


def calibrate(work: Path, data: Path, params: dict) -> dict:
    """Our stack without faults: the wall seconds per step between step completions."""
    run_dir = fresh_dir(work / "calibration")
    steps = params["calibration_steps"]
    cfg = TrainConfig(
        data=str(data),
        run_dir=str(run_dir),
        model=params["model"],
        steps=steps,
        ckpt_every=steps,
        seed=params["seed"],
        local_ckpt_every=0,
    )
    code, _ = run_rfsdp(cfg)
    times = [e.time for e in select(read_events(run_dir), Step)]
    if code or len(times) != steps:
        raise RuntimeError(f"soak benchmark: the calibration run failed (exit {code}); logs in {run_dir / 'logs'}")
    return {
        "step_wall_s": (times[-1] - times[SKIP]) / (steps - 1 - SKIP),
        "step_time_s": statistics.median(e.step_time_s for e in select(read_events(run_dir), Step)[SKIP:]),
    }


def run(
    quick: bool,
    work: Path,
    data: Path,
    fault_every: float | None = None,
    ckpts_per_fault: int | None = None,
    audit: bool = False,
) -> dict:
    """Calibrate, then every method under the same schedule of faults every ``fault_every`` s,
    with ``ckpts_per_fault`` durable checkpoints between two faults. With ``audit``, every
    checkpoint each run publishes is kept and audited against its ranks' shard digests once
    the run has ended (:mod:`bench.audit`): saves audited, mismatches, the digests' cost per save.
    """
    params = dict(QUICK if quick else FULL, ckpts_per_fault=CKPTS_PER_INTERVAL)
    if fault_every is not None:
        params["fault_every_s"] = check_fault_every(fault_every)
    if ckpts_per_fault is not None:
        params["ckpts_per_fault"] = check_ckpts_per_fault(ckpts_per_fault)
    work = fresh_dir(work / "soak")
    calibration = calibrate(work, data, params)
    # A whole number of checkpoint intervals between faults, so that every fault is as far from
    # its last checkpoint as the others.
    ckpt_every = max(2, round(params["fault_every_s"] / calibration["step_wall_s"] / params["ckpts_per_fault"]))
    interval = ckpt_every * params["ckpts_per_fault"]
    steps, fault = schedule(interval, ckpt_every, params["faults"])
    params |= {
        "benchmark": "soak",
        "calibration": calibration,
        "fault_interval_steps": interval,
        "ckpt_every": ckpt_every,
        "steps": steps,
        "fault": fault,
        "ranks": 2,
        # The baseline waits out gloo's collective timeout at each hang: room for all of them.
        "timeout_s": 1800 + 4 * steps * calibration["step_wall_s"],
    }
    if audit:
        params |= {"audit": True, "keep_last": keep_every_save(steps, ckpt_every)}
    methods = compare(params, work, data, METHODS)
    ours, two_tier = methods["resilient"], methods["resilient_local"]
    two_tier["vs_single_tier"] = ratio(two_tier["goodput"], ours["goodput"])
    two_tier["wall_vs_single_tier"] = ratio(ours["wall_s"], two_tier["wall_s"])
    # The most the local tier can give in this schedule: the single tier's run without the wall
    # time of its redone steps (a free tier that loses nothing) -- a ceiling for the 1.2x target.
    two_tier["ceiling_vs_single_tier"] = ratio(ours["wall_s"], ours["wall_s"] - ours["lost_step_s"])
    audited = (
        {"all": combine([r["audit"] for m in methods.values() for r in m["runs"]])}
        | {name: combine([r["audit"] for r in m["runs"]]) for name, m in methods.items()}
        if audit
        else None
    )
    return {
        "benchmark": "soak",
        "params": params,
        "methods": methods,
        "per_kind": per_kind(methods),
        "audit": audited,
        "targets": ([target("soak audit: mismatches == 0", audited["all"]["mismatches"], 0)] if audit else [])
        + [
            target("soak goodput resilient / baseline >= 1.5", ours["ratio"], 1.5, at_least=True),
            target(
                "soak goodput resilient >= 0.7 (meaningful at a fault every 60 s, tiny model)",
                ours["goodput"],
                0.7,
                at_least=True,
            ),
            target("soak goodput resilient_local / resilient >= 1.2", two_tier["vs_single_tier"], 1.2, at_least=True),
        ],
    }


def per_kind(methods: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Per method and fault kind, over every fault of that kind in every run: the median recovery
    time, the mean lost steps, the layers that recovered, the tiers resumed from, and the median time after the fault at
    which each stage of the recovery ended (stages of the ``restart`` events that have them).
    """
    out: dict[str, dict[str, dict]] = {}
    for name, m in methods.items():
        faults = [f for r in m["runs"] for f in r["per_fault"]]
        for kind in KINDS:
            fs = [f for f in faults if f["kind"] == kind]
            if not fs:
                continue
            out.setdefault(name, {})[kind] = {
                "faults": len(fs),
                "recovery_s": statistics.median(f["recovery_s"] for f in fs),
                "lost_steps": statistics.fmean(f["lost_steps"] for f in fs),
                "layers": sorted({f["layer"] for f in fs}),
                "sources": sorted({f["source"] for f in fs}),
                "phases": median_stages([f["phases"] for f in fs]),
            }
    return out


def show(result: dict) -> None:
    """Print the per-method table, the per-fault-kind tables and the targets."""
    p = result["params"]
    c = p["calibration"]
    title = (
        f"soak: {p['model']} model, a fault every {p['fault_every_s']:g} s = {p['fault_interval_steps']} steps "
        f"(calibrated {c['step_wall_s'] * 1000:.1f} ms/step), {p['steps']} steps, checkpoint every {p['ckpt_every']} "
        f"({p['ckpts_per_fault']} per fault interval)"
    )
    show_methods(title, result["methods"])
    kinds = [(f"{kind}: {name}", k) for name, per in result["per_kind"].items() for kind, k in per.items()]
    rows = [
        [label, str(k["faults"]), "/".join(k["layers"]), "/".join(k["sources"])]
        + [fmt(k["recovery_s"], " s", 1), fmt(k["lost_steps"], digits=1)]
        for label, k in kinds
    ]
    columns = ["fault: method", "faults", "layer", "resumed from", "fault -> next step", "steps lost"]
    print_table("soak: per fault kind", columns, rows)
    print_stages(
        "soak: when each recovery stage ended (s after the fault, median)", [(label, k["phases"]) for label, k in kinds]
    )
    if result.get("audit"):
        show_audit(result["audit"])
    print_targets(result["targets"])
    print_wall_ratios({k: v for k, v in result["methods"].items() if k != "resilient_local"})
    print_wall_ratios({k: v for k, v in result["methods"].items() if k != "baseline"}, against="resilient")
    two_tier = result["methods"]["resilient_local"]
    print(
        f"  the local tier's ceiling here: {fmt(two_tier['ceiling_vs_single_tier'], 'x', 3)} "
        "of the single tier's goodput "
        f"(its redone steps' {fmt(result['methods']['resilient']['lost_step_s'], ' s', 1)} removed at no cost)"
    )


def show_audit(audited: dict[str, dict]) -> None:
    """The audit's table: per method and in all, saves published and audited, mismatches, and
    the ranks' recorded digest seconds per save (the slowest rank's; all ranks' together).
    """
    rows = []
    for name, a in audited.items():
        cost, cpu = a["digest_s"] or {}, a["digest_cpu_s"] or {}
        rows.append(
            [name, str(a["saves_published"]), str(a["saves_audited"]), str(a["not_audited"] + len(a["unreadable"]))]
            + [str(a["mismatches"]), fmt(cost.get("mean"), " s", 4), fmt(cost.get("max"), " s", 4)]
            + [fmt(cpu.get("mean"), " s", 4)]
        )
    columns = ["method", "published", "audited", "not audited", "mismatches", "digest/save", "max", "all ranks"]
    print_table("soak --audit: every published checkpoint against its ranks' shard digests", columns, rows)
    for line in audited["all"]["mismatched"]:
        print(f"  stale or wrong shard: {line}")
    if audited["all"]["rejected_at_resume"]:
        print(f"  set aside at a resume for a stale shard: steps {audited['all']['rejected_at_resume']}")
