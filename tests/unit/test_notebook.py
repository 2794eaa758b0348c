"""The comparison notebook and its logic (``trainer/results/compare.py``).

Unit tests on event records built with ``trainer.events``' dataclasses, and the notebook as it is
stored. A real run's events: tests/integration/test_notebook_runs.py; the notebook executed:
tests/e2e/test_notebook_e2e.py.
"""

from __future__ import annotations

from dataclasses import replace

import nbformat
import pytest

from tests.conftest import ROOT
from trainer.events import Checkpoint, Event, FaultFired, Restart, RunEnd, RunStart, Step
from trainer.rank.config import TRAJECTORY_FIELDS, config_defaults
from trainer.results import compare
from trainer.results.tracking import DEFAULT_EXPERIMENT

NOTEBOOK = ROOT / "notebooks" / "compare_experiments.ipynb"
PARAMETERS = ("experiment", "experiments", "tracking_uri", "reference_run", "figures_dir")


def test_notebook_is_stored_clean_with_parameters() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    assert all(f"\n{name} =" in "\n" + params[0].source for name in PARAMETERS)
    assert nb.metadata.kernelspec.name == "python3"


# --------------------------------------------------------------------------- unit tests on built events

STEP_S = 0.5  # every built step takes this long


def config(**changes: object) -> dict:
    return {**config_defaults(), "data": "d", "run_dir": "r", **changes}


def steps(t: float, first: int, last: int, *, loss: float = 0.0) -> list[Step]:
    """Steps ``first..last``, one a second from ``t``, each with loss ``loss + step``."""
    return [
        Step(time=t + i, step=s, loss=loss + s, step_time_s=STEP_S, tokens=100)
        for i, s in enumerate(range(first, last + 1))
    ]


def record(name: str, events: list[Event], *, experiment: str = "exp", mode: str = "async") -> compare.RunRecord:
    return compare.RunRecord(f"id-{experiment}-{name}", name, experiment, {"ckpt_mode": mode, "model": "tiny"}, events)


def faulted_events(**config_changes: object) -> list[Event]:
    """Six steps with two faults on a 13 s clock: an exception before step 4 (recovered in-process
    from step 2, step 3 lost) and a node loss before step 5 (recovered in-job from step 4).
    """
    return [
        RunStart(time=100.0, config=config(**config_changes), resumed_from_step=0, world_size=2),
        *steps(101.0, 1, 3),
        Checkpoint(time=102.5, step=2, mode="async", blocking_s=0.25, total_s=0.4, bytes=1000),
        FaultFired(time=103.1, rank=1, kind="exception", step=4),
        *steps(106.1, 3, 3),
        Restart(time=106.1, layer="in_process", attempt=1, resumed_from_step=2, lost_steps=1, recovery_s=3.0),
        *steps(107.0, 4, 4),
        FaultFired(time=107.2, rank=-1, kind="node-loss", step=5, node=1),
        *steps(112.2, 5, 5),
        Restart(time=112.2, layer="in_job", attempt=2, resumed_from_step=4, lost_steps=0, recovery_s=5.0),
        RunEnd(time=113.0, status="completed", step=5),
    ]


def fault_free_events(*, loss: float = 0.0, **config_changes: object) -> list[Event]:
    return [
        RunStart(time=100.0, config=config(**config_changes), resumed_from_step=0, world_size=2),
        *steps(101.0, 1, 5, loss=loss),
        RunEnd(time=106.0, status="completed", step=5),
    ]


def test_time_breakdown_splits_wall_time_by_its_definitions() -> None:
    run = record("faulted", faulted_events())
    row = compare.time_breakdown([run]).loc["faulted"]
    assert row["wall"] == pytest.approx(113.0 - 100.0)
    assert row["useful steps"] == pytest.approx(5 * STEP_S)  # steps 1..5, each once
    assert row["lost work"] == pytest.approx(STEP_S)  # the first step 3
    assert row["checkpoint stall"] == pytest.approx(0.25)
    assert row["recovering"] == pytest.approx((3.0 - STEP_S) + (5.0 - STEP_S))  # less each first step after
    assert row["other"] == pytest.approx(row["wall"] - row[list(compare.TIME_CATEGORIES[:-1])].sum())
    assert row["other"] > 0 and list(compare.time_breakdown([]).columns) == [*compare.TIME_CATEGORIES, "wall"]


def test_recoveries_and_table_count_node_faults_as_their_own_layer() -> None:
    run = record("faulted", faulted_events())
    rec = compare.recoveries([run])
    assert rec["layer"].tolist() == ["in_process", "node"]
    assert rec["fault"].tolist() == ["exception@4", "node-loss@5"]
    row = compare.comparison_table([run]).loc["faulted"]
    # the restart counts are summarize's (an in-job restart after a node fault is in-job there)
    assert (row["restarts in-process"], row["restarts in-job"], row["restarts after node faults"]) == (1, 1, 1)
    assert (row["ckpt mode"], row["model"], row["lost steps"]) == ("async", "tiny", 1)
    assert row["goodput"] == pytest.approx(5 * STEP_S / 13.0)


