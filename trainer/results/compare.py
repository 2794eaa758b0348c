"""Compare runs across MLflow experiments: the logic behind ``notebooks/compare_experiments.ipynb``.

Each run's ``events.jsonl`` is read back from MLflow's artifacts and summarized with
:func:`trainer.events.summarize`, the same function that computed the logged summary metrics.
Every function here returns a table (a ``pandas`` frame) or plain data; the notebook only plots.
Figures that ``summarize`` does not hold (the split of wall time, the recovery layer of a node
fault, a loss's difference from a reference run) are defined here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from trainer.events import (
    Event,
    FaultFired,
    Restart,
    RunStart,
    Step,
    final_losses,
    final_steps,
    restarts_with_faults,
    select,
    summarize,
)
from trainer.rank.config import TRAJECTORY_FIELDS
from trainer.results.tracking import DEFAULT_EXPERIMENT, checkpoint_table, logged_runs

RECOVERY_LAYERS = ("in_process", "in_job", "node")
"""The kinds of recovery the comparison counts (:func:`recovery_kind`): a ``restart`` event's own
layer, except that an in-job restart after a node fault (``fault`` with a ``node``) is counted as ``node``."""
TIME_CATEGORIES = ("useful steps", "recovering", "checkpoint stall", "lost work", "other")
"""Where a run's wall time went (see :func:`time_breakdown`), in plotting order."""


@dataclass
class RunRecord:
    """One logged run: its MLflow identity, params and events."""

    run_id: str
    name: str
    experiment: str
    params: dict[str, str]
    events: list[Event]
    label: str = ""
    """Unique within a comparison (see :func:`label_runs`); the run name when not set."""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    @cached_property
    def summary(self) -> dict[str, float | int | None]:
        """:func:`trainer.events.summarize` of the run's events."""
        return summarize(self.events)

    @property
    def start(self) -> float:
        """Unix time of the run's first event (the origin of its timeline)."""
        return self.events[0].time

    @property
    def trajectory(self) -> tuple:
        """The first session's values of ``TRAJECTORY_FIELDS``: equal means the same losses are expected."""
        starts = select(self.events, RunStart)
        config = starts[0].config if starts else {}
        return tuple(config.get(name) for name in TRAJECTORY_FIELDS)

    @property
    def faulted(self) -> bool:
        """Whether any fault fired or any recovery happened in the run."""
        return bool(self.summary["faults"] or self.summary["restarts"])


def experiment_names(experiment: str = "", experiments: str | Sequence[str] = "") -> list[str]:
    """The experiments to compare: ``experiments`` when given, else ``experiment``.

    Args:
        experiment: one experiment name (the notebook's original parameter).
        experiments: several names, as a list or one comma-separated string (papermill's ``-p``
            passes a string, ``-y`` a list).

    Returns:
        The names in order, stripped, blanks and repeats dropped; ``[DEFAULT_EXPERIMENT]`` when
        both arguments are empty.
    """
    names = experiments.split(",") if isinstance(experiments, str) else list(experiments)
    if not any(n.strip() for n in names):
        names = [experiment or DEFAULT_EXPERIMENT]
    return list(dict.fromkeys(n.strip() for n in names if n.strip()))


@dataclass
class Comparison:
    """The runs of the compared experiments, and the experiments that gave none."""

    experiments: list[str]
    runs: list[RunRecord]
    missing: dict[str, str] = field(default_factory=dict)
    """Experiment name -> why it could not be read (no such experiment)."""
    empty: list[str] = field(default_factory=list)
    """Experiments that exist but hold no run logged by ``rfsdp log-mlflow``."""

    def report(self) -> str:
        """What was loaded, one line per experiment without runs, and what to do when nothing was."""
        lines = [f"{len(self.runs)} run(s) from experiment(s) {', '.join(map(repr, self.experiments))}"]
        lines += [f"  {why}" for why in self.missing.values()]
        lines += [f"  experiment {name!r} holds no run logged by `rfsdp log-mlflow`" for name in self.empty]
        if not self.runs:
            lines.append(
                "Nothing to compare: log runs with `rfsdp log-mlflow --run-dir DIR --experiment NAME` "
                "(or `make compare`), or pass other experiment names; the cells below are skipped."
            )
        return "\n".join(lines)


