"""A short human summary of a run directory (used by ``rfsdp train`` and ``make demo``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.checkpoint import CHECKPOINTS, latest_checkpoint, published_checkpoints
from trainer.events import Checkpoint, FaultFired, Restart, corrupt_lines, final_losses, latest_end, read_events, select


def print_run_summary(run_dir: Path) -> None:
    """Print losses, checkpoints, faults and restarts of a run as tables."""
    events = read_events(run_dir)
    losses = final_losses(events)
    console = Console()
    table = Table(title=f"run {run_dir}")
    table.add_column("what")
    table.add_column("value", justify="right")
    if losses:
        first, last = min(losses), max(losses)
        table.add_row("steps", f"{first}..{last}")
        table.add_row("loss first -> last", f"{losses[first]:.4f} -> {losses[last]:.4f}")
    ckpts = select(events, Checkpoint)
    for mode in sorted({e.mode for e in ckpts}):
        blocking = sorted(e.blocking_s for e in ckpts if e.mode == mode)
        table.add_row(f"checkpoints ({mode})", f"{len(blocking)}, median stall {blocking[len(blocking) // 2]:.3f} s")
    table.add_row("published", ", ".join(p.name for _, p in published_checkpoints(Path(run_dir) / CHECKPOINTS)) or "-")
    latest = latest_checkpoint(run_dir)
    table.add_row("latest", latest.name if latest else "-")
    end = latest_end(events)
    table.add_row("ended", f"{end.status} at step {end.step}" if end and end.step is not None else end.status if end else "-")
    if corrupt := corrupt_lines(run_dir):
        shown = ", ".join(map(str, corrupt[:5])) + (", ..." if len(corrupt) > 5 else "")
        table.add_row("corrupt event lines", f"{len(corrupt)} skipped (line {shown})")
    console.print(table)
    restarts = [e for e in events if isinstance(e, FaultFired | Restart)]
    if restarts:
        t = Table(title="faults and recoveries")
        for col in ("event", "kind / layer", "step / resumed", "lost steps", "recovery s"):
            t.add_column(col)
        for e in restarts:
            if isinstance(e, FaultFired):
                t.add_row("fault", e.kind, str(e.step), "", "")
            else:
                t.add_row("restart", e.layer, str(e.resumed_from_step), str(e.lost_steps), f"{e.recovery_s:.2f}")
        console.print(t)
