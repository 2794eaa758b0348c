"""Smoke tests of `rfsdp bench ... --quick`: each benchmark runs its real jobs and writes valid JSON
with the expected keys. Timings are never asserted (this machine is shared and noisy).

The soak's schedule alone: tests/unit/test_bench.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.soak import schedule
from tests.conftest import rfsdp

EXPECTED = {
    "checkpoint": {
        "methods": {"nvrx_async", "torch_save", "dcp_save", "dcp_async_save"},
        "keys": {"stall_s", "durable_s", "step_s", "slowdown", "warmup_stall_s", "stall_ratio"},
    },
    "recovery": {"methods": {"inprocess", "ft_injob", "torchrun", "cold"}, "keys": {"exception"}},
    "overhead": {
        "methods": {
            "resilient",
            "local_tier",
            "plain",
            "trainer",
            "async_ckpt",
            "sync_ckpt",
            "ft_launcher",
            "wrapper",
            "resilient_loaded",
            "plain_loaded",
        },
        "keys": {"steps_per_s", "ratio", "samples", "base", "vs_base", "models"},
    },
    "goodput": {
        "methods": {"resilient", "baseline"},
        "keys": {"goodput", "ratio", "wall_ratio", "wall_s", "useful_s", "runs"},
    },
    "load": {
        "methods": {"sharded", "from_pretrained"},
        "keys": {"load_anon_mib_per_rank", "anon_over_model", "seconds"},
    },
    "crossover": {"methods": set(), "keys": set()},  # cells, not methods: _check_crossover
    "soak": {
        "methods": {"resilient", "resilient_local", "baseline"},
        "keys": {"goodput", "ettr", "ratio", "wall_ratio", "wall_s", "lost_steps", "runs"},
    },
}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One `rfsdp bench all --quick` run (the benchmarks share its data): its output and JSON."""
    root = tmp_path_factory.mktemp("bench")
    out = root / "results" / "bench.json"
    # --ckpts-per-fault: the soak's own option on its way through `all`
    proc = rfsdp(
        "bench",
        "all",
        "--quick",
        "--ckpts-per-fault",
        "3",
        "--json",
        str(out),
        "--work",
        str(root / "work"),
        timeout=2700,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_quick_benchmark_writes_json(name: str, quick_all: tuple[str, dict]) -> None:
    stdout, results = quick_all
    assert f"{name} (quick)" in stdout  # the table was printed
    assert results["quick"] is True
    assert results["machine"]["cpus"] >= 1 and results["command"].startswith("rfsdp bench")
    bench = results["benchmarks"][name]
    assert bench["benchmark"] == name and "error" not in bench
    if name == "crossover":
        _check_crossover(bench)
        return
    assert set(bench["methods"]) == EXPECTED[name]["methods"]
    for method in bench["methods"].values():
        assert EXPECTED[name]["keys"] <= set(method)
    assert bench["targets"] and all(isinstance(t["met"], bool) for t in bench["targets"])
    if name == "checkpoint":
        assert bench["params"]["state_bytes"] > 0
        assert bench["methods"]["torch_save"]["stall_ratio"] == 1.0  # the reference
        for method in bench["methods"].values():
            assert (
                _finite(method["stall_s"]) and _finite(method["durable_s"]) and method["durable_s"] >= method["stall_s"]
            )
        for m in ("nvrx_async", "dcp_async_save"):  # background writes: steps ran while they were in flight
            assert bench["methods"][m]["inflight_steps"] >= 1 and _finite(bench["methods"][m]["slowdown"])
        # the phases of the trainer's own saves, from its checkpoint events: they add up to the stall
        ours = bench["methods"]["nvrx_async"]
        timeline = [
            "wait",
            "collect",
            "rank_state",
            "stage",
            "plan",
            "handoff",
            "copy",
            "copy_wait",
            "digest",
            "background",
            "agree",
            "publish",
        ]
        assert (
            list(ours["phases"]) == timeline
        )  # copy and digest: beside the next step, which waits for the copy before its update (copy_wait)
        assert next(iter(ours["warmup_phases"])) == "prepare"  # the writer's warm-up, after the first step
        stalled = sum(
            ours["warmup_phases"][k] for k in ("wait", "collect", "rank_state", "stage", "plan", "handoff", "copy_wait")
        )
        # Rank 0's phases lie within its stall, and the bench's stall is the slowest rank's.
        assert 0 < stalled <= ours["warmup_stall_s"] + 1e-3
        assert "write" in bench["methods"]["dcp_save"]["phases"] and "phases" not in bench["methods"]["torch_save"]
    elif name == "recovery":
        for method, per_fault in bench["methods"].items():
            run = per_fault["exception"]
            assert _finite(run["recovery_s"]) and run["recovery_s"] > 0 and run["lost_steps"] >= 0
            assert (
                run["layer"]
                == {"inprocess": "in_process", "ft_injob": "in_job", "torchrun": "in_job", "cold": "cold"}[method]
            )
            # The restart event's timeline (a cold restart writes none), ending with the first step.
            assert list(run["phases"])[-1:] == ([] if method == "cold" else ["first_step"])
    elif name == "overhead":
        assert all(_finite(m["steps_per_s"]) and m["steps_per_s"] > 0 for m in bench["methods"].values())
        assert _finite(bench["overhead"])
        p, methods = bench["params"], bench["methods"]
        for method_name, m in methods.items():
            loaded = method_name.endswith("_loaded")
            assert set(m["models"]) == ({p["primary"]} if loaded else set(p["models"]))  # the loaded rows: one size
            assert m["base"] is None or (m["base"] in methods and m["base"].endswith("_loaded") == loaded)
            for size, s in m["models"].items():
                assert (
                    len(s["samples"]) == p["reps"]
                    and _finite(s["ratio"])
                    and (m["base"] is None) == (s["vs_base"] is None)
                )
                ref = methods["plain_loaded" if loaded else "plain"]["models"][size]["steps_per_s"]
                assert math.isclose(s["ratio"], s["steps_per_s"] / ref)  # each ratio is against its own plain run
        assert methods["plain"]["ratio"] == methods["plain_loaded"]["ratio"] == 1.0
    elif name == "soak":
        _check_soak(bench)
    elif name == "load":
        for method in bench["methods"].values():
            assert method["load_anon_mib_per_rank"] > 0 and _finite(method["anon_over_model"]) and method["seconds"] > 0
        assert bench["params"]["parameters"] > 0
    else:
        for method in bench["methods"].values():
            assert 0 < method["goodput"] < 1 and method["runs"][0]["steps"] == bench["params"]["steps"]
            assert method["runs"][0]["faults"] == len(bench["params"]["fault"].split(","))


def _check_crossover(bench: dict) -> None:
    """Each (model, interval) cell ran both modes over the same steps; the ratio is of their walls."""
    p = bench["params"]
    assert [(c["model"], c["every"]) for c in bench["cells"]] == [(m, k) for m in p["models"] for k in p["intervals"]]
    for c in bench["cells"]:
        for mode in ("sync", "async"):
            run = c[mode]
            assert run["saves"] == p["steps"] // c["every"] and run["wall_s"] > 0 and run["bytes_per_rank"] > 0
        assert math.isclose(c["async_over_sync"], c["async"]["wall_s"] / c["sync"]["wall_s"])
    won = [c for c in bench["cells"] if c["async_over_sync"] < 1]
    assert (bench["crossover"] is None) == (not won)
    (t,) = bench["targets"]
    assert t["value"] == min(c["async_over_sync"] for c in bench["cells"]) and t["met"] == bool(won)


def _check_soak(bench: dict) -> None:
    """The soak's schedule comes from its calibration, and every fault of it is accounted for."""
    p = bench["params"]
    assert _finite(p["calibration"]["step_wall_s"]) and p["calibration"]["step_wall_s"] > 0
    assert (p["steps"], p["fault"]) == schedule(p["fault_interval_steps"], p["ckpt_every"], p["faults"])
    assert p["fault_interval_steps"] == 3 * p["ckpt_every"] and p["ckpts_per_fault"] == 3  # as asked
    ours = {"exception": "in_process", "sigkill": "in_job", "hang": "in_job"}
    expected_layers = {
        "resilient": ours,
        "resilient_local": ours,
        "baseline": {"exception": "in_job", "sigkill": "in_job", "hang": "in_job"},
    }
    for name, method in bench["methods"].items():
        run = method["runs"][0]
        assert run["steps"] == p["steps"] and run["faults"] == p["faults"] == len(run["per_fault"])
        # ETTR counts the loop's time between steps too, goodput only the steps themselves.
        assert 0 < method["goodput"] <= method["ettr"] < 1
        for item, fault in zip(p["fault"].split(","), run["per_fault"], strict=True):
            assert f"{fault['kind']}@{fault['step']}:{fault['rank']}" == item
            assert fault["recovery_s"] > 0 and 0 <= fault["lost_steps"] < fault["step"]
            assert fault["layer"] == expected_layers[name][fault["kind"]]
            # the local tier resumes each fault from its snapshot of the step before (at most 1 lost),
            # unless a durable checkpoint is as new (the calibrated schedule can put one there): that one is taken
            if name == "resilient_local":
                as_new = fault["resumed_from_step"] % p["ckpt_every"] == 0
                assert fault["lost_steps"] <= 1 and (fault["source"] == "local" or as_new), fault
            else:
                assert fault["source"] == "durable"
        assert run["lost_steps"] == sum(f["lost_steps"] for f in run["per_fault"])
        assert set(bench["per_kind"][name]) == {f["kind"] for f in run["per_fault"]}
    assert [t["target"].split(" >=")[0] for t in bench["targets"]] == [
        "soak goodput resilient / baseline",
        "soak goodput resilient",
        "soak goodput resilient_local / resilient",
    ]
    assert bench["methods"]["resilient_local"]["vs_single_tier"] > 0
    two_tier, ours = bench["methods"]["resilient_local"], bench["methods"]["resilient"]
    assert math.isclose(
        two_tier["wall_vs_single_tier"], ours["wall_s"] / two_tier["wall_s"]
    )  # the same steps: the sooner, the better
    assert bench["methods"]["resilient_local"]["ceiling_vs_single_tier"] >= 1  # the single tier's redone steps, removed


@pytest.mark.timeout(900)
def test_the_checkpoint_benchmark_saves_your_own_model(tmp_path: Path) -> None:
    from tests.integration.test_models import save_model

    model = save_model(tmp_path / "llama", "llama", weights=False)
    out = tmp_path / "bench.json"
    args = ("--quick", "--model", f"hf:{model}", "--json", str(out), "--work", str(tmp_path / "work"))
    proc = rfsdp("bench", "checkpoint", *args, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    bench = json.loads(out.read_text())["benchmarks"]["checkpoint"]
    assert (
        bench["params"]["model"] == f"hf:{model}" and bench["params"]["parameters"] > 100_000
    )  # the Llama's, not a built-in size's
    assert (
        set(bench["methods"]) == EXPECTED["checkpoint"]["methods"]
        and bench["methods"]["torch_save"]["stall_ratio"] == 1.0
    )