def load_runs(experiments: str | Sequence[str] = DEFAULT_EXPERIMENT, tracking_uri: str | None = None) -> Comparison:
    """Every active run that ``trainer.results.tracking.log_run`` logged into the experiments, oldest
    first within each experiment, labelled by :func:`label_runs`. An experiment that does not
    exist is reported, not raised.

    Args:
        experiments: names, as for :func:`experiment_names`.
        tracking_uri: tracking URI; empty or ``None`` resolves like ``log_run`` does.

    Raises:
        trainer.results.tracking.TrackingError: an HTTP tracking server did not answer.
    """
    names = experiment_names(experiments=experiments)
    comparison = Comparison(names, [])
    for name in names:
        try:
            logged = logged_runs(name, tracking_uri)
        except ValueError as e:  # no such experiment
            comparison.missing[name] = str(e).removeprefix("experiment: ")
            continue
        if not logged:
            comparison.empty.append(name)
        comparison.runs += [RunRecord(r.run_id, r.name, name, r.params, r.events) for r in logged if r.events]
    label_runs(comparison.runs)
    return comparison


def label_runs(runs: list[RunRecord]) -> None:
    """Give each run a unique label: its name; ``experiment/name`` where names repeat across
    experiments; plus the start of its run id where they repeat within one experiment.
    """
    for r in runs:
        r.label = r.name
        if sum(o.name == r.name for o in runs) > 1:
            same = sum(o.name == r.name and o.experiment == r.experiment for o in runs)
            r.label = f"{r.experiment}/{r.name}" + (f" ({r.run_id[:8]})" if same > 1 else "")


def find_run(runs: list[RunRecord], key: str) -> RunRecord:
    """The run whose label or MLflow run id is ``key``.

    Raises:
        ValueError: no run matches (the message lists the labels).
    """
    for r in runs:
        if key in (r.label, r.run_id):
            return r
    raise ValueError(f"reference_run: no run labelled or with id {key!r} (runs: {', '.join(r.label for r in runs)})")


def comparison_table(runs: list[RunRecord]) -> pd.DataFrame:
    """Side-by-side figures, one row per run, indexed by label.

    The setup (experiment, checkpoint mode, faults, model) from the run's params; the rest from
    ``trainer.events.summarize`` (its definitions), except ``restarts after node faults`` (in-job
    restarts whose fault was a node fault, already counted in ``restarts in-job``).
    """
    columns = [
        "experiment",
        "ckpt mode",
        "faults",
        "model",
        "goodput",
        "restarts in-process",
        "restarts in-job",
        "restarts after node faults",
        "recovery p50 s",
        "recovery max s",
        "lost steps",
        "ckpt stall p50 s",
        "final loss",
    ]
    rows = []
    for r in runs:
        s = r.summary
        node = sum(recovery_kind(restart, fault) == "node" for restart, fault in restarts_with_faults(r.events))
        values = [
            r.experiment,
            r.params.get("ckpt_mode"),
            r.params.get("fault"),
            r.params.get("model"),
            s["goodput"],
            s["restarts_in_process"],
            s["restarts_in_job"],
            node,
            s["recovery_s_p50"],
            s["recovery_s_max"],
            s["lost_steps"],
            s["ckpt_blocking_s_p50"],
            s["final_loss"],
        ]
        rows.append(dict(zip(columns, values, strict=True)))
    return pd.DataFrame(rows, columns=columns, index=pd.Index([r.label for r in runs], name="run"))


# --------------------------------------------------------------------------- loss against a reference


def reference_for(run: RunRecord, runs: list[RunRecord]) -> RunRecord | None:
    """The fault-free run to hold a run's losses against: another run without faults or restarts
    on the same trajectory (:attr:`RunRecord.trajectory`), with the same checkpoint mode if
    there is one, else the oldest.
    """
    candidates = [r for r in runs if r is not run and not r.faulted and r.trajectory == run.trajectory]
    same_mode = [r for r in candidates if r.params.get("ckpt_mode") == run.params.get("ckpt_mode")]
    return (same_mode or candidates or [None])[0]


