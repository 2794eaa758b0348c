"""A short human summary of a run directory: the tables ``rfsdp train`` and ``make demo`` print,
and the headline figures and Markdown report the pipeline shows in the Kubeflow UI.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.checkpoint import CHECKPOINTS, latest_checkpoint, published_checkpoints
from trainer.events import (
    FAILURE_CATEGORIES,
    RESTART_LAYERS,
    Checkpoint,
    Event,
    Failure,
    FaultFired,
    Restart,
    corrupt_lines,
    final_losses,
    latest_end,
    read_events,
    select,
    summarize,
)

# (name shown to a person, summary figure, scale, decimals): the figures a run is judged by.
_HEADLINE = (
    ("goodput (%)", "goodput", 100, 1),
    *((f"restarts {layer.replace('_', '-')}", f"restarts_{layer}", 1, 0) for layer in RESTART_LAYERS),
    ("recovery p50 (s)", "recovery_s_p50", 1, 2),
    ("recovery max (s)", "recovery_s_max", 1, 2),
    ("lost steps", "lost_steps", 1, 0),
    ("lost steps max per fault", "lost_steps_max", 1, 0),
    ("OOM kills", "oom_kills", 1, 0),
    ("OOM peak RSS (MiB)", "oom_peak_rss_mb", 1, 0),
    ("checkpoint stall p50 (s)", "ckpt_blocking_s_p50", 1, 3),
    ("checkpoint overhead (%)", "ckpt_overhead", 100, 2),
    ("final loss", "final_loss", 1, 4),
)
VERDICT = "checkpoint valid (1 yes, 0 no)"
"""The headline figure holding the validation verdict."""


def headline_metrics(events: list[Event], valid: bool | None) -> dict[str, float]:
    """The figures a person reads first, rounded and named with their units (the pipeline's one
    KFP ``Metrics`` artifact). Figures a run does not define (no restart: no recovery time) and a
    verdict that was never reached are left out.

    Args:
        events: the run's events (empty when training never started).
        valid: the validation verdict on the run's checkpoint (None: not validated).
    """
    figures = summarize(events) if events else {}
    out = {
        name: round(figures[key] * scale, digits)
        for name, key, scale, digits in _HEADLINE
        if figures.get(key) is not None
    }
    if valid is not None:
        out[VERDICT] = float(valid)
    return out


def run_report(
    name: str,
    *,
    status: str,
    headline: dict[str, float],
    mlflow_url: str,
    failed_step: str = "",
    reason: str = "",
    validation: str = "",
) -> str:
    """The run's Markdown report for the Kubeflow UI.

    Args:
        name: the training run's name.
        status: how the pipeline run ended (SUCCEEDED, FAILED, ...).
        headline: from :func:`headline_metrics`.
        mlflow_url: the MLflow run's page.
        failed_step: the step that failed ("" none).
        reason: why it failed.
        validation: the validation's own Markdown table ("" when it did not run).
    """
    lines = [f"## Training run `{name}`: {status}", "", f"MLflow run: [{mlflow_url}]({mlflow_url})", ""]
    if failed_step:
        lines += [f"**Failed step:** {failed_step}", "", "```", reason.strip(), "```", ""]
    if headline:
        lines += ["| figure | value |", "|---|---|", *(f"| {k} | {v:g} |" for k, v in headline.items()), ""]
    lines.append(validation or "Validation: did not run.\n")
    return "\n".join(lines)


def print_run_summary(run_dir: Path) -> None:
    """Print losses, checkpoints, faults and restarts of a run as tables."""
    events = read_events(run_dir)
    losses = final_losses(events)
    console = Console()
    # A path as a table title wraps mid-word at the table's width; a line of its own stays whole.
    console.print(f"run {run_dir}", soft_wrap=True, highlight=False)
    table = Table()
    table.add_column("what")
    table.add_column("value", justify="right")
    if losses:
        first, last = min(losses), max(losses)
        table.add_row("steps", f"{first}..{last}")
        table.add_row("loss first -> last", f"{losses[first]:.4f} -> {losses[last]:.4f}")
    ckpts = select(events, Checkpoint)
    for tier, mode in sorted({(e.tier, e.mode) for e in ckpts}):
        blocking = [e.blocking_s for e in ckpts if (e.tier, e.mode) == (tier, mode)]
        # The headline's definition (summarize's ckpt_blocking_s_p50), so the two figures agree.
        what = f"checkpoints ({mode})" if tier == "durable" else "local snapshots"
        table.add_row(what, f"{len(blocking)}, stall p50 {statistics.median(blocking):.3f} s")
    table.add_row("published", ", ".join(p.name for _, p in published_checkpoints(Path(run_dir) / CHECKPOINTS)) or "-")
    latest = latest_checkpoint(run_dir)
    table.add_row("latest", latest.name if latest else "-")
    end = latest_end(events)
    table.add_row(
        "ended", f"{end.status} at step {end.step}" if end and end.step is not None else end.status if end else "-"
    )
    if failures := select(events, Failure):
        table.add_row(
            "failures", ", ".join(f"{sum(e.category == c for e in failures)} {c}" for c in FAILURE_CATEGORIES)
        )
    if corrupt := corrupt_lines(run_dir):
        shown = ", ".join(map(str, corrupt[:5])) + (", ..." if len(corrupt) > 5 else "")
        table.add_row("corrupt event lines", f"{len(corrupt)} skipped (line {shown})")
    console.print(table)
    restarts = [e for e in events if isinstance(e, FaultFired | Failure | Restart)]
    if restarts:
        t = Table(title="faults and recoveries")
        for col in ("event", "kind / layer", "step / resumed", "lost steps", "recovery s"):
            t.add_column(col)
        for e in restarts:
            if isinstance(e, FaultFired):
                t.add_row("fault", e.kind, str(e.step), "", "")
            elif isinstance(e, Failure):  # the class decides the retries (trainer.rank.failures)
                t.add_row(
                    f"failure, rank {e.rank}", f"{e.category}: {e.error_type.rsplit('.', 1)[-1]}", str(e.step), "", ""
                )
            else:
                t.add_row("restart", e.layer, str(e.resumed_from_step), str(e.lost_steps), f"{e.recovery_s:.2f}")
        console.print(t)
