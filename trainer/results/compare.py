"""Compare the runs of an MLflow experiment: the logic behind ``notebooks/compare_experiments.ipynb``.

Each run's ``events.jsonl`` is read back from MLflow's artifacts and summarized with
:func:`trainer.events.summarize`, the same function that computed the logged summary metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from trainer.events import Event, FaultFired, Restart, Step, select, summarize
from trainer.results.tracking import DEFAULT_EXPERIMENT, checkpoint_table, logged_runs


@dataclass
class RunRecord:
    """One logged run: its MLflow identity, params, events and summary."""

    run_id: str
    name: str
    params: dict[str, str]
    events: list[Event]
    summary: dict[str, float | int | None]
    label: str = ""
    """Unique within a comparison: the run name, plus the run id's start where names repeat."""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    @property
    def start(self) -> float:
        """Unix time of the run's first event (the origin of its timeline)."""
        return self.events[0].time


def load_runs(experiment: str = DEFAULT_EXPERIMENT, tracking_uri: str | None = None) -> list[RunRecord]:
    """Every active run that ``trainer.results.tracking.log_run`` logged into ``experiment``, oldest first.

    Args:
        experiment: MLflow experiment name.
        tracking_uri: tracking URI; empty or ``None`` resolves like ``log_run`` does.

    Raises:
        ValueError: no such experiment at that tracking URI.
    """
    runs = logged_runs(experiment, tracking_uri)
    records = [RunRecord(run.run_id, run.name, run.params, run.events, summarize(run.events)) for run in runs]
    names = [r.name for r in records]
    for r in records:  # the run name (the run dir's name) labels a run unless two runs share it
        r.label = r.name if names.count(r.name) == 1 else f"{r.name} ({r.run_id[:8]})"
    return records


def comparison_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Side-by-side figures: one row per run (definitions in ``trainer.events.summarize``)."""
    rows = []
    for r in runs:
        s = r.summary
        rows.append(
            {
                "run": r.label,
                "mode": r.params.get("ckpt_mode"),
                "faults": r.params.get("fault"),
                "restarts in-process": s["restarts_in_process"],
                "restarts in-job": s["restarts_in_job"],
                "recovery mean s": s["recovery_s_mean"],
                "recovery max s": s["recovery_s_max"],
                "lost steps": s["lost_steps"],
                "ckpt blocking p50 s": s["ckpt_blocking_s_p50"],
                "ckpt blocking max s": s["ckpt_blocking_s_max"],
                "ckpt overhead": s["ckpt_overhead"],
                "goodput": s["goodput"],
                "wall s": s["wall_time_s"],
                "final loss": s["final_loss"],
            }
        )
    return pd.DataFrame(rows).set_index("run")


@dataclass
class Timeline:
    """A run's history on its own clock (seconds since its first event)."""

    steps: pd.DataFrame
    """Every ``step`` line (re-executed steps included): ``t``, ``step``, ``loss``."""
    faults: pd.DataFrame
    """Injected faults: ``t``, ``step``, ``kind``, ``rank``."""
    restarts: pd.DataFrame
    """Recoveries: ``t`` (first step after it), ``layer``, ``resumed_from_step``, ``recovery_s``."""
    checkpoints: pd.DataFrame
    """Published checkpoints: ``t_start``, ``t_end`` (published), ``step``, ``blocking_s``."""


def timeline(run: RunRecord) -> Timeline:
    """Step vs wall time of a run, with its faults, restarts and checkpoints."""
    t0 = run.start

    def frame(rows: list[dict], columns: list[str]) -> pd.DataFrame:
        return pd.DataFrame(rows, columns=columns)

    steps = [{"t": e.time - t0, "step": e.step, "loss": e.loss} for e in select(run.events, Step)]
    faults = [{"t": e.time - t0, "step": e.step, "kind": e.kind, "rank": e.rank} for e in select(run.events, FaultFired)]
    restarts = [
        {"t": e.time - t0, "layer": e.layer, "resumed_from_step": e.resumed_from_step, "recovery_s": e.recovery_s}
        for e in select(run.events, Restart)
    ]
    ckpts = pd.DataFrame(checkpoint_table(run.events), columns=["time", "step", "blocking_s", "total_s"])
    return Timeline(
        steps=frame(steps, ["t", "step", "loss"]),
        faults=frame(faults, ["t", "step", "kind", "rank"]),
        restarts=frame(restarts, ["t", "layer", "resumed_from_step", "recovery_s"]),
        checkpoints=pd.DataFrame(
            {
                "t_start": ckpts["time"] - t0 - ckpts["total_s"],
                "t_end": ckpts["time"] - t0,
                "step": ckpts["step"],
                "blocking_s": ckpts["blocking_s"],
            }
        ),
    )


def checkpoint_blocking(runs: list[RunRecord]) -> pd.DataFrame:
    """Every published checkpoint of every run: ``run``, ``mode``, ``step``, ``blocking_s``, ``total_s``."""
    frames = [pd.DataFrame(checkpoint_table(r.events)).assign(run=r.label) for r in runs]
    columns = ["run", "mode", "step", "blocking_s", "total_s"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def goodput(runs: list[RunRecord]) -> pd.Series:
    """Goodput per run (``trainer.events.summarize``'s definition)."""
    return pd.Series({r.label: r.summary["goodput"] for r in runs}, name="goodput")
