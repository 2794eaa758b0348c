"""The comparison notebook's logic (``trainer/results/compare.py``) on a real run's events."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.events import read_events
from trainer.results import compare

# --------------------------------------------------------------------------- real runs


def test_time_breakdown_of_a_real_run(faulty_run: Path) -> None:
    run = compare.RunRecord("id", faulty_run.name, "exp", {}, read_events(faulty_run))
    row = compare.time_breakdown([run]).loc[run.label]
    assert (
        row[list(compare.TIME_CATEGORIES)].sum()
        == pytest.approx(row["wall"])
        == pytest.approx(run.summary["wall_time_s"])
    )
    assert (row[list(compare.TIME_CATEGORIES)] >= 0).all()  # the categories do not overlap
    assert row["useful steps"] == pytest.approx(run.summary["useful_time_s"])
    assert row["recovering"] > 0 and (row["lost work"] > 0) == (run.summary["lost_steps"] > 0)
