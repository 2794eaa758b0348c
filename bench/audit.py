"""The audit of a benchmark run's checkpoints (``rfsdp bench soak --audit``, issue 37 item 4):
every checkpoint the run published, checked against its ranks' shard digests (what each rank
was asked to save) by :func:`trainer.checkpoint.audit_checkpoint`, the check validation runs.

An audited run keeps every checkpoint it publishes (``--keep-last`` above its count of saves:
retention removes none) and is audited once it has ended, so that the audit takes no CPU from
the run whose goodput is measured; afterwards the checkpoints are pruned to the ``KEEP`` newest,
what the run would have kept (about 2 MB a save on the tiny model, while the run lasts). The
digests' cost is what the ranks recorded at each save (``digest_s`` of their digest records).
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from trainer.checkpoint import CHECKPOINTS, CheckpointError, audit_checkpoint, published_checkpoints
from trainer.events import Checkpoint, RunWarning, read_events, select

KEEP = 3
"""Checkpoints left after the audit: the trainer's default ``--keep-last``."""
SHOWN = 5
"""Mismatches kept by name in the result (all are counted)."""


def keep_every_save(steps: int, ckpt_every: int) -> int:
    """A ``--keep-last`` that keeps every checkpoint of a run of ``steps`` saving every ``ckpt_every``."""
    return steps // max(1, ckpt_every) + 2


def audit_run(run_dir: Path) -> dict:
    """Audit every published checkpoint of a finished run, then prune to the ``KEEP`` newest.

    Returns ``saves_published`` (its durable ``checkpoint`` events), ``saves_audited``,
    ``not_audited`` (published without digests), ``mismatches`` (shards not holding what their
    rank saved, over all checkpoints; ``unreadable`` checkpoints count apart), the first
    ``SHOWN`` mismatches by name, ``rejected_at_resume`` (checkpoints the run itself set aside at a
    resume for a stale shard), and the ranks' recorded digest seconds per save: ``digest_s`` (the
    slowest rank's, each save) and ``digest_cpu_s`` (all ranks' together).
    """
    events = read_events(run_dir)
    published = published_checkpoints(Path(run_dir) / CHECKPOINTS)
    audited = not_audited = mismatches = 0
    named: list[str] = []
    unreadable: list[str] = []
    slowest: list[float] = []
    total: list[float] = []
    for _, path in published:
        try:
            audit = audit_checkpoint(path)
        except CheckpointError as e:
            unreadable.append(str(e))
            continue
        if not audit.audited:
            not_audited += 1
            continue
        audited += 1
        mismatches += len(audit.mismatches)
        named += list(audit.mismatches[: SHOWN - len(named)])
        slowest.append(audit.digest_s)
        total.append(audit.digest_total_s)
    for _, path in published[:-KEEP]:
        shutil.rmtree(path, ignore_errors=True)
    stale = [
        w.step for w in select(events, RunWarning) if w.kind == "checkpoint_skipped" and "stale" in (w.reason or "")
    ]
    return {
        "saves_published": sum(e.tier == "durable" for e in select(events, Checkpoint)),
        "saves_audited": audited,
        "not_audited": not_audited,
        "unreadable": unreadable,
        "mismatches": mismatches,
        "mismatched": named,
        "rejected_at_resume": stale,
        "digest_s": _spread(slowest),
        "digest_cpu_s": _spread(total),
    }


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "max": max(values)}


def combine(audits: list[dict]) -> dict:
    """The audits of several runs as one: counts added, digest seconds per save over every save."""
    counts = ("saves_published", "saves_audited", "not_audited", "mismatches")
    out: dict = {key: sum(a[key] for a in audits) for key in counts}
    out["unreadable"] = [u for a in audits for u in a["unreadable"]]
    out["mismatched"] = [m for a in audits for m in a["mismatched"]][:SHOWN]
    out["rejected_at_resume"] = [s for a in audits for s in a["rejected_at_resume"]]
    for key in ("digest_s", "digest_cpu_s"):
        spreads = [(a[key], a["saves_audited"]) for a in audits if a[key] is not None]
        saves = sum(n for _, n in spreads)
        out[key] = (
            {
                "mean": sum(s["mean"] * n for s, n in spreads) / saves,
                "max": max(s["max"] for s, _ in spreads),
            }
            if saves
            else None
        )
    return out
