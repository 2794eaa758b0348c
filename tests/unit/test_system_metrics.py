"""Each node's system metrics: sampled by a real thread into ``system`` events, then MLflow points
that are the same whether logged live in parts or at the end (so the store keeps one of each)."""

from __future__ import annotations

import time
from pathlib import Path

from trainer.events import EventLog, Step, SystemSample, read_events, select
from trainer.rank.system import SHM, SystemSampler
from trainer.results.tracking import metric_points


def test_the_sampler_writes_what_the_machine_is_doing(tmp_path: Path) -> None:
    sampler = SystemSampler(EventLog(tmp_path, rank=1), node=1, every_s=0.1).start()
    deadline = time.monotonic() + 30
    while len(select(read_events(tmp_path), SystemSample)) < 2:
        assert time.monotonic() < deadline, "no samples written"
        time.sleep(0.05)
    sampler.stop()
    first = select(read_events(tmp_path), SystemSample)[0]
    assert (first.node, first.rank) == (1, 1)
    expected = {"cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage"}
    expected |= {"network_receive_megabytes", "network_transmit_megabytes"} | (
        {"shm_usage_megabytes"} if SHM.is_dir() else set()
    )
    assert expected <= set(first.metrics)  # and gpu_<i>_... only where NVML sees GPUs: none here
    assert (
        0 <= first.metrics["cpu_utilization_percentage"] <= 100 and first.metrics["system_memory_usage_megabytes"] > 0
    )
    stopped = len(select(read_events(tmp_path), SystemSample))
    time.sleep(0.3)
    assert len(select(read_events(tmp_path), SystemSample)) == stopped, "no sample after stop() returns"


def test_system_points_are_per_node_and_the_same_live_and_at_the_end() -> None:
    t0 = 1_700_000_000.0
    events = [
        Step(time=t0, step=1, loss=5.0, step_time_s=0.1),
        SystemSample(time=t0 + 2.4, rank=0, node=0, metrics={"cpu_utilization_percentage": 50.0}),
        SystemSample(time=t0 + 2.5, rank=1, node=1, metrics={"cpu_utilization_percentage": 70.0}),
        Step(time=t0 + 3, step=2, loss=4.0, step_time_s=0.1),
        SystemSample(time=t0 + 12.6, rank=0, node=0, metrics={"cpu_utilization_percentage": 90.0}),
    ]
    whole = [p for p in metric_points(events) if p[0].startswith("system/")]
    assert whole == [
        ("system/node_0/cpu_utilization_percentage", 50.0, int((t0 + 2.4) * 1000), 2),
        ("system/node_1/cpu_utilization_percentage", 70.0, int((t0 + 2.5) * 1000), 2),
        ("system/node_0/cpu_utilization_percentage", 90.0, int((t0 + 12.6) * 1000), 12),
    ]  # steps: whole seconds since the run's first event
    first, rest = events[:2], events[2:]
    live = metric_points(first, totals=False, origin=t0) + metric_points(rest, totals=False, done_before=1, origin=t0)
    assert [p for p in live if p[0].startswith("system/")] == whole
