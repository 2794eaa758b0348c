"""Smoke tests of `rfsdp bench ... --quick`: each benchmark runs its real jobs and writes valid JSON
with the expected keys. Timings are never asserted (this machine is shared and noisy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import rfsdp

EXPECTED = {
    "checkpoint": {
        "methods": {"nvrx_async", "torch_save", "dcp_save", "dcp_async_save"},
        "keys": {"stall_s", "durable_s", "step_s", "slowdown", "warmup_stall_s", "stall_ratio"},
    },
    "recovery": {"methods": {"inprocess", "ft_injob", "torchrun", "cold"}, "keys": {"exception"}},
    "overhead": {"methods": {"resilient", "plain"}, "keys": {"steps_per_s", "ratio", "samples"}},
    "goodput": {"methods": {"resilient", "baseline"}, "keys": {"goodput", "ratio", "wall_s", "useful_s", "runs"}},
}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_quick_benchmark_writes_json(name: str, tmp_path: Path) -> None:
    out = tmp_path / "results" / "bench.json"
    proc = rfsdp("bench", name, "--quick", "--json", str(out), "--work", str(tmp_path / "work"), timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert name in proc.stdout  # the table was printed
    results = json.loads(out.read_text())
    assert results["quick"] is True
    assert results["machine"]["cpus"] >= 1 and results["command"].startswith("rfsdp bench")
    bench = results["benchmarks"][name]
    assert bench["benchmark"] == name and "error" not in bench
    assert set(bench["methods"]) == EXPECTED[name]["methods"]
    for method in bench["methods"].values():
        assert EXPECTED[name]["keys"] <= set(method)
    assert bench["targets"] and all(isinstance(t["met"], bool) for t in bench["targets"])
    if name == "checkpoint":
        assert bench["params"]["state_bytes"] > 0
        assert bench["methods"]["torch_save"]["stall_ratio"] == 1.0  # the reference
        for method in bench["methods"].values():
            assert _finite(method["stall_s"]) and _finite(method["durable_s"]) and method["durable_s"] >= method["stall_s"]
        for m in ("nvrx_async", "dcp_async_save"):  # background writes: steps ran while they were in flight
            assert bench["methods"][m]["inflight_steps"] >= 1 and _finite(bench["methods"][m]["slowdown"])
    elif name == "recovery":
        for method, per_fault in bench["methods"].items():
            run = per_fault["exception"]
            assert _finite(run["recovery_s"]) and run["recovery_s"] > 0 and run["lost_steps"] >= 0
            assert run["layer"] == {"inprocess": "in_process", "ft_injob": "in_job", "torchrun": "in_job", "cold": "cold"}[method]
    elif name == "overhead":
        assert all(_finite(m["steps_per_s"]) and m["steps_per_s"] > 0 for m in bench["methods"].values())
        assert _finite(bench["overhead"])
    else:
        for method in bench["methods"].values():
            assert 0 < method["goodput"] < 1 and method["runs"][0]["steps"] == bench["params"]["steps"]
            assert method["runs"][0]["faults"] == len(bench["params"]["fault"].split(","))


def test_unknown_benchmark_is_refused() -> None:
    proc = rfsdp("bench", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_json_path_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = rfsdp("bench", "overhead", "--quick", "--json", str(blocker / "out.json"), "--work", str(tmp_path / "work"))
    assert proc.returncode == 2 and "--json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "work").exists()  # refused before anything was written