def loss_vs_reference(runs: list[RunRecord], reference_run: str = "") -> pd.DataFrame:
    """Each step's final loss next to the reference run's, for every run with faults.

    Args:
        runs: the compared runs.
        reference_run: a label or run id: every other run is held against that run. Empty:
            each run with faults against its :func:`reference_for` (runs without one are left out).

    Returns:
        One row per run and step of the run: ``run``, ``reference`` (labels), ``step``, ``loss``,
        ``reference_loss`` (NaN where the reference has no such step) and ``difference``
        (``loss - reference_loss``: exactly 0 where the run resumed exactly).

    Raises:
        ValueError: ``reference_run`` names no run.
    """
    if reference_run:
        reference = find_run(runs, reference_run)
        pairs = [(r, reference) for r in runs if r is not reference]
    else:
        pairs = [(r, ref) for r in runs if r.faulted and (ref := reference_for(r, runs)) is not None]
    frames = []
    for run, ref in pairs:
        mine, theirs = final_losses(run.events), final_losses(ref.events)
        steps = sorted(mine)
        loss = pd.Series([mine[s] for s in steps], dtype=float)
        reference_loss = pd.Series([theirs.get(s, float("nan")) for s in steps], dtype=float)
        frames.append(
            pd.DataFrame(
                {
                    "run": run.label,
                    "reference": ref.label,
                    "step": steps,
                    "loss": loss,
                    "reference_loss": reference_loss,
                    "difference": loss - reference_loss,
                }
            )
        )
    columns = ["run", "reference", "step", "loss", "reference_loss", "difference"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def reference_agreement(losses: pd.DataFrame) -> pd.DataFrame:
    """Per run of :func:`loss_vs_reference`: its ``reference``, ``steps compared`` (both have a
    loss), ``max abs difference`` and ``exact`` (every compared loss equal bit for bit).
    """
    compared = losses.dropna(subset=["reference_loss"])
    grouped = compared.groupby("run", sort=False)
    table = pd.DataFrame(
        {
            "reference": grouped["reference"].first(),
            "steps compared": grouped.size(),
            "max abs difference": grouped["difference"].agg(lambda d: d.abs().max()),
        }
    )
    return table.assign(exact=table["max abs difference"] == 0)


# --------------------------------------------------------------------------- where the time went


def time_breakdown(runs: list[RunRecord]) -> pd.DataFrame:
    """Where each run's wall time went, in seconds: one row per run, columns ``TIME_CATEGORIES``
    and ``wall`` (their sum, ``summarize``'s ``wall_time_s``).

    * ``useful steps``: ``summarize``'s ``useful_time_s`` (the steps of the final trajectory).
    * ``lost work``: the time of every other ``step`` line, the steps done before a fault and
      redone after it.
    * ``checkpoint stall``: ``summarize``'s ``ckpt_blocking_s_total``.
    * ``recovering``: per ``restart``, its ``recovery_s`` (fault to the first step completed
      after it) less that first step's own time, which is already useful or lost work.
    * ``other``: the rest: start-up before the first step, bookkeeping between steps, the wait
      for the last save at the end, saves that failed.

    The parts do not overlap, with one exception: where ``recovery_s`` starts at the last step
    before a fault (a fault written on another host, see ``trainer.rank.recovery.describe_restart``), a
    save's stall right after that step is counted in both, and ``other`` is that much smaller.
    """
    rows = []
    for r in runs:
        s = r.summary
        executed = sum(e.step_time_s for e in select(r.events, Step))
        recovering, last_step = 0.0, None
        for e in r.events:
            if isinstance(e, Step):
                last_step = e
            elif isinstance(e, Restart):  # written by rank 0 right after the first step after the recovery
                first = last_step.step_time_s if last_step and last_step.step == e.resumed_from_step + 1 else 0.0
                recovering += e.recovery_s - first
        parts = {
            "useful steps": s["useful_time_s"],
            "recovering": recovering,
            "checkpoint stall": s["ckpt_blocking_s_total"],
            "lost work": executed - s["useful_time_s"],
        }
        rows.append({**parts, "other": s["wall_time_s"] - sum(parts.values()), "wall": s["wall_time_s"]})
    return pd.DataFrame(rows, columns=[*TIME_CATEGORIES, "wall"], index=pd.Index([r.label for r in runs], name="run"))


def _config(run: RunRecord) -> dict:
    starts = select(run.events, RunStart)
    return starts[0].config if starts else {}


def checkpoint_mode_verdict(runs: list[RunRecord]) -> str | None:
    """One sentence on sync against async checkpoints, from pairs of runs that did the same work
    (the same trajectory and fault schedule, one run per mode): the wall time of the async run over
    the sync one's, and what to conclude. None without such a pair.
    """
    pairs: dict[tuple, dict[str, RunRecord]] = {}
    for run in runs:
        config = _config(run)
        if config.get("ckpt_mode") in ("sync", "async"):
            pairs.setdefault((run.trajectory, config.get("fault", "")), {})[config["ckpt_mode"]] = run
    ratios = [
        (fault, p["async"].summary["wall_time_s"] / p["sync"].summary["wall_time_s"])
        for (_, fault), p in pairs.items()
        if len(p) == 2 and p["sync"].summary["wall_time_s"]
    ]
    if not ratios:
        return None
    said = ", ".join(f"{r:.2f}x sync's wall time {'with faults' if fault else 'without faults'}" for fault, r in ratios)
    if all(r < 1 for _, r in ratios):
        return f"Async checkpoints finished the same work sooner than sync ones ({said}): use them here."
    if all(r >= 1 for _, r in ratios):
        return (
            f"Async checkpoints finished the same work later than sync ones ({said}): here a background "
            "write slows the steps more than a sync save stalls them; `rfsdp bench crossover` measures "
            "from which state and interval, if any, async pays on this machine."
        )
    return f"Async against sync checkpoints, the same work: {said}; neither wins throughout."


# --------------------------------------------------------------------------- recoveries, timelines, checkpoints


def recovery_kind(restart: Restart, fault: FaultFired | None) -> str:
    """How the comparison counts a recovery (one of ``RECOVERY_LAYERS``): ``node`` after a node fault
    (``fault`` with a ``node``: the in-job restart that followed replaced it), otherwise the layer
    the ``restart`` event names (unlike ``trainer.rank.recovery.recovery_layer``, which tells an
    attempt which layer brought it back).
    """
    return "node" if fault is not None and fault.node is not None else restart.layer


def recoveries(runs: list[RunRecord]) -> pd.DataFrame:
    """Every recovery of every run: ``run``, ``layer`` (``RECOVERY_LAYERS``), ``fault``
    (``kind@step``, None when no fault was injected), ``recovery_s``, ``lost_steps``, ``source``
    (the checkpoint tier it resumed from).
    """
    rows = [
        {
            "run": r.label,
            "layer": recovery_kind(restart, fault),
            "fault": f"{fault.kind}@{fault.step}" if fault else None,
            "recovery_s": restart.recovery_s,
            "lost_steps": restart.lost_steps,
            "source": restart.source,
        }
        for r in runs
        for restart, fault in restarts_with_faults(r.events)
    ]
    return pd.DataFrame(rows, columns=["run", "layer", "fault", "recovery_s", "lost_steps", "source"])


def lost_steps_by_tier(recoveries: pd.DataFrame) -> pd.DataFrame:
    """Steps lost per recovery, by run and by the checkpoint tier it resumed from (a frame from
    :func:`recoveries`): ``recoveries`` (how many), ``lost mean`` and ``lost max``.
    """
    grouped = recoveries.groupby(["run", "source"], sort=False)["lost_steps"]
    return grouped.agg(**{"recoveries": "count", "lost mean": "mean", "lost max": "max"})


@dataclass
class Timeline:
    """A run's history on its own clock (seconds since its first event)."""

    steps: pd.DataFrame
    """Every ``step`` line: ``t``, ``step``, ``loss``, ``tokens_per_s`` (the step's tokens over its
    time), ``redone`` (True: a later line of the same step replaced it; that work was lost)."""
    faults: pd.DataFrame
    """Injected faults: ``t``, ``step``, ``kind``, ``rank``."""
    restarts: pd.DataFrame
    """Recoveries: ``t_fault`` (``t - recovery_s``), ``t`` (the first step after it), ``layer``
    (``RECOVERY_LAYERS``), ``resumed_from_step``, ``recovery_s``."""
    checkpoints: pd.DataFrame
    """Published durable checkpoints: ``t_start``, ``t_end`` (published), ``step``, ``blocking_s``
    (local snapshots, often every step, would cover the whole timeline)."""


def timeline(run: RunRecord) -> Timeline:
    """Steps, throughput, faults, recoveries and checkpoints of a run against its wall time."""
    t0 = run.start
    lines = select(run.events, Step)
    final = {id(e) for e in final_steps(lines).values()}
    steps = [
        {
            "t": e.time - t0,
            "step": e.step,
            "loss": e.loss,
            "tokens_per_s": e.tokens_per_s,
            "redone": id(e) not in final,
        }
        for e in lines
    ]
    faults = [
        {"t": e.time - t0, "step": e.step, "kind": e.kind, "rank": e.rank} for e in select(run.events, FaultFired)
    ]
    restarts = [
        {
            "t_fault": e.time - t0 - e.recovery_s,
            "t": e.time - t0,
            "layer": recovery_kind(e, fault),
            "resumed_from_step": e.resumed_from_step,
            "recovery_s": e.recovery_s,
        }
        for e, fault in restarts_with_faults(run.events)
    ]
    ckpts = pd.DataFrame(checkpoint_table(run.events), columns=["time", "step", "tier", "blocking_s", "total_s"])
    ckpts = ckpts[ckpts["tier"] == "durable"]
    return Timeline(
        steps=pd.DataFrame(steps, columns=["t", "step", "loss", "tokens_per_s", "redone"]),
        faults=pd.DataFrame(faults, columns=["t", "step", "kind", "rank"]),
        restarts=pd.DataFrame(restarts, columns=["t_fault", "t", "layer", "resumed_from_step", "recovery_s"]),
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
    """Every published checkpoint and local snapshot of every run: ``run``, ``kind`` (the durable
    tier's mode, ``async`` or ``sync``, or ``local``), ``step``, ``blocking_s`` (the loop's stall)
    and ``total_s`` (from the start of the save until published, or complete for a snapshot).
    """
    frames = []
    for r in runs:
        table = pd.DataFrame(checkpoint_table(r.events)).assign(run=r.label)
        table["kind"] = table["mode"].where(table["tier"] == "durable", table["tier"])
        frames.append(table)
    columns = ["run", "kind", "step", "blocking_s", "total_s"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)