def test_lost_steps_are_reported_per_fault_by_the_tier_resumed_from() -> None:
    from trainer.results.summary import headline_metrics
    from trainer.results.tracking import metric_points

    events = faulted_events()
    first = next(i for i, e in enumerate(events) if isinstance(e, Restart))
    events[first] = replace(events[first], source="local", lost_steps=3)  # the in-process recovery, from the local tier
    run = record("faulted", events)
    by_tier = compare.lost_steps_by_tier(compare.recoveries([run]))
    assert by_tier.loc[("faulted", "local")].tolist() == [1, 3, 3] and by_tier.loc[("faulted", "durable")].tolist() == [
        1,
        0,
        0,
    ]
    points = {(key, step): value for key, value, _, step in metric_points(events)}
    assert (points[("restart_lost_steps_local", 1)], points[("restart_lost_steps_durable", 2)]) == (3, 0)
    assert headline_metrics(events, valid=None)["lost steps max per fault"] == 3


def test_timeline_marks_redone_steps_and_recovery_windows() -> None:
    tl = compare.timeline(record("faulted", faulted_events()))
    redone = tl.steps[tl.steps["redone"]]
    assert redone["step"].tolist() == [3] and redone["t"].tolist() == [pytest.approx(103.0 - 100.0)]
    assert tl.steps["tokens_per_s"].tolist() == [pytest.approx(100 / STEP_S)] * 6
    assert tl.restarts["t_fault"].tolist() == [pytest.approx(103.1 - 100.0), pytest.approx(107.2 - 100.0)]
    assert tl.restarts["layer"].tolist() == ["in_process", "node"]
    assert tl.checkpoints[["t_start", "t_end"]].values.tolist() == [[pytest.approx(2.1), pytest.approx(2.5)]]


def test_reference_is_a_fault_free_run_of_the_same_trajectory() -> None:
    assert "steps" in TRAJECTORY_FIELDS and "ckpt_mode" not in TRAJECTORY_FIELDS
    faulted = record("faulted", faulted_events(ckpt_mode="async"))
    other_trajectory = record("other-trajectory", fault_free_events(steps=99), mode="async")
    sync = record("sync", fault_free_events(ckpt_mode="sync"), mode="sync")
    assert compare.reference_for(faulted, [faulted, other_trajectory]) is None
    assert compare.reference_for(faulted, [faulted, other_trajectory, sync]) is sync  # another mode if need be
    same_mode = record("async", fault_free_events(), mode="async")
    runs = [faulted, sync, same_mode, other_trajectory]
    assert compare.reference_for(faulted, runs) is same_mode

    losses = compare.loss_vs_reference(runs)
    assert set(losses["run"]) == {"faulted"} and set(losses["reference"]) == {"async"}  # only runs with faults
    assert losses["step"].tolist() == [1, 2, 3, 4, 5] and (losses["difference"] == 0).all()
    agreement = compare.reference_agreement(losses).loc["faulted"]
    assert agreement["exact"] and agreement["steps compared"] == 5


def test_loss_difference_against_a_chosen_reference() -> None:
    reference = record("reference", fault_free_events())
    off = record("off", fault_free_events(loss=0.5))
    short = record("short", [*fault_free_events()[:3], RunEnd(time=104.0, status="stopped", step=2)])
    losses = compare.loss_vs_reference([reference, off, short], reference_run="id-exp-reference")  # by run id
    assert set(losses["run"]) == {"off", "short"}
    assert (losses.loc[losses["run"] == "off", "difference"] == 0.5).all()
    agreement = compare.reference_agreement(losses)
    assert not agreement.loc["off", "exact"] and agreement.loc["off", "max abs difference"] == 0.5
    assert agreement.loc["short", "exact"] and agreement.loc["short", "steps compared"] == 2
    with pytest.raises(ValueError, match="reference_run: no run .* 'nope'"):
        compare.loss_vs_reference([reference, off], reference_run="nope")
    assert compare.loss_vs_reference([reference, off]).empty  # no run with faults: nothing to hold


def test_experiment_names_and_labels() -> None:
    assert compare.experiment_names("one") == ["one"]
    assert compare.experiment_names("one", " a, b,,a ") == ["a", "b"]
    assert compare.experiment_names("one", ["x", "y"]) == ["x", "y"]
    assert compare.experiment_names() == [DEFAULT_EXPERIMENT]
    runs = [record("r", [], experiment="e1"), record("r", [], experiment="e2"), record("s", [], experiment="e1")]
    runs.append(compare.RunRecord("abcdefgh-2", "r", "e2", {}, []))
    compare.label_runs(runs)
    assert [r.label for r in runs] == ["e1/r", "e2/r (id-e2-r)", "s", "e2/r (abcdefgh)"]


def test_the_verdict_on_checkpoint_modes_compares_runs_that_did_the_same_work() -> None:
    def run(name: str, mode: str, end: float, fault: str = "") -> compare.RunRecord:
        events = [
            RunStart(time=100.0, config=config(ckpt_mode=mode, fault=fault), resumed_from_step=0, world_size=2),
            *steps(101.0, 1, 5),
            RunEnd(time=end, status="completed", step=5),
        ]
        return record(name, events, mode=mode)

    quiet = [run("sync", "sync", 110.0), run("async", "async", 108.0)]
    assert compare.checkpoint_mode_verdict(quiet).startswith(
        "Async checkpoints finished the same work sooner than sync ones (0.80x sync's wall time without faults)"
    )
    faulted = [run("sync-f", "sync", 110.0, "exception@3:1"), run("async-f", "async", 113.0, "exception@3:1")]
    both = compare.checkpoint_mode_verdict(quiet + faulted)
    assert "0.80x sync's wall time without faults, 1.30x sync's wall time with faults" in both
    later = compare.checkpoint_mode_verdict(faulted)
    assert later.startswith("Async checkpoints finished the same work later") and "rfsdp bench crossover" in later
    assert compare.checkpoint_mode_verdict([quiet[0], faulted[1]]) is None  # not the same work: no pair
