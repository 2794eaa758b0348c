"""Pure transforms of a run's events into what MLflow stores: tables, metric points, params.

No MLflow here (an import-linter contract holds it): :mod:`trainer.results.compare` reuses these
on events it downloads back from MLflow, and the summary figures come from
:func:`trainer.events.summarize`, so the logged metrics and the comparison notebook can never
disagree.
"""

from __future__ import annotations

from trainer.events import (
    Checkpoint,
    CheckpointFailed,
    Event,
    FaultFired,
    Restart,
    RunStart,
    Step,
    SystemSample,
    restarts_with_faults,
    select,
    summarize,
)

# Config fields that describe one invocation rather than the run (a resumed run may differ).
_SESSION_FIELDS = ("stop_at_step",)
_TIER_PREFIX = {"durable": "", "local": "local_"}  # ckpt_* stays the durable tier's (as summarize's figures)


def restart_table(events: list[Event]) -> dict[str, list]:
    """One row per ``restart`` event, with the ``fault`` that caused it (if one was injected).

    Returns:
        Column name -> values (the shape ``MlflowClient.log_table`` takes).
    """
    pairs = restarts_with_faults(events)
    return {
        "time": [r.time for r, _ in pairs],
        "layer": [r.layer for r, _ in pairs],
        "attempt": [r.attempt for r, _ in pairs],
        "resumed_from_step": [r.resumed_from_step for r, _ in pairs],
        "lost_steps": [r.lost_steps for r, _ in pairs],
        "recovery_s": [r.recovery_s for r, _ in pairs],
        "fault_kind": [f.kind if f else None for _, f in pairs],
        "fault_step": [f.step if f else None for _, f in pairs],
        "fault_rank": [f.rank if f else None for _, f in pairs],
        "source": [r.source for r, _ in pairs],
    }


def checkpoint_table(events: list[Event]) -> dict[str, list]:
    """One row per published checkpoint and complete local snapshot (``checkpoint`` event, its
    ``tier``), with its write throughput.
    """
    ckpts = select(events, Checkpoint)
    return {
        "time": [c.time for c in ckpts],
        "step": [c.step for c in ckpts],
        "tier": [c.tier for c in ckpts],
        "mode": [c.mode for c in ckpts],
        "blocking_s": [c.blocking_s for c in ckpts],
        "total_s": [c.total_s for c in ckpts],
        "bytes": [c.bytes for c in ckpts],
        "write_mb_s": [c.write_mb_s for c in ckpts],
    }


def metric_points(
    events: list[Event], *, totals: bool = True, done_before: int = 0, origin: float | None = None
) -> list[tuple[str, float, int, int]]:
    """Every metric point of a run as ``(key, value, timestamp_ms, step)``, deterministic.

    Timestamps are the events' own times, so logging the same events twice yields identical
    points (which MLflow's SQL stores drop as duplicates). Per-step points use the training step
    (a re-executed step appears twice, at its two times); checkpoint points the checkpointed
    step (a local snapshot's keys start with ``local_``); restart points the restart attempt
    (``restart_lost_steps_<tier>``: the steps lost by each recovery from that tier); fault
    points their order; summary points step 0 at the time of the last event. A step done
    again after a recovery also gets a ``redone_step`` point (1.0) at its step. Without
    ``totals`` (a part of the log, while the run goes on) the points that need the whole log are
    left out: fault points and the summary; ``done_before`` is then the highest step of the part
    before, and ``origin`` the time of the run's first event. System samples are
    ``system/node_<N>/<name>`` points (MLflow's layout for several nodes) at the whole seconds
    since ``origin`` (default: the first event's time).
    """
    points: list[tuple[str, float, int, int]] = []
    origin = events[0].time if origin is None and events else origin
    n_faults = 0
    for e in events:
        ts = int(e.time * 1000)
        if isinstance(e, Step):
            points += [("loss", e.loss, ts, e.step), ("step_time_s", e.step_time_s, ts, e.step)]
            if e.step <= done_before:
                points.append(("redone_step", 1.0, ts, e.step))
            done_before = max(done_before, e.step)
            if e.step_time_s > 0 and e.tokens:
                points.append(("tokens_per_s", e.tokens / e.step_time_s, ts, e.step))
        elif isinstance(e, Checkpoint):
            for key, value in (
                ("blocking_s", e.blocking_s),
                ("total_s", e.total_s),
                ("bytes", e.bytes),
                ("write_mb_s", e.write_mb_s),
            ):
                points.append((f"{_TIER_PREFIX[e.tier]}ckpt_{key}", value, ts, e.step))
        elif isinstance(e, CheckpointFailed):
            points.append((f"{_TIER_PREFIX[e.tier]}ckpt_failed_step", e.step, ts, e.step))
        elif isinstance(e, FaultFired) and totals:
            n_faults += 1
            points.append(("fault_step", e.step, ts, n_faults))
        elif isinstance(e, Restart):
            for key, value in (
                ("recovery_s", e.recovery_s),
                ("lost_steps", e.lost_steps),
                ("resumed_from_step", e.resumed_from_step),
            ):
                points.append((f"restart_{key}", value, ts, e.attempt))
            points.append((f"restart_{e.layer}_recovery_s", e.recovery_s, ts, e.attempt))
            points.append((f"restart_lost_steps_{e.source}", e.lost_steps, ts, e.attempt))  # by the tier resumed from
        elif isinstance(e, SystemSample):
            points += [(f"system/node_{e.node}/{k}", v, ts, int(e.time - origin)) for k, v in e.metrics.items()]
    if events and totals:
        end = int(events[-1].time * 1000)
        points += [(k, float(v), end, 0) for k, v in summarize(events).items() if v is not None]
    return points


def run_params(events: list[Event], tags: dict[str, str] | None = None) -> dict[str, str]:
    """MLflow params: the first session's training config, fault schedule, backend, world size.

    Args:
        events: the run's events (the first ``run_start`` carries the config).
        tags: the pass-through tags; ``backend`` there names the job backend (the pipeline's
            ``local`` or ``kubernetes``); ``rfsdp train`` alone runs locally.
    """
    start = select(events, RunStart)[0]
    config = {k: v for k, v in start.config.items() if k not in _SESSION_FIELDS}
    return {
        **{k: str(v) for k, v in config.items()},
        "fault": config.get("fault") or "none",
        "world_size": str(start.world_size),
        "backend": (tags or {}).get("backend", "local"),
    }
